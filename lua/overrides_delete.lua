-- Remove one per-identity override (gateway/overrides.py); keys as in overrides_put.lua.
--   ARGV  token, the rule's name
-- Returns 1 if there was one (the rule's version is bumped), else 0.
local hash, versions = KEYS[1], KEYS[2]
if redis.call('HDEL', hash, ARGV[1]) == 0 then
  return 0
end
redis.call('HINCRBY', versions, ARGV[2], 1)
return 1
