-- Drop every override of rules no longer in the file (gateway/overrides.py).
--   KEYS[1]     the route's versions hash; KEYS[2...] the dropped rules' overrides hashes and
--               changes lists
--   ARGV[1...]  the dropped rules' names; ARGV is empty when the whole route
--               is gone: then its versions go too
-- A dropped rule's version is bumped rather than removed: a version never comes back to a value a
-- worker has seen. Returns the number of overrides dropped.
local dropped = 0
for i = 2, #KEYS do
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    dropped = dropped + redis.call('HLEN', KEYS[i])
  end
  redis.call('DEL', KEYS[i])
end
if #ARGV == 0 then
  redis.call('DEL', KEYS[1])
end
for i = 1, #ARGV do
  redis.call('HINCRBY', KEYS[1], ARGV[i], 1)
end
return dropped
