-- units: time in microseconds from Redis TIME; intervals and windows in microseconds; counts in request units
--
-- One decision for all of a route's rules, all or nothing.
--   KEYS[i]           state key of rule i (all keys share one hash tag)
--   ARGV[1]           number of rules n
--   ARGV[2]           1 = peek (report state, write nothing), 0 = decide
--   ARGV[3 + 5(i-1)]  algorithm code of rule i (see ALGORITHMS below)
--   ARGV[4 + 5(i-1)]  p1: limit (windows, quota) or burst (buckets)
--   ARGV[5 + 5(i-1)]  p2: window / period (0 = none) or emission interval 1e6/rate
--   ARGV[6 + 5(i-1)]  cost
--   ARGV[7 + 5(i-1)]  1 if the rule is shadow (counts, never refuses)
-- Returns {admitted, refusing rule (0 = none), retry_us (-1 = never fits), delay_us,
--          then per rule: outcome, remaining, reset_us}
-- outcome: 0 admits, 1 refuses, 2 can never fit, 3 shadow rule that would have refused.
-- A clock step backwards is clamped per key: state from the future is treated as "used up now",
-- which admits nothing extra and expires within one window of the step.

local n = tonumber(ARGV[1])
local peek = ARGV[2] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x)
  return string.format('%d', math.ceil(x))
end

local function ttl_ms(us)
  local ms = math.ceil(us / 1000)
  if ms < 1 then ms = 1 end
  return int(ms)
end

-- Each check returns: ok, remaining, reset_us, retry_us (-1 never), write (function or nil), delay_us

local function fixed_window(key, limit, window, cost)
  local start = math.floor(now / window) * window
  local stop = start + window
  local count = tonumber(redis.call('GET', key) or '0')
  local pttl = redis.call('PTTL', key)
  if pttl > window / 1000 + 1 then
    -- written in the future (clock stepped back): keep the count, end it with this window
    redis.call('PEXPIREAT', key, int(stop / 1000))
  end
  if cost > limit then return false, limit - count, stop - now, -1 end
  local ok = count + cost <= limit
  local write = function()
    redis.call('INCRBY', key, cost)
    redis.call('PEXPIREAT', key, int(stop / 1000))
  end
  if ok then return true, limit - count - cost, stop - now, 0, write end
  return false, limit - count, stop - now, stop - now
end

local function sliding_window(key, limit, window, cost)
  local wid = math.floor(now / window)
  local elapsed = now - wid * window
  local cur, prev = 0, 0
  local state = redis.call('GET', key)
  if state then
    local sw, sc, sp = string.match(state, '^(%d+):([%d.]+):([%d.]+)$')
    sw, sc, sp = tonumber(sw), tonumber(sc), tonumber(sp)
    if sw == wid or (sw and sw > wid) then
      cur, prev = sc, sp
    elseif sw == wid - 1 then
      prev = sc
    end
  end
  local estimate = prev * (window - elapsed) / window + cur
  local reset = window - elapsed
  if cost > limit then return false, limit - estimate, reset, -1 end
  if estimate + cost <= limit then
    local write = function()
      redis.call('SET', key, wid .. ':' .. (cur + cost) .. ':' .. prev,
        'PX', ttl_ms(2 * window - elapsed))
    end
    return true, limit - estimate - cost, reset, 0, write
  end
  local retry
  if cur + cost <= limit and prev > 0 then
    retry = (window - elapsed) - (limit - cur - cost) * window / prev
  end
  if retry == nil or retry >= window - elapsed then
    local into_next = 0
    if cur > 0 then into_next = window - (limit - cost) * window / cur end
    if into_next < 0 then into_next = 0 end
    retry = (window - elapsed) + into_next
  end
  return false, limit - estimate, reset, math.ceil(retry) + 1
end

local function sliding_log(key, limit, window, cost)
  local future = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf')
  for _, member in ipairs(future) do
    redis.call('ZADD', key, 'XX', int(now), member)
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - window))
  local count = redis.call('ZCARD', key)
  local reset = window
  if count > 0 then
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    reset = tonumber(oldest[2]) + window - now
  end
  if cost > limit then return false, limit - count, reset, -1 end
  if count + cost <= limit then
    local write = function()
      local base = int(now)
      for i = 1, cost do
        local member = base .. ':' .. i
        local j = 0
        while redis.call('ZADD', key, 'NX', base, member) == 0 do
          j = j + 1
          member = base .. ':' .. i .. ':' .. j
        end
      end
      redis.call('PEXPIRE', key, ttl_ms(window))
    end
    return true, limit - count - cost, reset, 0, write
  end
  local k = count + cost - limit
  local kth = redis.call('ZRANGE', key, k - 1, k - 1, 'WITHSCORES')
  return false, limit - count, reset, tonumber(kth[2]) + window - now + 1
