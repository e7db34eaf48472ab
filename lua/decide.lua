-- The fragments of a decision script. gateway/decision_script.py writes one script per route (and
-- one read-only script per rule for the admin port) from the fragments below: `head`, one rule
-- fragment per rule, that rule's `verdict`, the writes, `tail`. Each rule's parameters are
-- constants in its fragment (@-names, filled in by string.Template), so a call sends only its keys
-- and its costs.
--
-- units: time in microseconds from Redis TIME; windows, intervals, reset, retry and delay in
-- microseconds; counts in request units. Replies carry milliseconds, rounded up.
--
--   KEYS[i]   state key of rule i (all keys share one hash tag)
--   ARGV[i]   cost of rule i, or '' when the request has no identity for it (on_missing: skip):
--             that rule is neither read nor written nor reported, so one script serves a route
--             whatever identities its requests carry. Negative: units given back (a refund).
--   @charge   false: the rule is checked (it refuses while its budget is spent) but an admission
--             writes nothing; it is charged after the answer (count_on, cost: response_header)
--   @force    true: the settling script run after the answer: every rule takes its cost, charge or
--             refund, whatever its room (a charge after the answer cannot be refused any more)
-- Returns {head, then per rule one integer (two when the numbers do not fit in one)}:
--   head     admitted: delay_ms * 2 + 1; refused: ((retry_ms + 1) * 256 + refusing rule) * 2,
--            retry_ms = -1 when the request can never be admitted as it is
--   rule     (remaining * @radix + reset_ms + 1) * 4 + outcome, reset_ms = -1 for never; or the
--            two integers remaining and (reset_ms + 1) * 4 + outcome
--   outcome  0 admits, 1 refuses, 2 can never fit (or never refills), 3 shadow rule that would refuse
--
-- Phase 1 reads every rule's state (one MGET for all, more only where needed) and decides; phase 2
-- writes only if every enforced rule admits. State, one key per rule and identity, every key with
-- a TTL but a quota's without period:
--   fixed_window, quota   the count; expires at the last millisecond of its window (period)
--   sliding_window        one 19-digit integer: d (1..8), cantor(current, previous) in 18 - d
--                         digits, the window number mod 10^d in d digits (below 2^63: Redis keeps
--                         it as an integer; d is the most the rule's limit leaves room for, and
--                         any rule reads any d: a changed limit keeps the counts);
--                         "window:current:previous" when limit >= 2^24; expires with the next window
--                         (set by a window's first write, kept by its later ones: INCRBY of the
--                         pair's change, or SET KEEPTTL of the string)
--   sliding_log           sorted set, one member per admitted unit, scored by its time
--   token_bucket, gcra    the time the bucket is full again (theoretical arrival time), in µs; the
--                         key expires then. (Before, on Redis 7, the value held only the rest below
--                         the millisecond and the expiry the milliseconds: read with PEXPIRETIME,
--                         a call per decision; such a value, below 1000, is still read so.)
--   leaky_bucket          the same, as the time the queue is empty
-- A decision of rules that all admit makes TIME, one MGET and one write per rule: what a rule needs
-- to tell its state is in the value, never in the key's TTL, but where noted below.
-- What the script's parts cost Redis (callgrind, 6.2): string.format ~2k instructions, tonumber
-- ~2k (it runs strtod twice), string.sub ~1k, a Lua operation ~40; setting a key's expiry costs
-- more than the SET that carries it.
-- Bucket intervals are whole microseconds (1e6/rate rounded up: never more than the rate), so the
-- arithmetic is exact and a burst is a burst. Numbers go to redis.call as strings made by
-- fmt('%d'): Redis prints a Lua number with '%.17g', several thousand instructions each (callgrind).
-- A clock step backwards: state from the future counts as used up now and is rewritten to end
-- within one window or burst period (a repair write, done whatever the outcome, never when peeking).

--@@ head
-- only what every decision uses is made local here (a global read costs a table lookup, and a
-- script pays for every line it runs): the rest is read where used, or made local by a rule's
-- `locals` fragment below when its kind of rule is in the script
local call, KEYS, ARGV, tonumber, fmt = redis.call, KEYS, ARGV, tonumber, string.format
local t = call('TIME')
local now = t[1] * 1000000 + t[2]
-- integer division by arithmetic, not math.floor/ceil: a library call costs more than the line
-- around it. For integers x and d: floor(x / d) = (x - x % d) / d, ceil(x / d) = (x + (-x) % d) / d
local values = call('MGET', @keys)   -- false for a missing key (or one that is not a string)
local out = {@slots}
local refused, by, worst@delay_local = false, 0, 0@delay_zero

--@@ override_params
-- per-identity overrides (gateway/overrides.py): in a script of a route with overridden rules, the
-- last ARGV (after the costs and any lease token) holds their numbers, five doubles per overridden
-- rule, little-endian (gateway/decision_script.py `override_params`); their fragments read P where
-- the file's script has constants
local P = {struct.unpack('@format', ARGV[#ARGV])}

--@@ bucket
-- token_bucket, gcra (@queue = 0): burst @burst, one request every @step µs; state = the time the
-- bucket is full again. leaky_bucket (@queue = 1): a queue of @burst behind the one leaving, one
-- departure every @step µs; state = the time the queue is empty. A request of cost c takes c
-- departure slots and leaves at the first (wait = ahead).
-- (@plus_queue, @minus_queue: "+ 1", "- 1" for a leaky bucket, nothing for the others)
local a@i, f@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local v, cost = values[@i], ARGV[@i]
  cost = cost == '1' and 1 or tonumber(cost)   -- (a cost of 1 without strtod)
  local ok, retry@wait_local = false, -1
@read_state
  local ahead = tat - now
  if cost@minus_queue <= @burst or @force then
    local need = ahead + (cost@minus_queue) * @step - @span
    if need <= 0 or @force then
      @admit
      ahead = ahead + cost * @step
      if ahead < 0 then
        ahead = 0                         -- a refund never fills the bucket past full
      elseif @force and ahead > @span then
        ahead = @span                     -- a charge past the room leaves the bucket empty, no more
      end
      if cost ~= 0 and @charge then a@i = now + ahead end
    else
      retry = need
    end
  end
  -- what is left and when it is full again: after the admission's reservation, if admitted
  local room = @span - ahead
  local remaining, reset = (room - room % @step) / @step@plus_queue, ahead

--@@ bucket_read
  -- the time the bucket is full again (the queue empty), no earlier than now
  local tat = v and tonumber(v) or 0
  if not (tat >= 1000 and tat < 4e18) then
    if v and tat >= 0 and tat < 1000 and (redis.REDIS_VERSION_NUM or 0) >= 0x070000 then
      -- the earlier format (above): the milliseconds are the key's expiry
      local at = call('PEXPIRETIME', KEYS[@i])
      tat = at > 0 and at * 1000 - tat or 0
    else
      tat = 0                          -- none, or not ours (nan, inf, negative): as absent
    end
  end
  if tat < now then
    tat = now
  elseif tat > now + @most_ahead then
    tat = now + @most_ahead            -- from the future: used up now, free again within @most_ahead µs
    f@i = tat
  end

--@@ bucket_write
  if @value then
    -- a bucket's time in µs: the key expires at it (rounded up to the millisecond)
    local at = (@value + (-@value) % 1000) / 1000
    call('SET', KEYS[@i], fmt('%d', @value), 'PXAT', fmt('%d', at))
  end

--@@ set_until
  if @value then call('SET', KEYS[@i], @value, 'PXAT', fmt('%d', @until)) end

--@@ calendar
-- a calendar period (gateway/calendars.py; @kind: 1 a day, 2 a week from Monday, 3 a month from
-- the 1st) in one time zone: cal_next@c(now) is the next local midnight that starts one, in µs.
-- cal_off@c(s): the zone's UTC offset at s (seconds), a tree of comparisons written from the zone's
-- offset changes (building a table of them cost a call 7 µs, the tree's 8 comparisons almost
-- nothing). Integer division by arithmetic, as everywhere here.
local function cal_off@c(s)
@offsets
end
local function cal_next@c(us)
  local s = (us - us % 1000000) / 1000000
  local o = cal_off@c(s)
  local l = s + o
  local days = (l - l % 86400) / 86400   -- the local date, as days since 1970-01-01 (a Thursday)
  local nd
  if @kind == 1 then
    nd = days + 1
  elseif @kind == 2 then
    nd = days - (days + 3) % 7 + 7
  else
    -- the date's year and month (H. Hinnant's civil_from_days), then days_from_civil of the 1st of the next
    local z = days + 719468
    local era = (z - z % 146097) / 146097
    local doe = z - era * 146097
    local yoe = doe - (doe - doe % 1460) / 1460 + (doe - doe % 36524) / 36524 - (doe - doe % 146096) / 146096
    yoe = (yoe - yoe % 365) / 365
    local doy = doe - (365 * yoe + (yoe - yoe % 4) / 4 - (yoe - yoe % 100) / 100)
    local mp = (5 * doy + 2 - (5 * doy + 2) % 153) / 153
    local y, m = yoe + era * 400, mp < 10 and mp + 3 or mp - 9
    if m <= 2 then y = y + 1 end
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    if m <= 2 then y = y - 1 end
    era = (y - y % 400) / 400
    yoe = y - era * 400
    mp = m > 2 and m - 3 or m + 9
    doy = (153 * mp + 2 - (153 * mp + 2) % 5) / 5
    nd = era * 146097 + yoe * 365 + (yoe - yoe % 4) / 4 - (yoe - yoe % 100) / 100 + doy - 719468
  end
  local at = nd * 86400                 -- that midnight's local time; its UTC instant:
  local u = at - cal_off@c(at - o)
  u = at - cal_off@c(u)
  return u * 1000000
end

--@@ window_count
-- fixed_window, or quota with a period: at most @limit in each window of @window µs (or each
-- calendar period: @stop is then its cal_next)
local a@i, b@i, f@i, g@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local v, cost = values[@i], ARGV[@i]
  cost = cost == '1' and 1 or tonumber(cost)   -- (a cost of 1 without strtod)
  local ok, retry = false, -1
  local count = v and tonumber(v) or 0
  if not (count >= 0 and count < 9e15) then count = 0 end   -- not ours (nan, negative): as absent
  if count % 1 ~= 0 then count = math.ceil(count) end
  local stop = @stop
  local reset = stop - now
  local last_ms = (stop + (-stop) % 1000) / 1000 - 1  -- the window's last millisecond: gone at `stop`
  local remaining = @limit - count
  if cost <= @limit or @force then
    if count + cost <= @limit or @force then
      ok = true
      remaining = @limit - count - cost
      if cost ~= 0 and @charge then a@i, b@i = fmt('%d', count + cost > 0 and count + cost or 0), last_ms end
    else
      retry = reset
      if count > 0 and not @peek then
        -- refused: make sure the count ends with this window (after a clock step backwards
        -- it would end with a later one). SET, not PEXPIREAT: in the window's last millisecond
        -- PEXPIREAT would delete the key at once, SET ... PXAT keeps it to the end of it
        local ttl = call('PTTL', KEYS[@i])
        if ttl < 0 or (now - now % 1000) / 1000 + ttl > last_ms + 1 then f@i, g@i = v, last_ms end
      end
    end
  end

--@@ quota
-- quota without a period: @limit in all, until an operator resets it
local a@i, b@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local v, cost = values[@i], ARGV[@i]
  cost = cost == '1' and 1 or tonumber(cost)   -- (a cost of 1 without strtod)
  local ok, retry = false, -1
  local count = v and tonumber(v)
  local add = count ~= nil               -- INCRBY the count, or SET it where the value is not ours
  if not count then
    count = 0
  elseif not (count >= 0 and count < 9e15) then
    count, add = 0, false                -- nan, negative: as absent
  elseif count % 1 ~= 0 then
    count, add = math.ceil(count), false
  end
  local remaining = @limit - count
  if (cost <= @limit and count + cost <= @limit) or @force then
    ok = true
    remaining = @limit - count - cost
    if cost ~= 0 and @charge then
      if count + cost < 0 then cost, add = -count, false end   -- a refund never goes below nothing
      a@i, b@i = count + cost, add
    end
  end

--@@ quota_write
  if a@i then
    -- b@i: the count read is ours and moves by the cost as sent (ARGV[@i], no formatting); INCRBY
    -- refuses a count or cost it cannot parse as an integer ("1e3", "007"): then the count is SET
    if not b@i or type(redis.pcall('INCRBY', KEYS[@i], ARGV[@i])) == 'table' then
      call('SET', KEYS[@i], fmt('%d', a@i))
    end
  end

--@@ sliding_window
-- sliding_window (approximating counter): @limit per @window µs, the last window's count weighted
-- by how much of it still overlaps
local a@i, b@i, f@i, g@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local v, cost = values[@i], ARGV[@i]
  cost = cost == '1' and 1 or tonumber(cost)   -- (a cost of 1 without strtod)
  local ok, retry = false, -1
  local elapsed = now % @window
  local wid = (now - elapsed) / @window
  -- rel: 0 this window, 1 the last one, 2 or more the future (an older state has expired);
  -- mine: the state is in a layout this script writes, with its window (its key's expiry is the
  -- one this script sets): 1 the 19-digit value of the file's script, true the string of either
  local rel, sc, sp, exact, mine = nil, 0, 0, true, false
  if v then
    local num, lo
    if #v == 19 then
      -- 19 digits: d (1..8), the counts' pair in 18 - d digits, the window number mod 10^d in d;
      -- @read_own reads the value's d and, when it is this rule's, its digits (one string.byte)
@read_own
      elseif d >= 1 and d <= 8 then   -- another d: written before a change of the limit
        num, lo = tonumber(string.sub(v, 2, 19 - d)), tonumber(string.sub(v, 20 - d))
        if num and lo and num >= 0 and lo >= 0 and num % 1 == 0 and lo % 1 == 0 then
          local m = 10 ^ d
          rel, exact = (wid - lo) % m, m * @window >= @exact_span
        else
          num = nil
        end
      end
    end
    if not rel then
      num = tonumber(v)
      if num and not (num >= 0 and num < 9e15 and num % 1 == 0) then
        num = nil                      -- not ours (nan, negative, fractional): as absent
      elseif num then                  -- the earlier format: cantor(current, previous) * 4 + wid mod 4
        local w4 = num % 4
        num = (num - w4) / 4
        rel, exact = (wid - w4) % 4, false
      else
        local sw, x, y = string.match(v, '^(%d+):(%d+):(%d+)$')
        if sw then
          rel, sc, sp, mine = wid - tonumber(sw), tonumber(x), tonumber(y), true
          if rel < 0 then rel = 2 elseif rel > 1 then rel = nil end
        end
      end
    end
    if num then                        -- cantor(current, previous): the pair, whatever the limit
      local s = (sqrt(8 * num + 1) - 1) / 2
      s = s - s % 1
      if num >= 562949953421312 then   -- 2^49: below it (a limit below 2^24) the root is exact
        while s * (s + 1) / 2 > num do s = s - 1 end
        while (s + 1) * (s + 2) / 2 <= num do s = s + 1 end
      end
      sp = num - s * (s + 1) / 2
      sc = s - sp
    end
  end
  -- Not exact: the window number is kept modulo a number of windows (10^d) shorter than a day,
  -- and a state written a multiple of that ahead (less one: rel 1) looks current (or last): its
  -- expiry, beyond the next window's end, tells. Asked where it changes the
  -- answer: a last window's count, a previous count weighted now, or (below) a refusal that could
  -- wedge the key.
  -- counts matter until the next window ends: @last_ms is its last millisecond, used where a write
  -- sets the key's expiry or a TTL is read
  local cur, prev, future, checked = 0, 0, false, exact
  if rel == 0 then
    cur, prev = sc, sp
    if not exact and sp > 0 then
      local ttl = call('PTTL', KEYS[@i])
      future, checked = ttl < 0 or (now - now % 1000) / 1000 + ttl > @last_ms + 1, true
    end
  elseif rel == 1 then
    prev = sc
    if not exact then
      local ttl = call('PTTL', KEYS[@i])
      future, checked = ttl < 0 or (now - now % 1000) / 1000 + ttl > @last_ms + 1, true
    end
  elseif rel then
    future = true                      -- rel 2 or more
  end
  -- admitted iff prev * (window - elapsed) / window + cur + cost <= limit, kept in integers
  local room = (@limit - cur - cost) * @window - prev * (@window - elapsed)
  if room < 0 and rel == 0 and not (checked or future or @peek) and cost <= @limit then
    local ttl = call('PTTL', KEYS[@i])   -- a refusal that could wedge the key: is it from the future?
    future, checked = ttl < 0 or (now - now % 1000) / 1000 + ttl > @last_ms + 1, true
  end
  if future then
    cur, prev = sc + sp, 0             -- from the future: all of it counts as used up now
    if cur > @limit then cur = @limit end
    room = (@limit - cur - cost) * @window
  end
  local avail = room + cost * @window
  local remaining = (avail - avail % @window) / @window
  local reset = @window - elapsed
  if cost <= @limit or @force then
    if room >= 0 or @force then
      ok = true
      remaining = remaining - cost
      if cost ~= 0 and @charge then
        local c = cur + cost
        if c < 0 then c = 0 elseif c > @limit then c = @limit end   -- a charge past the room: spent
        if rel ~= 0 or future or not checked or not mine then
          a@i, b@i = @pack_state, @last_ms   -- SET, the key's expiry set with it
        elseif mine == 1 then
          -- this window's 19-digit value of this script: only its pair moves (prev is sp), by
          -- INCRBY, which updates the integer in place and keeps the key's expiry, already the
          -- next window's end (@incr: the change times 10^d, by its digits)
          local s0, s1 = sc + sp, c + prev
          local delta = (s1 * (s1 + 1) - s0 * (s0 + 1)) / 2
          if delta ~= 0 then a@i, b@i = @incr, true end
        else
          a@i, b@i = @pack_state, false      -- this window's string: SET, the expiry kept (KEEPTTL)
        end
      end
    else
      local r
      if prev > 0 and cur + cost <= @limit then
        -- later in this window: prev * (window - elapsed - r) <= (limit - cur - cost) * window
        local x = (@limit - cur - cost) * @window
        local q = math.floor(x / prev)
        if q * prev > x then q = q - 1 end
        r = @window - elapsed - q
      end
      if r == nil or r >= @window - elapsed then
        -- in the next window, at y into it: cur * (window - y) <= (limit - cost) * window
        local y = 0
        if cur > 0 then
          local x = (@limit - cost) * @window
          local q = math.floor(x / cur)
          if q * cur > x then q = q - 1 end
          y = @window - q
          if y < 0 then y = 0 end
        end
        r = @window - elapsed + y
      end
      retry = r + @float_slack
    end
  end
  if future then
    -- rewritten as this window's, so that it is over within one window (the admission's own
    -- write does the same)
    local c = cur
    prev = 0
    f@i, g@i = @pack_state, @last_ms
  end

--@@ sliding_window_write
  if a@i then
    if b@i == true then
      -- INCRBY refuses a value that only looked like the layout (not ours): it is dropped
      if type(redis.pcall('INCRBY', KEYS[@i], a@i)) == 'table' then call('DEL', KEYS[@i]) end
    elseif b@i then
      call('SET', KEYS[@i], a@i, 'PXAT', fmt('%d', b@i))
    else
      call('SET', KEYS[@i], a@i, 'KEEPTTL')
    end
  end

--@@ sliding_log
-- sliding_log: at most @limit in any window (now - @window, now], one sorted-set member per unit
local a@i, b@i, f@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local key, v, cost = KEYS[@i], values[@i], ARGV[@i]
  cost = cost == '1' and 1 or tonumber(cost)   -- (a cost of 1 without strtod)
  local ok, retry = false, -1
  local count, edge, exists = 0, '(' .. fmt('%d', now - @window), false
  if not v then
    local last = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
    if last[2] then
      exists = true
      if tonumber(last[2]) > now then f@i = true end   -- from the future: count as made now
      count = call('ZCOUNT', key, edge, '+inf')
    end
  end
  local reset = @window
  if count > 0 then
    local oldest = tonumber(call('ZRANGEBYSCORE', key, edge, '+inf', 'WITHSCORES', 'LIMIT', '0', '1')[2])
    if oldest > now then oldest = now end
    reset = oldest + @window - now
  end
  local remaining = @limit - count
  if cost <= @limit or @force then
    if count + cost <= @limit or @force then
      ok = true
      remaining = @limit - count - cost
      -- a string under this key is another algorithm's state: replaced by a fresh log
      if cost > 0 and @charge then a@i, b@i = count, v and 'DEL' or (exists and 'TRIM' or '') end
    else
      local kth = tonumber(call('ZRANGEBYSCORE', key, edge, '+inf', 'WITHSCORES', 'LIMIT',
                                fmt('%d', count + cost - @limit - 1), '1')[2])
      if kth > now then kth = now end
      retry = kth + @window - now
    end
  end

--@@ sliding_log_repair
  if f@i then
    -- entries from the future (the clock stepped back) are made now
    local key, now_s = KEYS[@i], fmt('%d', now)
    local future = call('ZRANGEBYSCORE', key, '(' .. now_s, '+inf')
    local args, m = {}, 0
    for u = 1, #future do
      args[m + 1], args[m + 2] = now_s, future[u]
      m = m + 2
      if m == 1000 or u == #future then
        call('ZADD', key, 'XX', unpack(args, 1, m))
        m = 0
      end
    end
  end

--@@ sliding_log_write
  if a@i then
    -- add `cost` members at now to the log, named now.<count + u> (unique but for clock games)
    local key, cost, now_s = KEYS[@i], tonumber(ARGV[@i]), fmt('%d', now)
    if b@i == 'DEL' then
      call('DEL', key)
    elseif b@i == 'TRIM' then
      call('ZREMRANGEBYSCORE', key, '-inf', fmt('%d', now - @window))
    end
    local args, m, added = {}, 0, 0
    for u = 1, cost do
      args[m + 1], args[m + 2] = now_s, now_s .. '.' .. (a@i + u)
      m = m + 2
      if m == 1000 or u == cost then
        added = added + call('ZADD', key, 'NX', unpack(args, 1, m))
        m = 0
      end
    end
    for u = 1, cost - added do
      local k = 0
      while call('ZADD', key, 'NX', now_s, now_s .. '~' .. (a@i + u) .. '.' .. k) == 0 do k = k + 1 end
    end
    call('PEXPIREAT', key, fmt('%d', math.ceil((now + @window) / 1000)))
  end

--@@ concurrency
-- concurrency: at most @limit leases at once, one sorted-set member per slot, named by the request's
-- lease token (ARGV[@n + 1]) and scored by the time it expires (µs): a gateway that dies holding one
-- loses it @lease µs after its last renewal. Given back and renewed by lua/leases.lua.
local a@i
if ARGV[@i] ~= '' then   -- '': the request has no identity for this rule, which sits out
  local key, cost = KEYS[@i], tonumber(ARGV[@i])
  local ok, retry, reset = false, -1, 1000000
  local count = 0
  if not values[@i] then   -- MGET reads a sorted set as missing; a string is another algorithm's
    count = call('ZCOUNT', key, '(' .. fmt('%d', now), '+inf')
  end
  local remaining = @limit - count
  if cost <= @limit or @force then
    if count + cost <= @limit or @force then
      ok = true
      remaining = @limit - count - cost
      if cost > 0 and @charge then a@i = cost end
    else
      retry = 1000000   -- no honest time exists: a holder may give its slot back at any moment
    end
  end

--@@ concurrency_write
  if a@i then
    local key, now_s = KEYS[@i], fmt('%d', now)
    if values[@i] then call('DEL', key) end
    call('ZREMRANGEBYSCORE', key, '-inf', now_s)   -- leases of dead holders
    local until_s, token = fmt('%d', now + @lease), ARGV[@n + 1]
    for u = 1, a@i do call('ZADD', key, until_s, token .. ':' .. u) end
    local last = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')   -- the key lives as long as its last lease
    call('PEXPIREAT', key, fmt('%d', math.ceil(tonumber(last[2]) / 1000)))
  end

--@@ verdict
  -- this rule's part of the reply, and the request's refusal if it refuses; rs: reset_ms + 1
  -- (@rs: 0 for a rule that never resets)
  local outcome = 0
  if not ok then
    outcome = retry < 0 and 2 or 1
    if not refused or (worst >= 0 and (retry < 0 or retry > worst)) then by, worst = @i, retry end
    refused = true
@delay
  end
  if not (remaining >= 0) then remaining = 0 elseif remaining > @most then remaining = @most end
  local rs = @rs
  @reply
end

--@@ verdict_shadow
  -- a shadow rule's part of the reply: it never refuses nor delays
  local outcome = ok and 0 or 3
  if not (remaining >= 0) then remaining = 0 elseif remaining > @most then remaining = @most end
  local rs = @rs
  @reply
end

--@@ locals_sliding_window
local sqrt, byte = math.sqrt, string.byte

--@@ tail
-- (admitted: delay_ms * 2 + 1; in a script without a rule that delays, out[1] starts as 1)
if refused then
  out[1] = ((worst < 0 and 0 or (worst + (-worst) % 1000) / 1000 + 1) * 256 + by) * 2
@admitted
end
return out
