-- Store one per-identity override (gateway/overrides.py); no units: counts of fields.
--   KEYS[1]  the rule's overrides: a hash, identity token -> the override's parameters (JSON)
--   KEYS[2]  the route's versions: a hash, rule name -> a counter bumped by every change
--   KEYS[3]  the rule's last changes: a list of identity tokens, one per version, the newest last
--   ARGV     token, parameters, the rule's max_overrides, the rule's name, changes kept
-- Returns the rule's new version, or -1 when the rule holds max_overrides already (a replacement
-- of an identity's override is always accepted).
local hash, versions, changes = KEYS[1], KEYS[2], KEYS[3]
local token, value, most, rule = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if redis.call('HEXISTS', hash, token) == 0 and redis.call('HLEN', hash) >= most then
  return -1
end
redis.call('HSET', hash, token, value)
redis.call('RPUSH', changes, token)
redis.call('LTRIM', changes, -tonumber(ARGV[5]), -1)
return redis.call('HINCRBY', versions, rule, 1)
