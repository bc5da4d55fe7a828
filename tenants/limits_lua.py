"""Lua for the Limiter. Each script runs atomically in Redis, so every server
process sharing one Redis enforces one limit.

Per tenant (KEYS in this order): the window log (ZSET slot -> admit time), the
token charge of each logged slot (HASH slot -> tokens), the running sum of
those charges (STRING), and the concurrency leases (ZSET slot -> lease expiry).
A charge is inside the window when its admit time > now - window.

Numbers passed to redis.call are formatted with %.17g; numbers returned are
truncated to integers, so fractional results go back as strings.
"""

# `now` from the caller, or from Redis's own clock when ARGV[1] is empty, so
# processes without synchronised clocks still agree.
_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local window = tonumber(ARGV[2])
"""

# Drop charges that left the window and subtract them from the running sum,
# then drop leases that expired: a lease is extended by its replica's heartbeat (RENEW), so one
# past its expiry belongs to a replica that stopped beating (crashed), and its slot comes back here.
_PURGE = """
local cutoff = now - window
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
if #old > 0 then
  local freed = 0
  for i = 1, #old, 500 do
    local chunk = {}
    for j = i, math.min(i + 499, #old) do chunk[#chunk + 1] = old[j] end
    local vals = redis.call('HMGET', KEYS[2], unpack(chunk))
    for k = 1, #chunk do
      if vals[k] then freed = freed + tonumber(vals[k]) end
    end
    redis.call('HDEL', KEYS[2], unpack(chunk))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  local left = redis.call('DECRBY', KEYS[3], freed)
  if left <= 0 then redis.call('DEL', KEYS[3]) end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local nreq = redis.call('ZCARD', KEYS[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local nconc = redis.call('ZCARD', KEYS[4])
"""

# ARGV: now, window, lease, slot, estimated tokens, rpm, tpm, max concurrent
# (-1 = unlimited), key ttl. Returns {1, admitted_at, lease_expiry} or
# {0, limit_name, retry_after}: every limit is checked and the charge is
# recorded only if all pass. When several fail, the longest wait is reported.
ADMIT = _NOW + """
local lease = tonumber(ARGV[3])
local slot = ARGV[4]
local est = tonumber(ARGV[5])
local rpm = tonumber(ARGV[6])
local tpm = tonumber(ARGV[7])
local maxc = tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])
""" + _PURGE + """
local limit, retry = '', 0
local function refuse(name, wait)
  if limit == '' or wait > retry then limit, retry = name, wait end
end

if rpm >= 0 and nreq >= rpm then
  local wait = window
  if rpm > 0 then
    -- the count drops below rpm when the (nreq - rpm + 1)-th oldest leaves
    local e = redis.call('ZRANGE', KEYS[1], nreq - rpm, nreq - rpm, 'WITHSCORES')
    wait = tonumber(e[2]) + window - now
  end
  refuse('requests_per_minute', wait)
end

if tpm >= 0 and used + est > tpm then
  -- walk the oldest charges until enough tokens would have left the window
  local need, freed, start, wait = used + est - tpm, 0, 0, window
  while true do
    local batch = redis.call('ZRANGE', KEYS[1], start, start + 99, 'WITHSCORES')
    if #batch == 0 then break end
    local ids = {}
    for i = 1, #batch, 2 do ids[#ids + 1] = batch[i] end
    local vals = redis.call('HMGET', KEYS[2], unpack(ids))
    local done = false
    for k = 1, #ids do
      if vals[k] then freed = freed + tonumber(vals[k]) end
      if freed >= need then
        wait = tonumber(batch[2 * k]) + window - now
        done = true
        break
      end
    end
    if done then break end
    start = start + 100
  end
  refuse('tokens_per_minute', wait)
end

-- a slot frees when a request finishes, which cannot be predicted
if maxc >= 0 and nconc >= maxc then refuse('max_concurrent_requests', 1) end

if limit ~= '' then return {0, limit, string.format('%.6f', retry)} end

redis.call('ZADD', KEYS[1], now, slot)
redis.call('HSET', KEYS[2], slot, est)
redis.call('INCRBY', KEYS[3], est)
redis.call('ZADD', KEYS[4], now + lease, slot)
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
return {1, string.format('%.6f', now), string.format('%.6f', now + lease)}
"""

# ARGV: slot, actual tokens. Frees the lease and corrects the charge from the
# estimate to the actual count while the charge is still in the window.
# Idempotent. Returns 1 if the lease was still held.
RELEASE = """
local held = redis.call('ZREM', KEYS[4], ARGV[1])
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur then
  local delta = tonumber(ARGV[2]) - tonumber(cur)
  if delta ~= 0 then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
    redis.call('INCRBY', KEYS[3], delta)
  end
end
return held
"""

# The heartbeat of one replica's leases. KEYS: a leases ZSET per lease (repeats allowed).
# ARGV: now, (unused window), lease seconds, key ttl, then one slot per key. A lease still in
# its set (even one past its expiry that no admit has purged yet: nobody else got that slot) is
# extended to now + lease; one that is gone stays gone (XX): a heartbeat racing the request's own
# release must never bring a freed slot back. Returns the 1-based positions of the gone ones.
RENEW = _NOW + """
local lease = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local lost = {}
for i = 1, #KEYS do
  local slot = ARGV[4 + i]
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', now + lease, slot) == 0
      and not redis.call('ZSCORE', KEYS[i], slot) then
    lost[#lost + 1] = i
  else
    redis.call('EXPIRE', KEYS[i], ttl)
  end
end
return lost
"""

# ARGV: now, window. Returns {requests in window, tokens in window, leases held}.
SNAPSHOT = _NOW + _PURGE + """
return {nreq, used, nconc}
"""

# ARGV: slot. Removes a request that was refused after its admission (a 4xx found once its
# body was read) as if it had never been admitted: out of the window log, its charge out of
# the running sum, its lease freed. Idempotent.
CANCEL = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur then
  redis.call('HDEL', KEYS[2], ARGV[1])
  if redis.call('DECRBY', KEYS[3], tonumber(cur)) <= 0 then redis.call('DEL', KEYS[3]) end
end
return 1
"""
