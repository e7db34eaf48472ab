-- What changed in the API keys since the version a worker holds (gateway/api_keys.py).
--   KEYS  the plans hash, the changes list, the version counter (keys_write.lua)
--   ARGV  the version held
-- Returns {version, 1, digest, plan or false (removed), ...}: every change since; or {version, 0}
-- when the list no longer holds them all (the worker reads the hash whole).
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = version - tonumber(ARGV[1])
if n < 0 or n > redis.call('LLEN', KEYS[2]) then
  return {version, 0}
end
local out = {version, 1}
if n == 0 then
  return out
end
for _, digest in ipairs(redis.call('LRANGE', KEYS[2], -n, -1)) do
  out[#out + 1] = digest
  out[#out + 1] = redis.call('HGET', KEYS[1], digest)
end
return out
