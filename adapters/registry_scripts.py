"""Lua scripts of the Redis adapter registry (adapters.registry).

Each runs atomically in Redis; the commit script makes ``put`` all-or-nothing
(see the failure points in adapters.registry's docstring). They derive some key
names at run time from the prefixes passed in ARGV, which assumes a single
Redis instance (not Redis Cluster).
"""

# KEYS: idx, new version record, retired zset.
# ARGV: now, name, version, replace(0/1), max_adapters(-1 = none),
#       version prefix, chunk prefix, stage prefix, channel,
#       record fields (JSON object of strings), chunk counts (JSON object).
_COMMIT_LUA = """
local idx, ver_key, retired = KEYS[1], KEYS[2], KEYS[3]
local now, name, version = ARGV[1], ARGV[2], ARGV[3]
local replace, max_adapters = ARGV[4] == '1', tonumber(ARGV[5])
local ver_prefix, chunk_prefix, stage_prefix, channel = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local rec, counts = cjson.decode(ARGV[10]), cjson.decode(ARGV[11])
local old = redis.call('HGET', idx, name)
if old and not replace then return {'exists', old} end
if (not old) and max_adapters >= 0 and redis.call('HLEN', idx) >= max_adapters then
  return {'quota', tostring(redis.call('HLEN', idx))}
end
local missing = {'missing'}
for d, _ in pairs(counts) do
  if redis.call('EXISTS', chunk_prefix .. d) == 0 and redis.call('EXISTS', stage_prefix .. d) == 0 then
    table.insert(missing, d)
  end
end
if #missing > 1 then return missing end
-- every check passed: from here on nothing can fail
for d, n in pairs(counts) do
  local ck, sk = chunk_prefix .. d, stage_prefix .. d
  if redis.call('EXISTS', ck) == 1 then
    redis.call('HINCRBY', ck, 'refs', n)
    redis.call('DEL', sk)
  else
    redis.call('RENAME', sk, ck)
    redis.call('PERSIST', ck)
    redis.call('HSET', ck, 'refs', n)
  end
end
for k, v in pairs(rec) do redis.call('HSET', ver_key, k, v) end
redis.call('HSET', idx, name, version)
if old then
  redis.call('HSET', ver_prefix .. old, 'retired_at', now)
  redis.call('ZADD', retired, now, old)
  redis.call('PUBLISH', channel, cjson.encode({event='replaced', tenant=rec['tenant'],
    name=name, version=old, new_version=version}))
  return {'ok', old}
end
return {'ok', ''}
"""

# KEYS: idx, retired zset. ARGV: now, name, version prefix, channel, tenant.
_DELETE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[2])
if not v then return false end
local vk = ARGV[3] .. v
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('HSET', vk, 'retired_at', ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[1], v)
redis.call('PUBLISH', ARGV[4], cjson.encode({event='deleted', tenant=ARGV[5], name=ARGV[2], version=v}))
return redis.call('HGETALL', vk)
"""

# KEYS: retired zset. ARGV: cutoff time, batch limit, version prefix, chunk prefix.
_COLLECT_LUA = """
local vs = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, v in ipairs(vs) do
  local vk = ARGV[3] .. v
  for _, l in ipairs(redis.call('HMGET', vk, 'config_chunks', 'weights_chunks')) do
    if l then
      for _, d in ipairs(cjson.decode(l)) do
        local ck = ARGV[4] .. d
        if redis.call('HINCRBY', ck, 'refs', -1) <= 0 then redis.call('DEL', ck) end
      end
    end
  end
  redis.call('DEL', vk)
  redis.call('ZREM', KEYS[1], v)
end
return #vs
"""
