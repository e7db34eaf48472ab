-- One read or bookkeeping command on one key, for gateway/overrides.py: KEYS[1] the key, ARGV[1]
-- the command (HGETALL, HGET, HLEN, HSCAN, SADD, SREM, SMEMBERS; GET and INCR of the change
-- signal; HSET, HDEL, HMGET of the identities overrides are shown as;
-- ZRANGEBYLEX of a consumer's API keys), ARGV[2...] its other arguments.
local allowed = {HGETALL = true, HGET = true, HLEN = true, HSCAN = true, SADD = true, SREM = true, SMEMBERS = true,
                 GET = true, INCR = true, HSET = true, HDEL = true, HMGET = true, ZRANGEBYLEX = true}
if not allowed[ARGV[1]] then
  return redis.error_reply('not an overrides command: ' .. tostring(ARGV[1]))
end
return redis.call(ARGV[1], KEYS[1], unpack(ARGV, 2))
