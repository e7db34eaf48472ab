-- Remove one per-identity override (gateway/overrides.py); keys as in overrides_put.lua.
--   ARGV  token, the rule's name, changes kept
-- Returns 1 if there was one (the rule's version is bumped), else 0.
local hash, versions, changes = KEYS[1], KEYS[2], KEYS[3]
if redis.call('HDEL', hash, ARGV[1]) == 0 then
  return 0
end
redis.call('RPUSH', changes, ARGV[1])
redis.call('LTRIM', changes, -tonumber(ARGV[3]), -1)
redis.call('HINCRBY', versions, ARGV[2], 1)
return 1
