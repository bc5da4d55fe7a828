"""Lua for the TenantStore. Each script runs atomically in Redis.

Scripts that act on what a tenant owns get those key names from the caller,
computed from the id the caller read, and first check that the tenant hash
still carries that id (`gen`): if the tenant was deleted, or deleted and
recreated under the same name, in between, they write nothing and return 0.
A few key names are read from Redis at run time (API key records, usage
hashes), which assumes a single Redis instance (not Redis Cluster).
"""

# KEYS: tenant hash, names set. ARGV: name, quota json, created_at, id.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'quota', ARGV[2], 'created_at', ARGV[3], 'gen', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: tenant hash, names set, pending-purge set, key-id set, usage index,
# then the limiter's keys. ARGV: name, id, api key record prefix.
# The id joins the pending-purge set in the same step that deletes the
# tenant, so its adapters (another package's keys) are purged even if the
# process dies right after.
DELETE = """
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[2] then return 0 end
for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do redis.call('DEL', ARGV[3] .. id) end
for _, k in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do redis.call('DEL', k) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

# KEYS: tenant hash, key-id set, key record. ARGV: name, id, key id, salt, digest, created_at.
CREATE_KEY = """
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[3], 'tenant', ARGV[1], 'gen', ARGV[2], 'salt', ARGV[4],
           'digest', ARGV[5], 'created_at', ARGV[6])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""

# KEYS: key-id set, key record. ARGV: key id.
REVOKE_KEY = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: key record. ARGV: now. Only an existing record is touched: a key revoked meanwhile
# must not come back as a record holding nothing but a timestamp.
TOUCH_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'last_used', ARGV[1])
return 1
"""
