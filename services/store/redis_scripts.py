"""The Lua scripts of the Redis store: every write is one script, so it is atomic.

Each script but APPEND_METRICS and REQUEST_CANCEL first looks up its op token (KEYS[1]): a write
that already ran returns what it returned then (or its run's current state) and changes nothing.
The store makes one token per call and reuses it for every retry and for a later flush from the
outage buffer, so a write whose reply was lost (sent, applied, connection dropped) is never
applied twice. Tokens expire after `ARGV[1]` seconds (a day: far beyond any retry, and beyond any
outage the buffer is meant to ride out). Those two need no token, and so cost no memory per
write: a record's step already makes a metrics write idempotent, as setting a field only while
it is unset makes a cancel request's.

Errors come back as `KPO_<CODE> [detail]` replies; `redis_store` turns them into store errors.
Scripts never fail half way: everything that could refuse the write is checked before the first
write (Redis does not roll back a script's earlier writes when a later command fails).
The lifecycle table is not repeated here: the caller passes the statuses a run may come from.
"""

from __future__ import annotations

# KEYS: op token, run hash, runs index, index of queued runs, sequence counter, events stream,
#       index of running runs, [idempotency key]
# ARGV: op ttl, run id, spec json, spec hash, created_at, transitions json, status event json,
#       run-hash key prefix, queued status name, status event kind, most active runs (0: no
#       limit), how long (ms) the idempotency key outlives the run's end
# A resend with a key that made a run returns that run before the cap is looked at; the cap
# counts the queued and running indexes, in the same script as the insert, so that concurrent
# creates cannot overshoot it.
CREATE_RUN = """
local done = redis.call('GET', KEYS[1])
if done then return done end
local idem = KEYS[8]
if idem then
  local existing = redis.call('GET', idem)
  if existing then
    if redis.call('HGET', ARGV[8] .. existing, 'spec_hash') ~= ARGV[4] then
      return redis.error_reply('KPO_CONFLICT ' .. existing)
    end
    return existing
  end
end
local limit = tonumber(ARGV[11])
if limit > 0 and redis.call('ZCARD', KEYS[4]) + redis.call('ZCARD', KEYS[7]) >= limit then
  return redis.error_reply('KPO_QUOTA ' .. ARGV[11])
end
if redis.call('EXISTS', KEYS[2]) == 1 then return redis.error_reply('KPO_DUPLICATE_ID') end
local seq = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[2], 'id', ARGV[2], 'status', ARGV[9], 'spec', ARGV[3],
  'spec_hash', ARGV[4], 'created_at', ARGV[5], 'transitions', ARGV[6], 'seq', seq,
  'last_step', '-1')
redis.call('ZADD', KEYS[3], seq, ARGV[2])
redis.call('ZADD', KEYS[4], seq, ARGV[2])
redis.call('XADD', KEYS[6], '*', 'k', ARGV[10], 'd', ARGV[7], 't', ARGV[5])
if idem then
  redis.call('SET', idem, ARGV[2])
  -- The transition to a finished status sets the key's expiry from these.
  redis.call('HSET', KEYS[2], 'idem', idem, 'idem_ttl_ms', ARGV[12])
end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
return ARGV[2]
"""

# KEYS: op token, run hash, events stream
# ARGV: op ttl, new status, transition entry json, error ('' for none), status-index key prefix,
#       status event json, now, status event kind, '1' when the new status is a finished one
#       (else '0'), then every status the run may come from
# Returns the run hash after the change (HGETALL). A run that finishes starts the expiry of the
# idempotency key that made it (if it still names this run).
TRANSITION = """
if not redis.call('GET', KEYS[1]) then
  local current = redis.call('HGET', KEYS[2], 'status')
  if not current then return redis.error_reply('KPO_NOT_FOUND') end
  local allowed = false
  for i = 10, #ARGV do
    if ARGV[i] == current then allowed = true end
  end
  if not allowed then return redis.error_reply('KPO_ILLEGAL ' .. current) end
  local run = redis.call('HMGET', KEYS[2], 'id', 'seq', 'transitions', 'idem', 'idem_ttl_ms')
  -- Append one element to the stored JSON array, as codec.append_transition does.
  local transitions = string.sub(run[3], 1, -2) .. ',' .. ARGV[3] .. ']'
  redis.call('HSET', KEYS[2], 'status', ARGV[2], 'transitions', transitions)
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], 'error', ARGV[4]) end
  redis.call('ZREM', ARGV[5] .. current, run[1])
  redis.call('ZADD', ARGV[5] .. ARGV[2], run[2], run[1])
  redis.call('XADD', KEYS[3], '*', 'k', ARGV[8], 'd', ARGV[6], 't', ARGV[7])
  if ARGV[9] == '1' and run[4] and redis.call('GET', run[4]) == run[1] then
    redis.call('PEXPIRE', run[4], run[5])
  end
  redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
end
return redis.call('HGETALL', KEYS[2])
"""

