"""The Lua scripts of the Redis ledger: each reservation, check and reconcile is one atomic script.

Meter kinds (`ctxgate.gateway.quota.model`): 0 a counter (a string, INCRBY), 1 a parallel-slot set
checked, 2 one held (a sorted set of request id -> deadline), 3 a sliding window (a hash of
bucket -> amount, the rule of `ctxgate.gateway.quota.sliding`: buckets >= ARGV[3] count).

ARGV of `RESERVE` and `CHECK`: now, slot id, the oldest counted bucket, then per key: kind, limit,
amount, ttl, bucket. Their reply: {admitted (1/0), index of the refusing meter (0 when admitted),
each meter's level (n), each meter's newest live bucket (n; -1 when none or not sliding), then the
refusing sliding meter's live buckets as bucket, amount pairs} — the levels after the reservation
when admitted, as read when refused. The levels come from the same atomic script, so the
rate-limit headers built from them are exact.
"""

from __future__ import annotations

# read(i, kind, prune): a meter's level and its newest live bucket; `prune` drops what has left
# its window (the reservation does; the read-only check does not).
_READ = """
local now, oldest = tonumber(ARGV[1]), tonumber(ARGV[3])
local function read(i, kind, prune)
  if kind == 0 then
    return tonumber(redis.call('GET', KEYS[i]) or '0'), -1
  elseif kind == 3 then
    local fields = redis.call('HGETALL', KEYS[i])
    local sum, newest = 0, -1
    for j = 1, #fields, 2 do
      local bucket, amount = tonumber(fields[j]), tonumber(fields[j + 1])
      if bucket < oldest then
        if prune then redis.call('HDEL', KEYS[i], fields[j]) end
      else
        sum = sum + amount
        if amount > 0 and bucket > newest then newest = bucket end
      end
    end
    return sum, newest
  elseif prune then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    return redis.call('ZCARD', KEYS[i]), -1
  end
  return redis.call('ZCOUNT', KEYS[i], '(' .. ARGV[1], '+inf'), -1
end
local function argn(i, field) return tonumber(ARGV[3 + (i - 1) * 5 + field]) end
local function over(i, level)
  local kind, limit, amount = argn(i, 1), argn(i, 2), argn(i, 3)
  if kind == 1 or kind == 2 then return level + 1 > limit end
  return limit >= 0 and level + amount > limit
end
local function refused(result, i)
  result[1], result[2] = 0, i
  if argn(i, 1) == 3 then
    local fields = redis.call('HGETALL', KEYS[i])
    for j = 1, #fields, 2 do
      if tonumber(fields[j]) >= oldest then
        result[#result + 1] = fields[j]
        result[#result + 1] = fields[j + 1]
      end
    end
  end
  return result
end
local n = #KEYS
local result = {1, 0}
for i = 1, n do
  result[2 + i], result[2 + n + i] = read(i, argn(i, 1), PRUNE)
end
for i = 1, n do
  if over(i, result[2 + i]) then return refused(result, i) end
end
"""

# Check every meter first, then apply every one: all-or-nothing in one atomic script.
RESERVE = (
    "local PRUNE = true\n"
    + _READ
    + """
for i = 1, n do
  local kind, amount, ttl = argn(i, 1), argn(i, 3), argn(i, 4)
  if kind == 0 then
    result[2 + i] = redis.call('INCRBY', KEYS[i], amount)
    if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ttl) end
  elseif kind == 3 then
    local bucket = ARGV[3 + (i - 1) * 5 + 5]
    redis.call('HINCRBY', KEYS[i], bucket, amount)
    redis.call('EXPIRE', KEYS[i], ttl)
    result[2 + i] = result[2 + i] + amount
    if amount > 0 and tonumber(bucket) > result[2 + n + i] then result[2 + n + i] = tonumber(bucket) end
  elseif kind == 2 then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[2])
    redis.call('EXPIRE', KEYS[i], ttl)
    result[2 + i] = redis.call('ZCARD', KEYS[i])
  end
end
return result
"""
)

# `RESERVE`'s checks alone, read-only; the same reply, with the levels as read.
CHECK = "local PRUNE = false\n" + _READ + "\nreturn result\n"

# Counters and sliding buckets: add the delta only where the counter or bucket still exists (an
# expired window must not be resurrected by a late delta), never below zero. Slot sets: remove this
# request's slot. ARGV: slot id, then per key: kind, bucket, delta.
RECONCILE = """
for i = 1, #KEYS do
  local base = 1 + (i - 1) * 3
  local kind, bucket, delta = tonumber(ARGV[base + 1]), ARGV[base + 2], tonumber(ARGV[base + 3])
  if kind == 2 then
    redis.call('ZREM', KEYS[i], ARGV[1])
  elseif kind == 3 then
    if delta ~= 0 and redis.call('HEXISTS', KEYS[i], bucket) == 1 then
      if redis.call('HINCRBY', KEYS[i], bucket, delta) < 0 then redis.call('HSET', KEYS[i], bucket, 0) end
    end
  elseif delta ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    if redis.call('INCRBY', KEYS[i], delta) < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
return 1
"""
