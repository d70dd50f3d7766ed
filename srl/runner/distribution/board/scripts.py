"""The board's Lua scripts, each headed by its KEYS, ARGV and what it returns.

Owns: the text of every script the board's parts register (a part runs those that write its keys; the
heartbeat also adds to ``accounts``' counters, with the same Lua). Must never: touch a key it does not name
in KEYS (a cluster could not run it), or take a time from anywhere but Redis ``TIME`` or its caller.
"""

# Every script names all the keys it touches in KEYS (cluster-safe). Times come
# from TIME inside the script (replicated by effects, Redis >= 5) or the caller.
#
# A task is its name AND the id its client gave it (``task_id``, written once by create_task):
# a node's board is bound to the id of the task it serves (Board.bound), and every write it makes
# first checks that the task of that name is still that one. A task replaced meanwhile (a client
# with overwrite=True) or deleted (or lost with a Redis restarted empty) is never written to by the
# nodes of the old one, and its leases are never taken back by them.

_TASK_IS_LUA = """
local function task_is(key, id)
  local found = redis.call('HGET', key, 'task_id')
  if not found then return 0 end
  if id ~= '' and found ~= id then return -1 end
  return 1
end
"""

# KEYS: lease, task. ARGV: uid, ttl_ms, task id ('': any task, or none).
_RENEW_LUA = _TASK_IS_LUA + """
if ARGV[3] ~= '' and task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_SET_INFERENCE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'uid', ARGV[1], 'address', ARGV[2], 'tls', ARGV[3])
return 1
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: trainer lease, epoch, task. ARGV: uid, ttl_ms, task id. The epoch is consumed only by the winner.
_CLAIM_TRAINER_LUA = _TASK_IS_LUA + """
if task_is(KEYS[3], ARGV[3]) ~= 1 then return false end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[3], 'trainer_uid', ARGV[1], 'trainer_epoch', epoch)
  return epoch
end
return false
"""

# KEYS: trainer lease, epoch, task. ARGV: uid, epoch, ttl_ms, task id.
# A trainer whose lease lapsed (a Redis or network outage longer than the TTL) takes it back,
# keeping its epoch, when no other trainer took the lease in between (the epoch did not move).
# Returns 1 taken back, 0 another trainer took over, -1 the task is gone, -2 it was replaced.
_RECLAIM_TRAINER_LUA = _TASK_IS_LUA + """
local mine = task_is(KEYS[3], ARGV[4])
if mine == 0 then return -1 end
if mine == -1 then return -2 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: task, then the actor slot leases in order. ARGV: uid, ttl_ms, preferred index (0-based, -1: none),
# start, small ('1'/'0'), task id.
# A slot this uid already holds is kept; else the preferred slot if free; else the lowest free one.
_CLAIM_SLOT_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[6]) ~= 1 then return -1 end
local n = #KEYS - 1
local prefer = tonumber(ARGV[3])
if prefer >= 0 and prefer < n then
  local key = KEYS[prefer + 2]
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    return prefer
  end
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then return prefer end
end
if ARGV[5] == '1' then
  for i = 2, #KEYS do
    if redis.call('GET', KEYS[i]) == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
      return i - 2
    end
  end
