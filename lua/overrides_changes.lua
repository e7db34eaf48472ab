-- What changed in one rule's overrides since the version a worker holds (gateway/overrides.py), or
-- in the API keys (gateway/api_keys.py: the plans hash, its changes, the field `keys` of its versions).
--   KEYS  the rule's overrides hash, its changes list, the route's versions hash (overrides_put.lua)
--   ARGV  the rule's name, the version held
-- Returns {version, 1, token, parameters or false (removed), ...}: every change since; or
-- {version, 0} when the list no longer holds them all (the worker reads the hash whole).
local version = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local n = version - tonumber(ARGV[2])
if n < 0 or n > redis.call('LLEN', KEYS[2]) then
  return {version, 0}
end
local out = {version, 1}
if n == 0 then
  return out
end
for _, token in ipairs(redis.call('LRANGE', KEYS[2], -n, -1)) do
  out[#out + 1] = token
  out[#out + 1] = redis.call('HGET', KEYS[1], token)
end
return out
