-- units: time in microseconds from Redis TIME; windows, intervals, reset, retry and delay in microseconds; counts in request units
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
--   ARGV[7 + 5(i-1)]  1 if the rule is shadow (counts, never refuses, never delays)
-- Returns {admitted, refusing rule (0 = none), retry_us (-1 = never), delay_us,
--          then per rule: outcome, remaining, reset_us (-1 = never)}
-- outcome: 0 admits, 1 refuses, 2 can never fit (or never refills), 3 shadow rule that would refuse.
--
-- Phase 1 reads every rule's state (one MGET for all, more only where needed) and decides; phase 2
-- writes only if every enforced rule admits. State, one key per rule and identity, every key with
-- a TTL but a quota's without period:
--   fixed_window, quota   the count; expires at the last millisecond of its window (period)
--   sliding_window        one integer: cantor(current, previous) * 4 + window number mod 4
--                         ("window:current:previous" when limit >= 2^24); expires with the next window
--   sliding_log           sorted set, one member per admitted unit, scored by its time
--   token_bucket, gcra    the time the bucket is full again (theoretical arrival time); the key
--                         expires then. On Redis 7 the key's expiry holds the milliseconds and the
--                         value only the rest (0..999 µs): a shared small integer, no allocation
--   leaky_bucket          the same, as the time the queue is empty
-- Bucket intervals are whole microseconds (1e6/rate rounded up: never more than the rate), so the
-- arithmetic is exact and a burst is a burst. Integers below 2^53 go to redis.call as Lua numbers:
-- 6.2 and 7 both print them exactly.
-- A clock step backwards: state from the future counts as used up now and is rewritten to end
-- within one window or burst period (a repair write, done whatever the outcome, never when peeking).

local call = redis.call
local tonumber, floor, ceil, sqrt = tonumber, math.floor, math.ceil, math.sqrt
local fmt = string.format

local n = tonumber(ARGV[1])
if n == 0 then return {1, 0, 0, 0} end
local peek = ARGV[2] == '1'
local t = call('TIME')
local now = t[1] * 1000000 + t[2]
local now_ms = floor(now / 1000)
local EXPIRY_HOLDS_TIME = (redis.REDIS_VERSION_NUM or 0) >= 0x070000
local PACK_LIMIT = 16777216
local values = call('MGET', unpack(KEYS))   -- false for a missing key (or one that is not a string)

local out = {1, 0, 0, 0}
local worst, delay = 0, 0
local w, nw = {}, 0   -- admission writes, 5 slots each: key, op, a, b, c (done only if all admit)
local f, nf = {}, 0   -- repairs after a clock step backwards, same layout (done unless peeking)