# KEYS: run hash
# ARGV: now, then every finished status
# Returns the run hash (HGETALL). Needs no op token: it writes only a field that is unset, so a
# retry after a lost reply changes nothing, and the first request's time is kept.
REQUEST_CANCEL = """
local run = redis.call('HMGET', KEYS[1], 'status', 'cancel_requested_at')
if not run[1] then return redis.error_reply('KPO_NOT_FOUND') end
local finished = false
for i = 2, #ARGV do
  if ARGV[i] == run[1] then finished = true end
end
if not finished and not run[2] then
  redis.call('HSET', KEYS[1], 'cancel_requested_at', ARGV[1])
end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: run hash
# ARGV: the restart count, then every finished status
# Returns the run hash (HGETALL). Needs no op token: the count only rises, so a retry after a
# lost reply changes nothing.
RECORD_DRIVER_RESTARTS = """
local run = redis.call('HMGET', KEYS[1], 'status', 'driver_restarts')
if not run[1] then return redis.error_reply('KPO_NOT_FOUND') end
local finished = false
for i = 2, #ARGV do
  if ARGV[i] == run[1] then finished = true end
end
if not finished and tonumber(run[2] or '0') < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'driver_restarts', ARGV[1])
end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: run hash, metrics stream, events stream
# ARGV: now, metrics event kind, then (step, record json) pairs
# Returns how many records were stored.
APPEND_METRICS = """
local last = redis.call('HGET', KEYS[1], 'last_step')
if not last then return redis.error_reply('KPO_NOT_FOUND') end
local last_n = tonumber(last)
local stored = 0
for i = 3, #ARGV, 2 do
  local step = tonumber(ARGV[i])
  if step > last_n then
    -- The stream id is the step: XADD itself refuses an id at or below the stream's last one.
    -- The sequence part is 1 because 0-0 is not a valid stream id.
    redis.call('XADD', KEYS[2], ARGV[i] .. '-1', 'r', ARGV[i + 1])
    redis.call('XADD', KEYS[3], '*', 'k', ARGV[2], 'd', ARGV[i + 1], 't', ARGV[1])
    last, last_n = ARGV[i], step
    stored = stored + 1
  end
end
redis.call('HSET', KEYS[1], 'last_step', last)
return stored
"""

# KEYS: op token, run hash, metrics stream, events stream
# ARGV: op ttl, step, rewound event kind, event json, now
# Returns how many records were dropped.
REWIND_METRICS = """
local done = redis.call('GET', KEYS[1])
if done then return tonumber(done) end
local last = redis.call('HGET', KEYS[2], 'last_step')
if not last then return redis.error_reply('KPO_NOT_FOUND') end
local dropped = 0
if tonumber(last) > tonumber(ARGV[2]) then
  local ids = {}
  local first = string.format('%d-0', tonumber(ARGV[2]) + 1)
  for _, entry in ipairs(redis.call('XRANGE', KEYS[3], first, '+')) do
    ids[#ids + 1] = entry[1]
  end
  -- In chunks: unpack() of many thousand arguments overflows Lua's stack.
  for i = 1, #ids, 1000 do
    redis.call('XDEL', KEYS[3], unpack(ids, i, math.min(i + 999, #ids)))
  end
  dropped = #ids
  -- XADD refuses an id at or below the stream's last id, deleted or not: the steps trained
  -- again need it back at the rewound step (every entry left is at or below it).
  redis.call('XSETID', KEYS[3], ARGV[2] .. '-1')
  redis.call('HSET', KEYS[2], 'last_step', ARGV[2])
  redis.call('XADD', KEYS[4], '*', 'k', ARGV[3], 'd', ARGV[4], 't', ARGV[5])
end
redis.call('SET', KEYS[1], tostring(dropped), 'EX', ARGV[1])
return dropped
"""

# KEYS: op token, run hash, events stream
# ARGV: op ttl, kind, data json, now
# Returns the event id.
APPEND_EVENT = """
local done = redis.call('GET', KEYS[1])
if done then return done end
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('KPO_NOT_FOUND') end
local id = redis.call('XADD', KEYS[3], '*', 'k', ARGV[2], 'd', ARGV[3], 't', ARGV[4])
redis.call('SET', KEYS[1], id, 'EX', ARGV[1])
return id
"""

# KEYS: op token, run hash, logs list
# ARGV: op ttl, lines kept, then the lines
APPEND_LOGS = """
if redis.call('GET', KEYS[1]) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('KPO_NOT_FOUND') end
-- In chunks: unpack() of many thousand arguments overflows Lua's stack.
for i = 3, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[2]), -1)
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
return 1
"""
