-- Concurrency leases (lua/decide.lua's `concurrency` rule): give back or renew the slots of requests
-- that ended or are still in flight, all of one hash tag's in one call.
-- units: µs from Redis TIME.
--   KEYS[i]        a concurrency rule's key (a sorted set of leases scored by their expiry)
--   ARGV[1]        'release' or 'renew'
--   ARGV[3i - 1]   the request's lease token; its slots are the members token:1 .. token:count
--   ARGV[3i]       count
--   ARGV[3i + 1]   the rule's lease in µs (renew: the slots now expire that long from now)
-- Returns the number of slots given back (release) or renewed (renew).
local call, fmt, ceil = redis.call, string.format, math.ceil
local t = call('TIME')
local now = t[1] * 1000000 + t[2]
local release = ARGV[1] == 'release'
local done = 0
for i = 1, #KEYS do
  local key, token, count = KEYS[i], ARGV[3 * i - 1], tonumber(ARGV[3 * i])
  if release then
    for u = 1, count do done = done + call('ZREM', key, token .. ':' .. u) end
  else
    local until_s = fmt('%d', now + tonumber(ARGV[3 * i + 1]))
    for u = 1, count do done = done + call('ZADD', key, 'XX', 'CH', until_s, token .. ':' .. u) end
    local last = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
    if last[2] then call('PEXPIREAT', key, fmt('%d', ceil(tonumber(last[2]) / 1000))) end
  end
end
return done