for i = 1, n do
  local base = 5 * i - 2
  local algo = ARGV[base]
  local p1, p2, cost = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local key, v = KEYS[i], values[i]
  local ok, remaining, reset, retry, wait = false, 0, 0, -1, 0
  local op, a, b, c                    -- this rule's write, if the request is admitted
  local fop, fa, fb                    -- this rule's repair, if its state came from the future

  if algo == '4' or algo == '5' or algo == '6' then
    -- buckets: p1 = burst, p2 = emission interval; state = the time the bucket is full again
    local step = ceil(p2 - 1e-6)
    if step < 1 then step = 1 end
    local span = p1 * step
    local leaky = algo == '6'
    local cap = leaky and span + step or span
    local tat = 0
    if v then
      tat = tonumber(v) or 0
      if tat < 1000 then
        if EXPIRY_HOLDS_TIME then
          local at = call('PEXPIRETIME', key)
          tat = at > 0 and at * 1000 - tat or 0
        else
          tat = 0
        end
      end
    end
    if tat < now then
      tat = now
    elseif tat > now + cap then
      tat = now + cap                  -- from the future: used up now, full again within `cap`
      fop, fa = 'T', tat
    end
    local ahead = tat - now
    if leaky then
      -- a request of cost c takes c departure slots and leaves at the first (wait = ahead)
      remaining = floor((span - ahead) / step) + 1
      reset = ahead
      if cost - 1 <= p1 then
        local need = ahead + (cost - 1) * step - span
        if need <= 0 then
          ok, wait = true, ahead
          ahead = ahead + cost * step
          remaining = floor((span - ahead) / step) + 1
          reset = ahead
          op, a = 'T', now + ahead
        else
          retry = need
        end
      end
    else
      remaining = floor((span - ahead) / step)
      reset = ahead
      if cost <= p1 then
        local need = ahead + cost * step - span
        if need <= 0 then
          ok = true
          ahead = ahead + cost * step
          remaining = floor((span - ahead) / step)
          reset = ahead
          op, a = 'T', now + ahead
        else
          retry = need
        end
      end
    end

  elseif algo == '1' or algo == '7' then
    -- fixed_window (p2 = window) and quota (p2 = period, 0 = never refills): a count
    local count = v and tonumber(v) or nil
    local numeric = count ~= nil
    if not numeric then count = 0 end
    local last_ms = 0
    reset = -1
    if p2 > 0 then
      local stop = (floor(now / p2) + 1) * p2
      reset = stop - now
      last_ms = ceil(stop / 1000) - 1  -- the window's last millisecond: the count is gone at `stop`
    end
    remaining = p1 - count
    if cost <= p1 then
      if count + cost <= p1 then
        ok = true
        remaining = p1 - count - cost
        if p2 > 0 then
          op, a, b = 'W', count + cost, last_ms
        elseif numeric then
          op, a = 'I', cost
        else
          op, a = 'S', count + cost
        end
      else
        retry = reset
        if p2 > 0 and count > 0 and not peek then
          -- refused: make sure the count ends with this window (after a clock step backwards
          -- it would end with a later one). SET, not PEXPIREAT: in the window's last millisecond
          -- PEXPIREAT would delete the key at once, SET ... PXAT keeps it to the end of it
          local ttl = call('PTTL', key)
          if ttl < 0 or now_ms + ttl > last_ms + 1 then fop, fa, fb = 'W', v, last_ms end
        end
      end
    end

  elseif algo == '2' then
    -- sliding_window (approximating counter): p1 = limit, p2 = window
    local wid = floor(now / p2)
    local elapsed = now - wid * p2
    local last_ms = ceil((wid + 2) * p2 / 1000) - 1   -- counts matter until the next window ends
    local rel, sc, sp = nil, 0, 0
    if v then
      local num = tonumber(v)
      if num then
        local w4 = num % 4
        num = (num - w4) / 4
        local s = floor((sqrt(8 * num + 1) - 1) / 2)
        while s * (s + 1) / 2 > num do s = s - 1 end
        while (s + 1) * (s + 2) / 2 <= num do s = s + 1 end
        sp = num - s * (s + 1) / 2
        sc = s - sp
        rel = (wid - w4) % 4             -- 0 this window, 1 the last one, 2 or 3 the future
      else
        local sw, x, y = string.match(v, '^(%d+):(%d+):(%d+)$')
        if sw then
          rel, sc, sp = wid - tonumber(sw), tonumber(x), tonumber(y)
          if rel < 0 then rel = 2 elseif rel > 1 then rel = nil end
        end
      end
    end
    -- a state written a multiple of four windows ahead (less one: rel 1) looks current (or last):
    -- its expiry, beyond the next window's end, tells. Asked where it changes the answer: a last
    -- window's count, a previous count weighted now, or (below) a refusal that could wedge the key.
    local future, checked = rel == 2 or rel == 3, false
    if rel == 1 or (rel == 0 and sp > 0) then
      local ttl = call('PTTL', key)
      future, checked = ttl < 0 or now_ms + ttl > last_ms + 1, true
    end
    local cur, prev, room
    for pass = 1, 2 do
      if future then
        cur, prev = sc + sp, 0           -- from the future: all of it counts as used up now
        if cur > p1 then cur = p1 end
      elseif rel == 1 then
        cur, prev = 0, sc
      elseif rel == 0 then
        cur, prev = sc, sp
      else
        cur, prev = 0, 0
      end
      -- admitted iff prev * (window - elapsed) / window + cur + cost <= limit, kept in integers
      room = (p1 - cur - cost) * p2 - prev * (p2 - elapsed)
      if room >= 0 or checked or future or peek or rel ~= 0 or cost > p1 then break end
      local ttl = call('PTTL', key)
      future, checked = ttl < 0 or now_ms + ttl > last_ms + 1, true
      if not future then break end
    end
    local avail = room + cost * p2
    remaining = floor(avail / p2)
    if remaining * p2 > avail then remaining = remaining - 1 end
    reset = p2 - elapsed
    if cost <= p1 then
      if room >= 0 then
        ok = true
        remaining = remaining - cost
        op, b = 'W', last_ms
        if p1 < PACK_LIMIT then
          local s = cur + cost + prev
          a = (s * (s + 1) / 2 + prev) * 4 + wid % 4
        else
          a = fmt('%d:%d:%d', wid, cur + cost, prev)
        end
      else
        local r
        if prev > 0 and cur + cost <= p1 then
          -- later in this window: prev * (window - elapsed - r) <= (limit - cur - cost) * window
          local x = (p1 - cur - cost) * p2
          local q = floor(x / prev)
          if q * prev > x then q = q - 1 end
          r = p2 - elapsed - q
        end
        if r == nil or r >= p2 - elapsed then
          -- in the next window, at y into it: cur * (window - y) <= (limit - cost) * window
          local y = 0
          if cur > 0 then
            local x = (p1 - cost) * p2
            local q = floor(x / cur)
            if q * cur > x then q = q - 1 end
            y = p2 - q
            if y < 0 then y = 0 end
          end
          r = p2 - elapsed + y
        end
        if p1 * p2 > 4503599627370496 then r = r + ceil(p1 * p2 / 2251799813685248) end -- floats past 2^52
        retry = r
      end
    end
    if future then
      -- rewritten as this window's, so that it is over within one window (the admission's own
      -- write does the same)
      fop, fb = 'W', last_ms
      if p1 < PACK_LIMIT then
        fa = (cur * (cur + 1) / 2) * 4 + wid % 4
      else
        fa = fmt('%d:%d:%d', wid, cur, 0)
      end
    end

  else
    -- sliding_log: p1 = limit, p2 = window; at most `limit` in any window (now - p2, now]
    local count, edge, exists = 0, '(' .. fmt('%d', now - p2), false
    if not v then
      local last = call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if last[2] then
        exists = true
        if tonumber(last[2]) > now then fop = 'Z' end   -- from the future: count as made now
        count = call('ZCOUNT', key, edge, '+inf')
      end
    end
    reset = p2
    if count > 0 then
      local oldest = tonumber(call('ZRANGEBYSCORE', key, edge, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
      if oldest > now then oldest = now end
      reset = oldest + p2 - now
    end
    remaining = p1 - count
    if cost <= p1 then
      if count + cost <= p1 then
        ok = true
        remaining = p1 - count - cost
        -- a string under this key is another algorithm's state: replaced by a fresh log
        op, a, b, c = 'L', count, v and 'DEL' or (exists and 'TRIM' or ''), i
      else
        local kth = tonumber(call('ZRANGEBYSCORE', key, edge, '+inf', 'WITHSCORES', 'LIMIT',
                                  count + cost - p1 - 1, 1)[2])
        if kth > now then kth = now end
        retry = kth + p2 - now
      end
    end
  end

  local outcome = 0
  local shadow = ARGV[base + 4] == '1'
  if ok then
    if cost > 0 then
      nw = nw + 5
      w[nw - 4], w[nw - 3], w[nw - 2], w[nw - 1], w[nw] = key, op, a, b, c
    end
    if wait > delay and not shadow then delay = wait end
  elseif shadow then
    outcome = 3
  else
    outcome = retry < 0 and 2 or 1
    if out[1] == 1 or (worst >= 0 and (retry < 0 or retry > worst)) then
      out[2] = i
      worst = retry
    end
    out[1] = 0
  end
  if fop then
    nf = nf + 5
    f[nf - 4], f[nf - 3], f[nf - 2], f[nf - 1] = key, fop, fa, fb
  end
  if remaining < 0 then remaining = 0 end
  out[3 * i + 2] = outcome
  out[3 * i + 3] = floor(remaining)
  out[3 * i + 4] = reset < 0 and -1 or ceil(reset)
end

if peek then
  nw, nf = 0, 0
elseif out[1] == 0 then
  nw = 0
end
local BATCH = 500

-- repairs first, so that an admission's own write to the same key comes last
for j = 5, nf + nw, 5 do
  local list, k = f, j
  if j > nf then list, k = w, j - nf end
  local key, op, a, b, c = list[k - 4], list[k - 3], list[k - 2], list[k - 1], list[k]
  if op == 'T' then
    -- a bucket's time in µs: the key expires at it (rounded up to the millisecond)
    local at = ceil(a / 1000)
    if EXPIRY_HOLDS_TIME then
      call('SET', key, at * 1000 - a, 'PXAT', at)
    else
      call('SET', key, a, 'PXAT', at)
    end
  elseif op == 'W' then
    call('SET', key, a, 'PXAT', b)
  elseif op == 'I' then
    call('INCRBY', key, a)
  elseif op == 'S' then
    call('SET', key, a)
  elseif op == 'Z' then
    -- entries from the future (the clock stepped back) are made now
    local now_s = fmt('%d', now)
    local future = call('ZRANGEBYSCORE', key, '(' .. now_s, '+inf')
    local args, m = {}, 0
    for u = 1, #future do
      args[m + 1], args[m + 2] = now_s, future[u]
      m = m + 2
      if m == 2 * BATCH or u == #future then
        call('ZADD', key, 'XX', unpack(args, 1, m))
        m = 0
      end
    end
  else
    -- 'L': add `cost` members at now to the log, named now.<count + u> (unique but for clock games)
    local window, cost = tonumber(ARGV[5 * c]), tonumber(ARGV[5 * c + 1])   -- c: the rule's index
    local now_s = fmt('%d', now)
    if b == 'DEL' then
      call('DEL', key)
    elseif b == 'TRIM' then
      call('ZREMRANGEBYSCORE', key, '-inf', fmt('%d', now - window))
    end
    local args, m, added = {}, 0, 0
    for u = 1, cost do
      args[m + 1], args[m + 2] = now_s, now_s .. '.' .. (a + u)
      m = m + 2
      if m == 2 * BATCH or u == cost then
        added = added + call('ZADD', key, 'NX', unpack(args, 1, m))
        m = 0
      end
    end
    for u = 1, cost - added do
      local k = 0
      while call('ZADD', key, 'NX', now_s, now_s .. '~' .. (a + u) .. '.' .. k) == 0 do k = k + 1 end
    end
    call('PEXPIREAT', key, ceil((now + window) / 1000))
  end
end

if out[1] == 1 then
  out[4] = delay
else
  out[3] = worst
end
return out
