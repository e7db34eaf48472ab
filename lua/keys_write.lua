-- Register, replace or remove API keys (gateway/api_keys.py), all in one call: all or none.
--   KEYS[1]  the plans: a hash, key digest (16 hex digits) -> plan name, or "PLAN CONSUMER" for a key
--            of a named consumer (a key without one is its own consumer)
--   KEYS[2]  the last changes: a list of digests, one per version, the newest last
--   KEYS[3]  the versions: a hash whose field `keys` is bumped by every change (read by overrides_changes.lua)
--   KEYS[4]  the metadata: a hash, key digest -> a JSON object
--   KEYS[5]  the consumers' keys: a sorted set of "CONSUMER DIGEST", all at score 0 (read by range)
--   ARGV     changes kept, then (digest, plan, consumer, metadata) for each key: plan '' removes the
--            key; consumer '' is the key's own; metadata '' is none; '*' for either keeps what the
--            key has (a new key: its own consumer, no metadata)
-- Returns {version, how many of the digests were there before}.
local plans, changes, version, meta, members = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local KEEP = '*'
local found = 0
for i = 2, #ARGV, 4 do
  local digest, plan, consumer, metadata = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local before = redis.call('HGET', plans, digest)
  local old = before and string.match(before, '^[^ ]+ (.+)$')
  if before then
    found = found + 1
  end
  if old then
    redis.call('ZREM', members, old .. ' ' .. digest)
  end
  if plan == '' then
    redis.call('HDEL', plans, digest)
    redis.call('HDEL', meta, digest)
  else
    if consumer == KEEP then
      consumer = old or ''
    end
    if consumer == '' then
      redis.call('HSET', plans, digest, plan)
    else
      redis.call('HSET', plans, digest, plan .. ' ' .. consumer)
      redis.call('ZADD', members, 0, consumer .. ' ' .. digest)
    end
    if metadata == '' then
      redis.call('HDEL', meta, digest)
    elseif metadata ~= KEEP then
      redis.call('HSET', meta, digest, metadata)
    end
  end
  redis.call('RPUSH', changes, digest)
end
redis.call('LTRIM', changes, -tonumber(ARGV[1]), -1)
return {redis.call('HINCRBY', version, 'keys', (#ARGV - 1) / 4), found}
