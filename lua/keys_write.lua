-- Register, replace or remove API keys (gateway/api_keys.py), all in one call: all or none.
--   KEYS[1]  the plans: a hash, key digest (16 hex digits) -> plan name
--   KEYS[2]  the last changes: a list of digests, one per version, the newest last
--   KEYS[3]  the versions: a hash whose field `keys` is bumped by every change (read by overrides_changes.lua)
--   ARGV     changes kept, then digest, plan ('' removes it) pairs
-- Returns {version, how many of the digests were there before}.
local plans, changes, version = KEYS[1], KEYS[2], KEYS[3]
local found = 0
for i = 2, #ARGV, 2 do
  local digest, plan = ARGV[i], ARGV[i + 1]
  if plan == '' then
    found = found + redis.call('HDEL', plans, digest)
  else
    found = found + 1 - redis.call('HSET', plans, digest, plan)
  end
  redis.call('RPUSH', changes, digest)
end
redis.call('LTRIM', changes, -tonumber(ARGV[1]), -1)
return {redis.call('HINCRBY', version, 'keys', (#ARGV - 1) / 2), found}
