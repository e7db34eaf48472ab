-- Register, replace or remove API keys (gateway/api_keys.py), all in one call: all or none.
--   KEYS[1]  the plans: a hash, key digest (16 hex digits) -> plan name, or "PLAN CONSUMER" for a key
--            of a named consumer (a key without one is its own consumer)
--   KEYS[2]  the last changes: a list of digests, one per version, the newest last
--   KEYS[3]  the versions: a hash whose field `keys` is bumped by every change (read by overrides_changes.lua)
--   KEYS[4]  the metadata: a hash, key digest -> a JSON object
--   KEYS[5]  the consumers' keys: a sorted set of "CONSUMER DIGEST", all at score 0 (read by range)
--   ARGV     changes kept, then digest, value ('' removes the key), metadata ('' none) triples
-- Returns {version, how many of the digests were there before}.
local plans, changes, version, meta, members = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local function consumer_of(value)
  return value and string.match(value, '^[^ ]+ (.+)$')
end
local found = 0
for i = 2, #ARGV, 3 do
  local digest, value, metadata = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local old = consumer_of(redis.call('HGET', plans, digest))
  if old then
    redis.call('ZREM', members, old .. ' ' .. digest)
  end
  if value == '' then
    found = found + redis.call('HDEL', plans, digest)
  else
    found = found + 1 - redis.call('HSET', plans, digest, value)
    local new = consumer_of(value)
    if new then
      redis.call('ZADD', members, 0, new .. ' ' .. digest)
    end
  end
  if metadata == '' then
    redis.call('HDEL', meta, digest)
  else
    redis.call('HSET', meta, digest, metadata)
  end
  redis.call('RPUSH', changes, digest)
end
redis.call('LTRIM', changes, -tonumber(ARGV[1]), -1)
return {redis.call('HINCRBY', version, 'keys', (#ARGV - 1) / 3), found}