end
local start = tonumber(ARGV[4])
for j = 0, n - 1 do
  local i = (start + j) % n
  if redis.call('SET', KEYS[i + 2], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return i
  end
end
return -1
"""

# KEYS: trainer lease, epoch, params, task, params feed. ARGV: uid, epoch, version, train_count, blob, task id,
# master ('' : none; a master of an older version never stays beside a newer blob).
# The feed is a stream of one entry, the latest version: a node waiting for the next one blocks on it.
_PUBLISH_PARAMS_LUA = _TASK_IS_LUA + """
if task_is(KEYS[4], ARGV[6]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local epoch = tonumber(ARGV[2])
if epoch ~= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
local stored = tonumber(redis.call('HGET', KEYS[4], 'params_epoch') or '')
if not stored or epoch < stored then return 0 end
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', t[2])
redis.call('HSET', KEYS[3], 'epoch', ARGV[2], 'version', ARGV[3], 'train_count', ARGV[4],
           'blob', ARGV[5], 'published_at', now, 'task', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], 'master', ARGV[7]) else redis.call('HDEL', KEYS[3], 'master') end
redis.call('HSET', KEYS[4], 'params_epoch', ARGV[2], 'params_version', ARGV[3], 'train_count', ARGV[4])
redis.call('XADD', KEYS[5], 'MAXLEN', '1', '*', 'epoch', ARGV[2], 'version', ARGV[3])
return 1
"""

# KEYS: params. ARGV: a version the caller holds ('' : none), max blob bytes (-1: any), '1': the master in
# place of the blob when there is one (a trainer restoring).
# The latest params in one round trip: the head always, the blob only when its version is not the one the
# caller holds and it is within the caller's bound (its size is returned, so a huge forged blob never travels).
_GET_PARAMS_LUA = """
local h = redis.call('HMGET', KEYS[1], 'epoch', 'version', 'train_count', 'task')
if not h[1] or not h[2] or not h[3] then return false end
local field = 'blob'
if ARGV[3] == '1' and redis.call('HEXISTS', KEYS[1], 'master') == 1 then field = 'master' end
local size = redis.call('HSTRLEN', KEYS[1], field)
local blob = false
local limit = tonumber(ARGV[2])
if h[2] ~= ARGV[1] and (limit < 0 or size <= limit) then blob = redis.call('HGET', KEYS[1], field) end
return {h[1], h[2], h[3], h[4] or '', size, blob}
"""

# KEYS: trainer lease, epoch, checkpoint, task. ARGV: uid, epoch, train_count, blob, task id.
# The trainer's latest checkpoint, fenced like its params: a client far from the trainer keeps it.
_PUT_CHECKPOINT_LUA = _TASK_IS_LUA + """
if task_is(KEYS[4], ARGV[5]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) ~= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
redis.call('HSET', KEYS[3], 'train_count', ARGV[3], 'blob', ARGV[4])
return 1
"""

# Adds the JSON object of deltas to the JSON totals of a role in a hash; a stored value that is
# not a JSON object of numbers (damaged, or written by someone else) is started over, and so is a
# total that is not a finite number (cjson reads 1e400 or a 400-digit integer as inf, and then
# cannot encode the totals again: every later write of the role's counters would fail).
_ADD_COUNTERS_LUA = _TASK_IS_LUA + """
local function finite(value)
  return type(value) == 'number' and value == value and value > -math.huge and value < math.huge
end
local function add_counters(key, role, deltas_json)
  local totals = {}
  local current = redis.call('HGET', key, role)
  if current then
    local ok, decoded = pcall(cjson.decode, current)
    if ok and type(decoded) == 'table' then
      for name, value in pairs(decoded) do
        if type(name) == 'string' and finite(value) then totals[name] = value end
      end
    end
  end
  for name, delta in pairs(cjson.decode(deltas_json)) do
    local total = (totals[name] or 0) + delta
    if not finite(total) then total = delta end
    totals[name] = total
  end
  redis.call('HSET', key, role, cjson.encode(totals))
end
"""

# Whether a count that carries ``token`` is still to be added, remembering it as its role's last: a
# count sent again (with_retry, or redis-py's own retry) after its reply was lost carries the token of
# the last count its role added, and adds nothing. '' = no token: always added. One writer at a time
# counts with tokens under a role (an actor slot's holder, the trainer lease's holder).
_FIRST_COUNT_LUA = """
local function first_count(key, role, token)
  if token == '' then return true end
  if redis.call('HGET', key, role) == token then return false end
  redis.call('HSET', key, role, token)
  return true
end
"""

# KEYS: counters, task, counted. ARGV: role_id, deltas_json, task id, token ('' = none).
_INCR_COUNTERS_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
if task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
if first_count(KEYS[3], ARGV[1], ARGV[4]) then add_counters(KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

# The trainer's count of what one read brought, written before the read is acked, with the batches
# of its last reads whose acks may not have reached the broker (its ledger): a trainer that takes over
# takes their redelivered copies without counting them again, so nothing is counted twice or lost from the counts.
# KEYS: trainer lease, counters, task, ledger, counted. ARGV: uid, deltas_json ('' = none), ledger_json,
# task id, token ('' = none).
# Returns 1 written (or written already: a retry), 0 the lease is not this trainer's (do not ack: the
# next holder gets the batches), -1 the task is gone or was replaced.
_COUNT_RECEIVED_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
if task_is(KEYS[3], ARGV[4]) ~= 1 then return -1 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and first_count(KEYS[5], 'trainer', ARGV[5]) then add_counters(KEYS[2], 'trainer', ARGV[2]) end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return 1
"""

# KEYS: stats:<role>, roles, task. ARGV: role_id, stats_json, stats_ttl_ms, task id.
_PUT_STATS_LUA = _TASK_IS_LUA + """
if task_is(KEYS[3], ARGV[4]) ~= 1 then return 0 end
if not redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET') then
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: list, task. ARGV: entry_json, cap, task id.
_PUSH_CAPPED_LUA = _TASK_IS_LUA + """
if task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return 1
"""

# KEYS: refusals, task. ARGV: uid, entry_json (without the time), cap, task id.
# One entry per node that refuses the task (the latest reason), stamped with the server's time.
_NOTE_REFUSAL_LUA = _TASK_IS_LUA + """
if task_is(KEYS[2], ARGV[4]) ~= 1 then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
local t = redis.call('TIME')
local entry = cjson.decode(ARGV[2])
entry['ts'] = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
return 1
"""

# KEYS: lease, stats:<role>, roles, counters, task, counted.
# ARGV: uid, ttl_ms, role_id, stats_json ('' = none), stats_ttl_ms, deltas_json ('' = none), task id,
# a counter to total over every role ('' = none), the deltas' count token ('' = none).
# Returns {held, status, params epoch, params version, train_count, time s, time us, the task's id, that
# total (false: none asked)}; nothing is renewed or written unless the task is the one this node serves.
# The token is kept apart from the role's other counts ('<role> heartbeat'): a role's incr_counters between
# a lost heartbeat and its retry must not make the retry count again.
_HEARTBEAT_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
local t = redis.call('TIME')
local head = redis.call('HMGET', KEYS[5], 'status', 'params_epoch', 'params_version', 'train_count', 'task_id')
if not head[1] then return {0, false, false, false, false, t[1], t[2], false, false} end
if ARGV[7] ~= '' and head[5] ~= ARGV[7] then
  return {0, head[1], false, false, false, t[1], t[2], head[5], false}
end
local held = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  held = 1
end
if ARGV[4] ~= '' then
  if not redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5], 'GET') then
    redis.call('SADD', KEYS[3], ARGV[3])
  end
end
if ARGV[6] ~= '' and first_count(KEYS[6], ARGV[3] .. ' heartbeat', ARGV[9]) then
  add_counters(KEYS[4], ARGV[3], ARGV[6])
end
local total = false
if ARGV[8] ~= '' then
  total = 0
  for _, value in ipairs(redis.call('HVALS', KEYS[4])) do
    local ok, decoded = pcall(cjson.decode, value)
    if ok and type(decoded) == 'table' and finite(decoded[ARGV[8]]) and finite(total + decoded[ARGV[8]]) then
      total = total + decoded[ARGV[8]]
    end
  end
  total = tostring(total)
end
return {held, head[1], head[2], head[3], head[4], t[1], t[2], head[5], total}
"""

# KEYS: task. ARGV: overwrite ('1'/'0'), then field, value, ...
_CREATE_TASK_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and ARGV[1] ~= '1' and (status == 'INIT' or status == 'ACTIVE') then return status end
local t = redis.call('TIME')
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('HSET', KEYS[1], 'created_at', t[1] .. '.' .. string.format('%06d', t[2]))
return 'OK'
"""

# KEYS: task. ARGV: task id.
_SET_ACTIVE_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[1]) ~= 1 then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'INIT' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'status', 'ACTIVE', 'started_at', t[1] .. '.' .. string.format('%06d', t[2]))
  return 1
end
return 0
"""

# KEYS: task. ARGV: status, reason, task id.
_END_TASK_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[3]) ~= 1 then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'INIT' or status == 'ACTIVE' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'end_reason', ARGV[2],
             'ended_at', t[1] .. '.' .. string.format('%06d', t[2]))
  return 1
end
return 0
"""

# KEYS: task, then keys to remove. Removes them only while no task of this name exists: what nodes of
# a task that vanished (a Redis restarted empty, FLUSHALL) wrote back under its prefix as they stopped.
_DELETE_ORPHANS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local removed = 0
for i = 2, #KEYS do removed = removed + redis.call('UNLINK', KEYS[i]) end
return removed
"""
