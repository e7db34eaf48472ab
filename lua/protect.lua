-- protect: scope fleet (gateway/protect.py): one in-flight limit for every gateway in front of an upstream.
-- units: µs from Redis TIME; limits are sent and returned in thousandths (Lua numbers reach Redis as integers).
--   KEYS[1]  the slots: a sorted set, one member per request in flight (token:1), scored by its lease's expiry;
--            given back and renewed by lua/leases.lua, as a concurrency rule's are
--   KEYS[2]  the fleet's limit: a hash {limit, stepped (µs), probe_until (µs)}
--   ARGV[1]  'take': ARGV[2] token, ARGV[3] the priority's share in thousandths, ARGV[4] the lease in µs,
--            ARGV[5] the limit to start from if the fleet has none yet, ARGV[6] min_limit
--            -> {1 taken or 0 refused, requests in flight, the limit, the limit in force (half while a probe runs)}
--   ARGV[1]  'step': ARGV[2] the limit a gateway's controller proposes, ARGV[3] its window in µs (one step
--            per window for the whole fleet: a proposal within a window of the last step is dropped),
--            ARGV[4] 1: run the next window at half the limit (the controller re-measures the unloaded time)
--            -> {1 stepped or 0 dropped, the limit}
local call, fmt, floor = redis.call, string.format, math.floor
local t = call('TIME')
local now = t[1] * 1000000 + t[2]
local slots, state = KEYS[1], KEYS[2]
local STATE_TTL = 86400000   -- ms: a fleet gone quiet for a day starts again from its gateways' limits
local limit = tonumber(call('HGET', state, 'limit'))

if ARGV[1] == 'take' then
  local lease, min = tonumber(ARGV[4]), tonumber(ARGV[6])
  if not limit then
    limit = tonumber(ARGV[5]) / 1000
    call('HSET', state, 'limit', limit, 'stepped', fmt('%d', now))
    call('PEXPIRE', state, STATE_TTL)
  end
  local probing = (tonumber(call('HGET', state, 'probe_until')) or 0) > now
  local in_force = limit
  if probing then in_force = math.max(min, limit / 2) end
  call('ZREMRANGEBYSCORE', slots, '-inf', fmt('%d', now))   -- the slots of gateways that died holding them
  local count = call('ZCARD', slots)
  local ok = 0
  if count == 0 or count < in_force * tonumber(ARGV[3]) / 1000 then
    local until_us = now + lease
    call('ZADD', slots, fmt('%d', until_us), ARGV[2] .. ':1')
    count = count + 1
    ok = 1
    local last = call('ZRANGE', slots, '-1', '-1', 'WITHSCORES')   -- the key lives as long as its last lease
    call('PEXPIREAT', slots, fmt('%d', math.ceil(tonumber(last[2]) / 1000)))
  end
  return {ok, count, floor(limit * 1000), floor(in_force * 1000)}
end

-- 'step'
local stepped = tonumber(call('HGET', state, 'stepped')) or 0
if limit and now < stepped + tonumber(ARGV[3]) then
  return {0, floor(limit * 1000)}
end
limit = tonumber(ARGV[2]) / 1000
call('HSET', state, 'limit', limit, 'stepped', fmt('%d', now))
if ARGV[4] == '1' then call('HSET', state, 'probe_until', fmt('%d', now + tonumber(ARGV[3]))) end
call('PEXPIRE', state, STATE_TTL)
return {1, floor(limit * 1000)}
