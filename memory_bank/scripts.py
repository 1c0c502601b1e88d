"""The bank's atomic state changes, as Lua scripts over the `{ns}`-tagged global keys.

Each script runs atomically on the server, so producers and the learner never see a
half-moved group. Entry keys (other hash tags) are written before a group is queued and
deleted after it is evicted; a crash in between leaves at worst an orphan, never a loss.

Fencing: every script that moves a group (push, pull, commit, requeue, restore, discard,
quarantine) takes the namespace's lease and epoch keys last in KEYS and the caller's fence (the lease
value its run holds, '' for none) and the lease TTL first in ARGV, and checks them before it
changes anything (FENCE below): a bank whose run lost the lease to another run is refused with
a `LEASELOST <holder>` error reply, and a bank without a fence is refused while a run holds
the lease. A lapsed lease (nobody holds it) is taken again by the fenced caller, as the
renewal thread would, but only while no other run has claimed it since (the epoch).

Orphans: an evicted entry leaves the accounting inside the script, but its keys (other hash
slots) are deleted by the caller after the reply. Each eviction is therefore recorded in the
`trash` hash (entry id -> bytes) and every evicting script returns the trash's ids, so a reply
lost after the script ran leaves ids that the next evicting call returns and its caller
deletes (then HDELs from the trash).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
from redis.exceptions import NoScriptError

from memory_bank import wire

# Prepended to every fenced script: the lease and epoch keys are the last of KEYS, fence and TTL the first
# two ARGV; local KEYS and ARGV without them shadow the globals (left unchanged), so the
# script's own indexes are those of its documented KEYS and ARGV.
# The lease's epoch key follows it: a lapsed lease is taken again only while the epoch is still
# the one the fence names (`"epoch": N` ends a lease value, memory_bank.ownership), so a run
# whose lease another run claimed (and released) since is refused, not handed the lease back.
FENCE = """
local LEASE, EPOCH, FENCE, LEASE_TTL = KEYS[#KEYS - 1], KEYS[#KEYS], ARGV[1], ARGV[2]
local KEYS, ARGV = {unpack(KEYS, 1, #KEYS - 2)}, {unpack(ARGV, 3)}
local holder = redis.call('GET', LEASE)
if holder then
  if holder ~= FENCE then return redis.error_reply('LEASELOST ' .. holder) end
elseif FENCE ~= '' then
  local now = redis.call('GET', EPOCH)
  if now ~= string.match(FENCE, '"epoch": (%d+)}$') then
    return redis.error_reply('LEASELOST epoch ' .. (now or 'none'))
  end
  redis.call('SET', LEASE, FENCE, 'PX', LEASE_TTL)
end
"""

# KEYS: fresh, pending (the consumer's own), einfo, consumers (+ lease). ARGV: (fence, ttl +)
# n, group_prefix, cond_prefix, consumer id. Reliable queue: a pulled group stays in its consumer's `pending`
# until commit, so a learner crash loses nothing (requeue puts it back). Returns, in one
# round trip, {groups, banks}: groups[i] = {gid, cond, version, eids, cond record key ('' for a
# group pushed before groups named it)}; banks[j] = {cid, eid1, einfo1, eid2, einfo2, ...}.
# Group and condition keys are built here; they share the {ns} slot with KEYS.
PULL = FENCE + """
local groups, conds, banks = {}, {}, {}
redis.call('SADD', KEYS[4], ARGV[4])
for _ = 1, tonumber(ARGV[1]) do
  local g = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not g then break end
  local rec = redis.call('HMGET', ARGV[2] .. g, 'cond', 'version', 'eids', 'ck')
  groups[#groups + 1] = {g, rec[1] or '', rec[2] or '', rec[3] or '', rec[4] or ''}
  if rec[1] then conds[rec[1]] = true end
end
for cid, _ in pairs(conds) do
  local row = {cid}
  local ix = redis.call('LRANGE', ARGV[3] .. cid, 0, -1)
  if #ix > 0 then
    local infos = redis.call('HMGET', KEYS[3], unpack(ix))
    for i, eid in ipairs(ix) do
      row[#row + 1] = eid
      row[#row + 1] = infos[i] or ''
    end
  end
  banks[#banks + 1] = row
end
return {groups, banks}
"""

# KEYS: pending (one consumer's), fresh (+ lease). ARGV: (fence, ttl). Its oldest pending group ends up first in fresh,
# in its old order. Only the caller's own list: another live consumer's pulls stay its own.
REQUEUE = FENCE + """
local n = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
return n
"""

# KEYS: consumers, fresh, the single pending list of banks written before consumer ids
# (+ lease). ARGV: (fence, ttl +) pending key prefix. Every consumer's pending groups back to fresh: only for the
# namespace's owner taking over from a dead run (it holds the lease).
REQUEUE_ALL = FENCE + """
local n = 0
while redis.call('LMOVE', KEYS[3], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
for _, c in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. c
  while redis.call('LMOVE', key, KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
  redis.call('SREM', KEYS[1], c)
end
return n
"""

# Shared by PUSH, COMMIT, EVICT, RESTORE and QUARANTINE: forget an entry's accounting, put its
# id in the trash for the caller to delete its keys, and drop the entry's reference to its
# encoded condition. KEYS[E], KEYS[B], KEYS[Z], KEYS[S], KEYS[C], KEYS[Q], KEYS[T] are einfo,
# bytes, bankz, conds, cinfo, qbytes, trash. A condition record (`cinfo`'s sibling
# `condrec:<key>`, the same {ns} slot) counts in `bytes` while any entry names it and in
# `qbytes` while a queued entry does; it is deleted here, atomically, when no entry names it,
# so a producer never finds half of it (and it is never an orphan). `reclaim()` is what such a
# script returns: the ids evicted now and (up to 256) left in the trash by calls whose reply
# was lost.
_EVICT_FN = """
local evicted = {}
local sizes = {}   -- eid -> its bytes, from the caller, for an entry whose index info cannot say
local function decoded(raw)
  if not raw then return nil end
  local ok, d = pcall(cjson.decode, raw)
  if ok and type(d) == 'table' then return d end
  return nil
end
-- a stored count (bytes, references) as the scripts write it: a whole number 0 <= n < 2^53;
-- nil for anything else a flip or a hand left there (1e999, NaN, -7, 10^400, a string)
local function count(v)
  if v == nil then return nil end
  v = tonumber(v)
  if v and v == v and v >= 0 and v < 9007199254740992 and v == math.floor(v) then return v end
  return nil
end
local function crec(ck)
  return (string.gsub(KEYS[C], 'cinfo$', 'condrec:')) .. ck
end
-- what a condition record holds (field names and values), as codec.cond_nbytes counts it
local function record_size(ck)
  local key, n = crec(ck), 0
  for _, f in ipairs(redis.call('HKEYS', key)) do n = n + #f + redis.call('HSTRLEN', key, f) end
  return n
end
-- each record key -> entries naming it, and those queued (not in bankz), from the index infos
-- as they are now (an entry whose own info is unreadable names none)
local function tally()
  local n, q = {}, {}
  local all = redis.call('HGETALL', KEYS[E])
  for i = 1, #all, 2 do
    local d = decoded(all[i + 1])
    local ck = d and d['k']
    if type(ck) == 'string' then
      n[ck] = (n[ck] or 0) + 1
      if not redis.call('ZSCORE', KEYS[Z], all[i]) then q[ck] = (q[ck] or 0) + 1 end
    end
  end
  return n, q
end
-- record ck (its cinfo d, its bytes b) is named by n entries, q of them queued (q0 before): it
-- counts in qbytes while q > 0, and is deleted when no entry names it
local function settle(ck, d, b, n, q, q0)
  if n <= 0 then q = 0 end
  if q0 == 0 and q > 0 then redis.call('INCRBY', KEYS[Q], b) end
  if q0 > 0 and q == 0 then redis.call('DECRBY', KEYS[Q], b) end
  if n <= 0 then
    redis.call('HDEL', KEYS[C], ck)
    redis.call('DECRBY', KEYS[B], b)
    redis.call('DEL', crec(ck))
  else
    local cond = nil
    if type(d['cond']) == 'string' then cond = d['cond'] end
    redis.call('HSET', KEYS[C], ck, cjson.encode({b = b, n = n, q = q, cond = cond}))
  end
end
-- every record's accounting counted again from the index infos, when a script meets an entry
-- whose info names no readable record (a damaged value): whatever it named is counted right
local function recount()
  local n, q = tally()
  local recs = redis.call('HGETALL', KEYS[C])
  for i = 1, #recs, 2 do
    local ck, d = recs[i], decoded(recs[i + 1]) or {}
    local qn = q[ck] or 0
    settle(ck, d, count(d['b']) or record_size(ck), n[ck] or 0, qn, count(d['q']) or qn)
  end
end
-- dn more entries name condition record ck, dq more of them queued; called after the index
-- infos hold the change (a damaged count is counted again from them)
local function cond_ref(ck, dn, dq)
  if type(ck) ~= 'string' then return recount() end
  local d = decoded(redis.call('HGET', KEYS[C], ck))
  if not d then return recount() end
  local b, n, q = count(d['b']) or record_size(ck), count(d['n']), count(d['q'])
  if n and q then return settle(ck, d, b, n + dn, math.max(q + dq, 0), q) end
  local ns, qs = tally()
  settle(ck, d, b, ns[ck] or 0, qs[ck] or 0, math.max((qs[ck] or 0) - dq, 0))
end
local function evict(eid)
  local d = decoded(redis.call('HGET', KEYS[E], eid))
  local b = 0
  if redis.call('HDEL', KEYS[E], eid) == 1 then
    b = (d and count(d['b'])) or sizes[eid] or 0
    redis.call('DECRBY', KEYS[B], b)
    local queued = not redis.call('ZSCORE', KEYS[Z], eid)   -- banked entries are in bankz
    if d and type(d['k']) == 'string' then cond_ref(d['k'], -1, queued and -1 or 0) else recount() end
  end
  redis.call('ZREM', KEYS[Z], eid)
  redis.call('HSET', KEYS[T], eid, b)
  evicted[#evicted + 1] = eid
end
local function reclaim()
  if redis.call('HLEN', KEYS[T]) <= #evicted then return evicted end
  local seen, out = {}, {}
  for _, eid in ipairs(evicted) do seen[eid] = true; out[#out + 1] = eid end
  for _, eid in ipairs(redis.call('HRANDFIELD', KEYS[T], 256)) do
    if not seen[eid] then out[#out + 1] = eid end
  end
  return out
end
-- Evict the oldest banked entries (global bank order) until the bank holds at most `limit`
-- bytes; queued groups' entries are never in bankz, so they are never evicted here.
local function shrink(limit, cond_prefix)
  while tonumber(redis.call('GET', KEYS[B]) or '0') > limit do
    local oldest = redis.call('ZRANGE', KEYS[Z], 0, 0)[1]
    if not oldest then return end
    local d = decoded(redis.call('HGET', KEYS[E], oldest))
    if d and type(d['cond']) == 'string' then
      local ckey = cond_prefix .. d['cond']
      redis.call('LREM', ckey, 0, oldest)
      if redis.call('LLEN', ckey) == 0 then redis.call('SREM', KEYS[S], d['cond']) end
    end
    evict(oldest)
  end
end
-- an entry's composite for SDU's order; 0 when its index info holds no finite number
local function composite(eid)
  local d = decoded(redis.call('HGET', KEYS[E], eid))
  local c = d and tonumber(d['c'])
  if c and c == c and c > -math.huge and c < math.huge then return c end
  return 0
end
"""


def _with_evict(body: str, e: int, b: int, z: int, s: int, c: int, q: int, t: int) -> str:
    fn = _EVICT_FN
    for letter, i in (("E", e), ("B", b), ("Z", z), ("S", s), ("C", c), ("Q", q), ("T", t)):
        fn = fn.replace(f"KEYS[{letter}]", f"KEYS[{i}]")
    return fn + body


# KEYS: group, fresh, einfo, bytes, counts, qbytes, bankz, conds, cinfo, trash (+ lease)
# ARGV: (fence, ttl +) gid, token, cid, version, total_bytes, n, max_bytes, cond_prefix,
#       cond key, cond bytes, then n × (eid, einfo_json)
# Enforces bank.max_bytes: queued (fresh + pending) groups, and the condition records they name,
# are never evicted, so a group that does not fit beside them is refused ({-2, reclaim, queued
# bytes, what its condition adds}); banked entries are a cache, so the oldest are evicted to make
# room. The group's condition record must exist: the producer writes it first unless it stored
# it before (it does not ask); one missing answers {-3, reclaim} (write it again). The group
# record keeps the condition record's key (`ck`, for the pull). A refused push deletes a record
# no entry names.
# Returns {1 | 0 (our own retry) | -1 (duplicate) | -2 (full) | -3, reclaim()[, queued, extra]}.
PUSH = FENCE + _with_evict("""
local ck, cbytes = ARGV[9], tonumber(ARGV[10])
local function unclaimed()
  if not redis.call('HGET', KEYS[9], ck) then redis.call('DEL', crec(ck)) end
end
local token = redis.call('HGET', KEYS[1], 'token')
if token then
  if token == ARGV[2] then return {0, reclaim()} end   -- our own retried call: already queued
  unclaimed()
  return {-1, reclaim()}                               -- another producer's group with this id
end
local total, limit, n = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[6])
local queued = tonumber(redis.call('GET', KEYS[6]) or '0')
local raw = redis.call('HGET', KEYS[9], ck)
if raw and not decoded(raw) then recount() end  -- a damaged record's accounting: counted again
local d = decoded(redis.call('HGET', KEYS[9], ck))
local extra = 0                                 -- what the condition adds to the queued bytes
if not d then
  if redis.call('EXISTS', crec(ck)) == 0 then return {-3, reclaim()} end
  extra = cbytes
else
  local q = count(d['q'])
  if not q then local _, qs = tally(); q = qs[ck] or 0 end
  if q == 0 then extra = count(d['b']) or record_size(ck) end
end
if queued + total + extra > limit then
  unclaimed()
  return {-2, reclaim(), queued, extra}
end
local eids = {}
for i = 0, n - 1 do
  redis.call('HSET', KEYS[3], ARGV[11 + 2 * i], ARGV[12 + 2 * i])
  eids[#eids + 1] = ARGV[11 + 2 * i]
end
if not d then
  redis.call('HSET', KEYS[9], ck, cjson.encode({b = cbytes, n = 0, q = 0, cond = ARGV[3]}))
  redis.call('INCRBY', KEYS[4], cbytes)
end
cond_ref(ck, n, n)                              -- before shrink: its entries now hold it
shrink(limit - total, ARGV[8])
redis.call('HSET', KEYS[1], 'token', ARGV[2], 'cond', ARGV[3], 'version', ARGV[4],
           'eids', table.concat(eids, ' '), 'bytes', total, 'ck', ck)
redis.call('INCRBY', KEYS[4], total)
redis.call('INCRBY', KEYS[6], total)
redis.call('HINCRBY', KEYS[5], 'pushed', 1)
redis.call('RPUSH', KEYS[2], ARGV[1])
return {1, reclaim()}
""", e=3, b=4, z=7, s=8, c=9, q=6, t=10)

# KEYS: pending (the consumer's own), group, cond, einfo, bytes, counts, log (done or dead),
#       conds, bankz, qbytes, cinfo, trash, quarantine (+ lease)
# ARGV: (fence, ttl +) gid, mode (fifo | sdu | skip | drop), capacity, cid, low_bytes,
#       cond_prefix, log_cap, counter, then the group's entry ids to bank.
# A quarantined member is never banked. Returns {1, reclaim()}, or {0, reclaim()} when the
# group was not pending (exactly once).
COMMIT = FENCE + _with_evict("""
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return {0, reclaim()} end
local all = redis.call('HGET', KEYS[2], 'eids') or ''
local gbytes = count(redis.call('HGET', KEYS[2], 'bytes'))
if not gbytes then             -- damaged: what its entries' index infos say the push counted
  gbytes = 0
  for eid in string.gmatch(all, '%S+') do
    local d = decoded(redis.call('HGET', KEYS[4], eid))
    gbytes = gbytes + ((d and count(d['b'])) or 0)
  end
end
redis.call('DECRBY', KEYS[10], gbytes)
local mode, cap, cid = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local keep = {}
for i = 9, #ARGV do keep[ARGV[i]] = true end
-- 1. members not banked: corrupt ones, or all of them on a skipped or dropped step
local new = {}
for eid in string.gmatch(all, '%S+') do
  if keep[eid] and mode ~= 'skip' and mode ~= 'drop' and redis.call('HEXISTS', KEYS[13], eid) == 0
  then new[#new + 1] = eid else evict(eid) end
end
redis.call('DEL', KEYS[2])
-- 2. bank the rest, newest last; they leave the queue (their condition stays theirs)
for _, eid in ipairs(new) do
  redis.call('RPUSH', KEYS[3], eid)
  redis.call('ZADD', KEYS[9], redis.call('HINCRBY', KEYS[6], 'bank_seq', 1), eid)
  local d = decoded(redis.call('HGET', KEYS[4], eid))
  if d and type(d['k']) == 'string' then cond_ref(d['k'], 0, -1) else recount() end
end
-- 3. trim to capacity N: FIFO drops the oldest, SDU keeps the composite's extremes
local len = redis.call('LLEN', KEYS[3])
if len > cap then
  if mode == 'sdu' then
    local items = redis.call('LRANGE', KEYS[3], 0, -1)
    local order = {}
    for i, eid in ipairs(items) do order[i] = {eid = eid, c = composite(eid), i = i} end
    table.sort(order, function(a, b)
      if a.c == b.c then return a.i > b.i end
      return a.c < b.c
    end)
    local lo = math.floor(cap / 2)
    local drop = {}
    for r = lo + 1, #order - (cap - lo) do drop[order[r].eid] = true end
    redis.call('DEL', KEYS[3])
    for _, eid in ipairs(items) do
      if drop[eid] then evict(eid) else redis.call('RPUSH', KEYS[3], eid) end
    end
  else
    for _ = 1, len - cap do evict(redis.call('LPOP', KEYS[3])) end
  end
end
if redis.call('LLEN', KEYS[3]) > 0 then redis.call('SADD', KEYS[8], cid)
else redis.call('SREM', KEYS[8], cid) end
-- 4. global byte bound: evict the oldest banked entries, never fresh or pending ones.
-- Condition keys are built here; they share the {ns} slot with KEYS, so this is Cluster-safe.
shrink(tonumber(ARGV[5]), ARGV[6])
redis.call('HINCRBY', KEYS[6], ARGV[8], 1)
redis.call('LPUSH', KEYS[7], ARGV[1])
redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[7]) - 1)
return {1, reclaim()}
""", e=4, b=5, z=9, s=8, c=11, q=10, t=12)

# KEYS: cond, einfo, bytes, conds, bankz, qbytes, cinfo, trash. ARGV: cid, eids to remove from the index.
# Not fenced: it only drops entries that are corrupt or evicted already (any reader may).
EVICT = _with_evict("""
for i = 2, #ARGV do
  redis.call('LREM', KEYS[1], 0, ARGV[i])
  evict(ARGV[i])
end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[4], ARGV[1]) end
return reclaim()
""", e=2, b=3, z=5, s=4, c=7, q=6, t=8)

# KEYS: cond, einfo, bytes, conds, bankz, counts, qbytes, cinfo, trash (+ lease).
# ARGV: (fence, ttl +) cid, the snapshot's eids in order.
# Sets the index to the snapshot's entries that still exist; evicts entries banked since.
RESTORE = FENCE + _with_evict("""
local want, wanted = {}, {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    want[#want + 1] = ARGV[i]
    wanted[ARGV[i]] = true
  end
end
for _, eid in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if not wanted[eid] then evict(eid) end
end
redis.call('DEL', KEYS[1])
for _, eid in ipairs(want) do
  redis.call('RPUSH', KEYS[1], eid)
  if not redis.call('ZSCORE', KEYS[5], eid) then
    redis.call('ZADD', KEYS[5], redis.call('HINCRBY', KEYS[6], 'bank_seq', 1), eid)
  end
end
if #want > 0 then redis.call('SADD', KEYS[4], ARGV[1]) else redis.call('SREM', KEYS[4], ARGV[1]) end
return {#want, reclaim()}
""", e=2, b=3, z=5, s=4, c=8, q=7, t=9)

# KEYS: meta. ARGV: trained increment, new status or ''. Never recreates an evicted entry.
TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if tonumber(ARGV[1]) ~= 0 then redis.call('HINCRBY', KEYS[1], 'trained', ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[2]) end
return 1
"""


# KEYS: fresh, pending (the caller's own) (+ lease). ARGV: (fence, ttl +) gid. A queued group
# taken out of fresh into the caller's pending list, for a drop (MemoryBank.discard).
DISCARD = FENCE + """
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: einfo, bytes, bankz, conds, trash, quarantine, counts, qbytes, cinfo (+ lease).
# ARGV: (fence, ttl +) eid, reason, time, cond_prefix, cap, cid, bytes.
# Dead letter for an entry that decodes but cannot be trained, or whose index info cannot be
# read: its record (reason, time, condition, version, a sequence number for order) goes to the
# quarantine hash; a banked entry leaves its condition's index and is evicted, a member of a
# queued group stays until its group is committed or dropped (COMMIT never banks a quarantined
# member). `cid` ('' if unknown): the condition whose index lists it, when its index info may not
# say; `bytes` ('' if unknown): its bytes, when its index info cannot say. Only what reads as a
# condition id and a version goes into the record. Over `cap` records, the oldest are forgotten.
# Returns reclaim().
QUARANTINE = FENCE + _with_evict("""
local eid, cid = ARGV[1], ARGV[6]
sizes[eid] = count(ARGV[7])
local rec = {reason = ARGV[2], time = ARGV[3], seq = redis.call('HINCRBY', KEYS[7], 'quarantine_seq', 1)}
local d = decoded(redis.call('HGET', KEYS[1], eid))
if d then
  if type(d['cond']) == 'string' then rec['condition'] = d['cond'] end
  local v = tonumber(d['v'])
  if v and v == v and math.abs(v) < 9007199254740992 then rec['version'] = v end
end
if cid ~= '' then rec['condition'] = cid end
local listed = cid ~= '' and redis.call('LREM', ARGV[4] .. cid, 0, eid) > 0
rec['banked'] = listed or redis.call('ZSCORE', KEYS[3], eid) ~= false
if rec['banked'] then
  if type(rec['condition']) == 'string' then
    local ckey = ARGV[4] .. rec['condition']
    if not listed then redis.call('LREM', ckey, 0, eid) end
    if redis.call('LLEN', ckey) == 0 then redis.call('SREM', KEYS[4], rec['condition']) end
  end
  evict(eid)
end
if redis.call('HSET', KEYS[6], eid, cjson.encode(rec)) == 1 then
  redis.call('HINCRBY', KEYS[7], 'quarantined', 1)
end
local cap = tonumber(ARGV[5])
local n = redis.call('HLEN', KEYS[6])
if n > cap then
  local all, order = redis.call('HGETALL', KEYS[6]), {}
  for i = 1, #all, 2 do
    local okr, r = pcall(cjson.decode, all[i + 1])
    order[#order + 1] = {all[i], okr and type(r) == 'table' and count(r['seq']) or 0}
  end
  table.sort(order, function(a, b) return a[2] < b[2] end)
  for i = 1, n - cap do redis.call('HDEL', KEYS[6], order[i][1]) end
end
return reclaim()
""", e=1, b=2, z=3, s=4, c=9, q=8, t=5)

FENCED = frozenset({PUSH, PULL, REQUEUE, REQUEUE_ALL, COMMIT, RESTORE, DISCARD, QUARANTINE})


class Fence:
    """What a fenced script is called with: the lease and epoch keys, the caller's fence ('' for
    none) and the lease TTL, which a fenced caller uses to take a lapsed lease again (only while
    the epoch is its own)."""

    def __init__(self, lease_key: str, ttl_ms: int, value: str = "", epoch_key: str = ""):
        self.lease_key, self.ttl_ms, self.value = lease_key, ttl_ms, value
        self.epoch_key = epoch_key or f"{lease_key}:epoch"


class Script:
    """One script; `call(keys, args)` is the command that runs it, as EVALSHA (the body is not
    resent with every call; `run` falls back to EVAL when the server does not know it)."""

    def __init__(self, source: str, fence: Fence | None):
        self.source, self.fence = source, fence
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.fenced = source in FENCED

    def call(self, keys: list, args: list = ()) -> Call:
        if self.fenced:
            f = self.fence
            keys, args = [*keys, f.lease_key, f.epoch_key], [f.value, f.ttl_ms, *args]
        return Call(self, len(keys), [*keys, *args])


class Call:
    """A script invocation queued for `run`."""

    def __init__(self, script: Script, nkeys: int, params: list):
        self.script, self.nkeys, self.params = script, nkeys, params

    def command(self, by_body: bool = False) -> tuple:
        s = self.script
        return ("EVAL", s.source, self.nkeys, *self.params) if by_body else (
            "EVALSHA", s.sha, self.nkeys, *self.params)


def run(client: redis.Redis, commands: list) -> list:
    """Send commands (tuples, or script `Call`s) in one round trip (memory_bank.wire); the
    calls the server answered NOSCRIPT (it never ran them) are sent again as EVAL. Error
    replies come back as exception instances, in place."""
    out = wire.execute(client, [c.command() if isinstance(c, Call) else c for c in commands])
    again = [i for i, r in enumerate(out) if isinstance(r, NoScriptError)]
    if again:
        for i, r in zip(again, wire.execute(client, [commands[i].command(by_body=True)
                                                     for i in again]), strict=True):
            out[i] = r
    return out


def run_one(client: redis.Redis, command) -> Any:
    """`run` for one command; an error reply is raised."""
    (out,) = run(client, [command])
    if isinstance(out, Exception):
        raise out
    return out


def eval_cached(client: redis.Redis, source: str, numkeys: int, *keys_and_args) -> Any:
    """`client.eval(source, numkeys, ...)`, sent as EVALSHA (the body only on NOSCRIPT), as
    every bank script is: the embedded server's actors may run the bank's scripts by digest
    only (memory_bank/privileges.py). Replies as redis-py gives them (bytes, not views)."""
    return _bytes(run_one(client, Call(Script(source, None), numkeys, list(keys_and_args))))


def _bytes(reply: Any) -> Any:
    if isinstance(reply, memoryview):
        return reply.tobytes()
    return [_bytes(r) for r in reply] if isinstance(reply, list) else reply


class Scripts:
    """The bank's scripts, sharing one `Fence` (set `fence.value` when the run claims)."""

    def __init__(self, fence: Fence):
        self.fence = fence
        for name, source in (("push", PUSH), ("pull", PULL), ("requeue", REQUEUE),
                             ("requeue_all", REQUEUE_ALL), ("commit", COMMIT), ("evict", EVICT),
                             ("restore", RESTORE), ("touch", TOUCH), ("discard", DISCARD),
                             ("quarantine", QUARANTINE)):
            setattr(self, name, Script(source, fence))
