-- units: time in microseconds from Redis TIME; intervals and windows in microseconds; counts in request units
--
-- One decision for all of a route's rules, all or nothing.
--   KEYS[i]           state key of rule i (all keys share one hash tag)
--   ARGV[1]           number of rules n
--   ARGV[2]           1 = peek (report state, write nothing), 0 = decide
--   ARGV[3 + 5(i-1)]  algorithm code of rule i: 1 fixed_window, 2 sliding_window, 3 sliding_log,
--                     4 token_bucket, 5 gcra, 6 leaky_bucket, 7 quota
--   ARGV[4 + 5(i-1)]  p1: limit (windows, quota) or burst (buckets)
--   ARGV[5 + 5(i-1)]  p2: window / period (0 = none) or emission interval 1e6/rate
--   ARGV[6 + 5(i-1)]  cost
--   ARGV[7 + 5(i-1)]  1 if the rule is shadow (counts, never refuses)
-- Returns {admitted, refusing rule (0 = none), retry_us (-1 = never), delay_us,
--          then per rule: outcome, remaining, reset_us}
-- outcome: 0 admits, 1 refuses, 2 can never fit (or never refills), 3 shadow rule that would refuse.
--
-- Phase 1 reads every rule's state and decides; phase 2 writes only if every enforced rule admits.
-- State, one key per rule and identity, every key with a TTL (but a quota without period):
--   fixed_window, quota   count (INCRBY), expiring at the window/period end (PEXPIREAT)
--   sliding_window        one integer: (current * (limit+1) + previous) * 4 + window number mod 4
--                         (or "window:current:previous" when limit >= 2^23)
--   sliding_log           sorted set of admission times
--   token_bucket, gcra    one integer: the time the bucket is full again (theoretical arrival time)
--   leaky_bucket          one integer: the time the queue is empty
-- Integers (< 2^53) are passed to redis.call as Lua numbers: both 6.2 and 7 print them exactly.
-- A clock step backwards is clamped per key: state from the future counts as used up now, which
-- admits nothing extra and is gone within one window or burst period.

local n = tonumber(ARGV[1])
local peek = ARGV[2] == '1'
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local fmt = string.format
local floor, ceil = math.floor, math.ceil
local PACK_LIMIT = 8388608
-- Redis 7 can read a key's absolute expiry: a bucket then keeps its time in the expiry and only
-- the sub-millisecond rest in the value, a shared small integer (no allocation per key)
local EXPIRY_HOLDS_TIME = (redis.REDIS_VERSION_NUM or 0) >= 0x070000

local w_key, w_kind, w_a, w_b, w_cost = {}, {}, {}, {}, {}   -- pending writes, for phase 2
local nw = 0
local out = {1, 0, 0, 0}
local worst_retry = 0
local delay = 0