end

local function token_bucket(key, burst, interval, cost)
  local tokens, ts = burst, now
  local state = redis.call('GET', key)
  if state then
    local st, sts = string.match(state, '^([%d.e+-]+):(%d+)$')
    st, sts = tonumber(st), tonumber(sts)
    if st and sts then
      if sts > now then sts = now end
      tokens = math.min(burst, st + (now - sts) / interval)
    end
  end
  if cost > burst then return false, math.floor(tokens), (burst - tokens) * interval, -1 end
  if tokens >= cost then
    local left = tokens - cost
    local write = function()
      redis.call('SET', key, string.format('%.6f', math.floor(left * 1e6) / 1e6) .. ':' .. int(now),
        'PX', ttl_ms((burst - left) * interval))
    end
    return true, math.floor(left), (burst - left) * interval, 0, write
  end
  return false, math.floor(tokens), (burst - tokens) * interval, math.ceil((cost - tokens) * interval)
end

local function gcra(key, burst, interval, cost)
  local span = burst * interval
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  if tat > now + span then tat = now + span end
  if cost > burst then return false, math.floor((span - (tat - now)) / interval), tat - now, -1 end
  local new_tat = tat + cost * interval
  if new_tat - now <= span then
    local write = function()
      redis.call('SET', key, int(new_tat), 'PX', ttl_ms(new_tat - now))
    end
    return true, math.floor((span - (new_tat - now)) / interval), new_tat - now, 0, write
  end
  return false, math.floor((span - (tat - now)) / interval), tat - now,
    math.ceil(new_tat - now - span)
end

local function leaky_bucket(key, burst, interval, cost)
  local span = burst * interval
  local empty_at = tonumber(redis.call('GET', key) or '0')
  if empty_at < now then empty_at = now end
  if empty_at > now + span + interval then empty_at = now + span + interval end
  local function remaining(e)
    local r = math.floor((span - (e - now)) / interval) + 1
    if r < 0 then r = 0 end
    return r
  end
  if cost - 1 > burst then return false, remaining(empty_at), empty_at - now, -1 end
  local wait = empty_at - now
  if wait + (cost - 1) * interval <= span then
    local new_empty = empty_at + cost * interval
    local write = function()
      redis.call('SET', key, int(new_empty), 'PX', ttl_ms(new_empty - now))
    end
    return true, remaining(new_empty), new_empty - now, 0, write, wait
  end
  return false, remaining(empty_at), empty_at - now,
    math.ceil(wait + (cost - 1) * interval - span)
end

local function quota(key, limit, period, cost)
  local count = tonumber(redis.call('GET', key) or '0')
  local stop, reset = 0, -1
  if period > 0 then
    stop = (math.floor(now / period) + 1) * period
    reset = stop - now
    if redis.call('PTTL', key) > period / 1000 + 1 then
      redis.call('PEXPIREAT', key, int(stop / 1000))
    end
  end
  if cost > limit then return false, limit - count, reset, -1 end
  if count + cost <= limit then
    local write = function()
      redis.call('INCRBY', key, cost)
      if period > 0 then redis.call('PEXPIREAT', key, int(stop / 1000)) end
    end
    return true, limit - count - cost, reset, 0, write
  end
  return false, limit - count, reset, reset
end

local ALGORITHMS = {fixed_window, sliding_window, sliding_log, token_bucket, gcra, leaky_bucket, quota}

local writes = {}
local out = {1, 0, 0, 0}
local worst_retry = 0
local delay = 0
for i = 1, n do
  local base = 3 + 5 * (i - 1)
  local check = ALGORITHMS[tonumber(ARGV[base])]
  local p1, p2 = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  local cost = tonumber(ARGV[base + 3])
  local shadow = ARGV[base + 4] == '1'
  local ok, remaining, reset, retry, write, wait = check(KEYS[i], p1, p2, cost)
  local outcome = 0
  if ok then
    writes[#writes + 1] = write
    if wait and wait > delay then delay = wait end
  elseif shadow then
    outcome = 3
  else
    outcome = 1
    if retry < 0 then outcome = 2 end
    if out[1] == 1 or (worst_retry >= 0 and (retry < 0 or retry > worst_retry)) then
      out[2] = i
      worst_retry = retry
    end
    out[1] = 0
  end
  if remaining < 0 then remaining = 0 end
  out[#out + 1] = outcome
  out[#out + 1] = math.floor(remaining)
  out[#out + 1] = math.ceil(reset)
end

if out[1] == 1 then
  if not peek then
    for _, write in ipairs(writes) do write() end
  end
  out[4] = math.ceil(delay)
else
  out[3] = worst_retry
end
return out
