"""Lua scripts of the Redis adapter registry (adapters.registry).

Each runs atomically in Redis. They derive some key names at run time from
the prefixes passed in ARGV, which assumes a single Redis instance (not
Redis Cluster).

How each failure point of ``put`` is covered:
  1. Before staging (validation, 409, quota): nothing was written.
  2. While staging chunks: staging keys are written with their TTL in one
     MULTI/EXEC, so each is either absent or expiring. On an exception the
     upload deletes them; if the process dies they expire by themselves.
     Staging never touches permanent chunks or reference counts.
  3. The commit is one Lua script: it checks the name (409), the quota and
     that every chunk is present *before* its first write, then moves staged
     chunks to permanent keys, bumps reference counts, writes the record and
     the index entry. Redis runs it atomically, so no other client sees a
     half-commit and two commits never interleave (two racing uploads of one
     name: the second gets 409; racing uploads at the quota: one passes).
  4. Between staging and commit a permanent chunk we skipped staging may be
     collected; the commit then writes nothing and reports it missing, and
     the upload stages it and commits again.
  5. After the commit (the reply is lost): the adapter exists and is
     complete; leftover staging keys expire.
  6. The tenant is deleted (its adapters purged by ``delete_all``) during
     the upload: the commit finds the tenant's tombstone and writes nothing.
"""

# A tenant's names toward max_adapters: its index's, and its references' that are not in the index.
_HELD_NAMES_LUA = """
local function held_names(idx, refs)
  local n = redis.call('HLEN', idx)
  for _, ref in ipairs(redis.call('HKEYS', refs)) do
    if redis.call('HEXISTS', idx, ref) == 0 then n = n + 1 end
  end
  return n
end
"""

# KEYS: idx, new version record, retired zset, the tenant's tombstone, its references hash
#       (names registered by reference count toward max_adapters with the index's; a reference's
#       own name is already counted).
# ARGV: now, name, version, replace(0/1), max_adapters(-1 = none),
#       version prefix, chunk prefix, stage prefix, channel,
#       record fields (JSON object of strings), chunk counts (JSON object).
_COMMIT_LUA = _HELD_NAMES_LUA + """
local idx, ver_key, retired = KEYS[1], KEYS[2], KEYS[3]
local now, name, version = ARGV[1], ARGV[2], ARGV[3]
local replace, max_adapters = ARGV[4] == '1', tonumber(ARGV[5])
local ver_prefix, chunk_prefix, stage_prefix, channel = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local rec, counts = cjson.decode(ARGV[10]), cjson.decode(ARGV[11])
if redis.call('EXISTS', KEYS[4]) == 1 then return {'gone'} end
local old = redis.call('HGET', idx, name)
if old and not replace then return {'exists', old} end
if (not old) and max_adapters >= 0 and redis.call('HEXISTS', KEYS[5], name) == 0 then
  local held = held_names(idx, KEYS[5])
  if held >= max_adapters then return {'quota', tostring(held)} end
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

# KEYS: idx, retired zset, tombstone. ARGV: now, version prefix, channel,
# tenant (as the events name it), tombstone ttl in seconds (0 = none).
# Retires every version in the index exactly as _DELETE_LUA retires one, then
# drops the index; returns the retired records. Run again, it finds an empty
# index and retires nothing.
_RETIRE_ALL_LUA = """
local entries = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #entries, 2 do
  local name, v = entries[i], entries[i + 1]
  local vk = ARGV[2] .. v
  if redis.call('EXISTS', vk) == 1 then
    redis.call('HSET', vk, 'retired_at', ARGV[1])
    redis.call('ZADD', KEYS[2], ARGV[1], v)
    redis.call('PUBLISH', ARGV[3], cjson.encode({event='deleted', tenant=ARGV[4], name=name, version=v}))
    out[#out + 1] = redis.call('HGETALL', vk)
  end
end
redis.call('DEL', KEYS[1])
if tonumber(ARGV[5]) > 0 then redis.call('SET', KEYS[3], '1', 'EX', ARGV[5]) end
return out
"""

# KEYS: legacy (name-keyed) idx, id-keyed idx, retired zset.
# ARGV: now, version prefix, channel, tenant id.
# Renames the legacy index when the id-keyed one does not exist yet; else
# merges into it, where a name the id-keyed index already has keeps that
# version and the legacy one is retired (so its storage is still freed).
# Every version that ends up in the id-keyed index gets the id as its tenant.
# Returns how many entries were moved.
_MIGRATE_INDEX_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local entries = redis.call('HGETALL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('RENAME', KEYS[1], KEYS[2]) end
local moved = 0
for i = 1, #entries, 2 do
  local name, v = entries[i], entries[i + 1]
  local vk = ARGV[2] .. v
  redis.call('HSETNX', KEYS[2], name, v)
  if redis.call('HGET', KEYS[2], name) == v then
    if redis.call('EXISTS', vk) == 1 then redis.call('HSET', vk, 'tenant', ARGV[4]) end
    moved = moved + 1
  elseif redis.call('EXISTS', vk) == 1 then
    redis.call('HSET', vk, 'retired_at', ARGV[1])
    redis.call('ZADD', KEYS[3], ARGV[1], v)
    redis.call('PUBLISH', ARGV[3], cjson.encode({event='deleted', tenant=ARGV[4], name=name, version=v}))
  end
end
redis.call('DEL', KEYS[1])
return moved
"""

# KEYS: retired zset. ARGV: cutoff time, batch limit, version prefix, chunk prefix, DoRA scales prefix
# (a version's derived DoRA scales, adapters.dora_scale_store, go with it).
_COLLECT_LUA = """
local vs = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, v in ipairs(vs) do
  local vk = ARGV[3] .. v
  for _, l in ipairs(redis.call('HMGET', vk, 'config_chunks', 'weights_chunks', 'medusa_config_chunks',
                                'medusa_weights_chunks', 'draft_config_chunks', 'draft_weights_chunks')) do
    if l then
      for _, d in ipairs(cjson.decode(l)) do
        local ck = ARGV[4] .. d
        if redis.call('HINCRBY', ck, 'refs', -1) <= 0 then redis.call('DEL', ck) end
      end
    end
  end
  redis.call('DEL', vk, ARGV[5] .. v)
  redis.call('ZREM', KEYS[1], v)
end
return #vs
"""

# KEYS: a version record. ARGV: the base model identity.
# Records a base on a version stored before bases were recorded: never on another's, never a new hash.
_CLAIM_BASE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local base = redis.call('HGET', KEYS[1], 'base')
if base and base ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'base', ARGV[1])
return 1
"""


# KEYS: the tenant's references hash, its registry index.
# ARGV: name, reference JSON, max_adapters.
# A new name is written only while the tenant's names (stored and referenced, counted once each) are
# under max_adapters: checked and written in one step, so a burst of registrations cannot all pass.
_PUT_REFERENCE_LUA = _HELD_NAMES_LUA + """
local refs, idx = KEYS[1], KEYS[2]
local name, max_adapters = ARGV[1], tonumber(ARGV[3])
if redis.call('HEXISTS', refs, name) == 0 and redis.call('HEXISTS', idx, name) == 0 then
  local held = held_names(idx, refs)
  if held >= max_adapters then return 0 end
end
redis.call('HSET', refs, name, ARGV[2])
return 1
"""