for i = 1, n do
  local base = 3 + 5 * (i - 1)
  local algo = ARGV[base]
  local p1, p2, cost = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local key = KEYS[i]
  local ok, remaining, reset, retry, wait = false, 0, 0, -1, 0
  local kind, a, b

  if algo == '4' or algo == '5' or algo == '6' then
    -- buckets: p1 = burst, p2 = interval; state = time the bucket is full (or queue empty) again
    local span = p1 * p2
    local leaky = algo == '6'
    local limit = leaky and span + p2 or span
    local raw = redis.call('GET', key)
    local tat = raw and tonumber(raw) or 0
    if raw and tat < 1000 then
      local at = redis.call('PEXPIRETIME', key)
      tat = at > 0 and at * 1000 - tat or 0
    end
    if tat < now then tat = now end
    if tat > now + limit then tat = now + limit end
    if leaky then
      local ahead = tat - now
      remaining = floor((span - ahead) / p2) + 1
      reset = ahead
      if cost - 1 <= p1 then
        if ahead + (cost - 1) * p2 <= span then
          ok, wait = true, ahead
          local new_tat = tat + cost * p2
          remaining = floor((span - (new_tat - now)) / p2) + 1
          reset = new_tat - now
          kind, a, b = 'TIME', ceil(new_tat), 0
        else
          retry = ceil(ahead + (cost - 1) * p2 - span)
        end
      end
    else
      remaining = floor((span - (tat - now)) / p2)
      reset = tat - now
      if cost <= p1 then
        local new_tat = tat + cost * p2
        if new_tat - now <= span then
          ok = true
          remaining = floor((span - (new_tat - now)) / p2)
          reset = new_tat - now
          kind, a, b = 'TIME', ceil(new_tat), 0
        else
          retry = ceil(new_tat - now - span)
        end
      end
    end

  elseif algo == '1' or algo == '7' then
    -- fixed_window (p2 = window) and quota (p2 = period, 0 = never refills): a count
    local count = tonumber(redis.call('GET', key) or '0')
    local stop = 0
    reset = -1
    if p2 > 0 then
      stop = (floor(now / p2) + 1) * p2
      reset = stop - now
      if count > 0 and redis.call('PTTL', key) > p2 / 1000 + 1 then
        -- written in the future (clock stepped back): keep the count, end it with this window
        redis.call('PEXPIREAT', key, ceil(stop / 1000))
      end
    end
    remaining = p1 - count
    if cost <= p1 then
      if count + cost <= p1 then
        ok = true
        remaining = p1 - count - cost
        kind, a, b = 'INCR', cost, p2 > 0 and ceil(stop / 1000) or 0
      else
        retry = reset
      end
    end

  elseif algo == '2' then
    -- sliding_window (approximating counter): p1 = limit, p2 = window
    local wid = floor(now / p2)
    local elapsed = now - wid * p2
    local cur, prev = 0, 0
    local state = redis.call('GET', key)
    if state then
      local rel
      if p1 < PACK_LIMIT then
        local v = tonumber(state) or 0
        local w4 = v % 4
        v = (v - w4) / 4
        local sc = floor(v / (p1 + 1))
        local sp = v - sc * (p1 + 1)
        rel = (wid - w4) % 4
        if rel == 1 then prev = sc elseif rel ~= 2 then cur, prev = sc, sp end
      else
        local sw, sc, sp = string.match(state, '^(%d+):(%d+):(%d+)$')
        sw, sc, sp = tonumber(sw), tonumber(sc), tonumber(sp)
        if sw == wid - 1 then prev = sc elseif sw and sw >= wid then cur, prev = sc, sp end
      end
    end
    local estimate = prev * (p2 - elapsed) / p2 + cur
    remaining = p1 - estimate
    reset = p2 - elapsed
    if cost <= p1 then
      if estimate + cost <= p1 then
        ok = true
        remaining = p1 - estimate - cost
        local value
        if p1 < PACK_LIMIT then
          value = ((cur + cost) * (p1 + 1) + prev) * 4 + wid % 4
        else
          value = fmt('%d:%d:%d', wid, cur + cost, prev)
        end
        kind, a, b = 'SET', value, ceil((2 * p2 - elapsed) / 1000)
      else
        local r
        if cur + cost <= p1 and prev > 0 then
          r = (p2 - elapsed) - (p1 - cur - cost) * p2 / prev
        end
        if r == nil or r >= p2 - elapsed then
          local into_next = 0
          if cur > 0 then into_next = p2 - (p1 - cost) * p2 / cur end
          if into_next < 0 then into_next = 0 end
          r = (p2 - elapsed) + into_next
        end
        retry = ceil(r) + 1
      end
    end

  else
    -- sliding_log: p1 = limit, p2 = window; one member per admitted unit, scored by time
    local now_s = fmt('%d', now)
    local future = redis.call('ZRANGEBYSCORE', key, '(' .. now_s, '+inf')
    for _, member in ipairs(future) do
      redis.call('ZADD', key, 'XX', now_s, member)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt('%d', now - p2))
    local count = redis.call('ZCARD', key)
    reset = p2
    if count > 0 then
      local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      reset = tonumber(oldest[2]) + p2 - now
    end
    remaining = p1 - count
    if cost <= p1 then
      if count + cost <= p1 then
        ok = true
        remaining = p1 - count - cost
        kind, a, b = 'ZADD', now_s, ceil(p2 / 1000)
      else
        local kth = redis.call('ZRANGE', key, count + cost - p1 - 1, count + cost - p1 - 1, 'WITHSCORES')
        retry = tonumber(kth[2]) + p2 - now + 1
      end
    end
  end

  local outcome = 0
  if ok then
    nw = nw + 1
    w_key[nw], w_kind[nw], w_a[nw], w_b[nw] = key, kind, a, b
    if wait > delay then delay = wait end
    w_cost[nw] = cost
  elseif ARGV[base + 4] == '1' then
    outcome = 3
  else
    outcome = retry < 0 and 2 or 1
    if out[1] == 1 or (worst_retry >= 0 and (retry < 0 or retry > worst_retry)) then
      out[2] = i
      worst_retry = retry
    end
    out[1] = 0
  end
  if remaining < 0 then remaining = 0 end
  out[3 + 3 * i - 1] = outcome
  out[3 + 3 * i] = floor(remaining)
  out[3 + 3 * i + 1] = ceil(reset)
end

if out[1] == 1 then
  if not peek then
    for j = 1, nw do
      local key, kind, a, b = w_key[j], w_kind[j], w_a[j], w_b[j]
      if kind == 'TIME' then
        -- a is the bucket's time in µs; the key expires at it (rounded up to the millisecond)
        local at = ceil(a / 1000)
        if EXPIRY_HOLDS_TIME then
          redis.call('SET', key, at * 1000 - a, 'PXAT', at)
        else
          redis.call('SET', key, a, 'PX', at - floor(now / 1000))
        end
      elseif kind == 'SET' then
        redis.call('SET', key, a, 'PX', b > 0 and b or 1)
      elseif kind == 'INCR' then
        redis.call('INCRBY', key, a)
        if b > 0 then redis.call('PEXPIREAT', key, b) end
      else
        local cost = w_cost[j]
        for u = 1, cost do
          local member = a .. ':' .. u
          local k = 0
          while redis.call('ZADD', key, 'NX', a, member) == 0 do
            k = k + 1
            member = a .. ':' .. u .. ':' .. k
          end
        end
        redis.call('PEXPIRE', key, b)
      end
    end
  end
  out[4] = ceil(delay)
else
  out[3] = worst_retry
end
return out
