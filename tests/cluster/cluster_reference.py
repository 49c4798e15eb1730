"""A slow, obviously-correct reference simulator for the cluster paradigms (tests only).

It runs on replayed durations (gradient ``j`` of worker ``m`` takes
``times[m, j % n]`` seconds), so it needs nothing from the fast simulator. It
keeps each worker's state explicitly (computing until ``finish[m]``, or not),
finds the next push by scanning all workers for the smallest
``(finish time, worker)``, and applies the paradigm's rule written out
directly, re-checking every barrier from scratch. It returns plain Python
records that the tests compare with a ``Schedule``, event for event.
"""

from __future__ import annotations

import math

import numpy as np


class Durations:
  def __init__(self, times: np.ndarray):
    self.times = np.asarray(times, np.float64)
    self.count = [0] * self.times.shape[0]

  def next(self, m: int) -> float:
    j = self.count[m]
    self.count[m] += 1
    return float(self.times[m, j % self.times.shape[1]])


class Result:
  """updates: list of (time, {worker: (read_version, num_batches)}); events: list of tuples."""

  def __init__(self, num_workers: int):
    self.updates: list[tuple[float, dict[int, tuple[int, int]]]] = []
    self.events: list[tuple[int, float, float, int, int]] = []  # worker, read, end, update, version
    self.wait = [0.0] * num_workers
    self.threshold: list[int] = []


class Cluster:
  """Explicit per-worker state shared by the asynchronous references."""

  def __init__(self, times: np.ndarray):
    self.dur = Durations(times)
    self.num = self.dur.times.shape[0]
    self.version = 0
    self.finish: list[float | None] = [None] * self.num
    self.read_time = [0.0] * self.num
    self.read_version = [0] * self.num
    self.blocked_since: dict[int, float] = {}
    self.result = Result(self.num)
    for m in range(self.num):
      self.read(m, 0.0)

  def read(self, m: int, t: float) -> None:
    if m in self.blocked_since:
      self.result.wait[m] += t - self.blocked_since.pop(m)
    self.read_time[m] = t
    self.read_version[m] = self.version
    self.finish[m] = t + self.dur.next(m)

  def block(self, m: int, t: float) -> None:
    self.blocked_since[m] = t

  def next_push(self) -> tuple[float, int]:
    best = None
    for m in range(self.num):
      if self.finish[m] is not None and (best is None or (self.finish[m], m) < best):
        best = (self.finish[m], m)
    assert best is not None, "deadlock: nobody is computing"
    t, m = best
    self.finish[m] = None
    return t, m

  def event(self, m: int, end: float, update: int) -> None:
    self.result.events.append((m, self.read_time[m], end, update, self.read_version[m]))

  def apply(self, t: float, contributions: dict[int, tuple[int, int]]) -> None:
    self.result.updates.append((t, dict(contributions)))
    self.version += 1

  def finish_up(self) -> Result:
    t_end = self.result.updates[-1][0]
    for m in range(self.num):
      if self.finish[m] is not None:
        self.result.events.append((m, self.read_time[m], self.finish[m], -2, self.read_version[m]))
    for m, since in self.blocked_since.items():
      self.result.wait[m] += t_end - since
    return self.result


def asp(times: np.ndarray, num_updates: int) -> Result:
  c = Cluster(times)
  while True:
    t, m = c.next_push()
    c.event(m, t, c.version)
    c.apply(t, {m: (c.read_version[m], 1)})
    if c.version == num_updates:
      c.block(m, t)
      return c.finish_up()
    c.read(m, t)


def ssp(times: np.ndarray, num_updates: int, s: int) -> Result:
  c = Cluster(times)
  clock = [0] * c.num
  while True:
    t, m = c.next_push()
    c.event(m, t, c.version)
    c.apply(t, {m: (c.read_version[m], 1)})
    clock[m] += 1
    c.block(m, t)
    if c.version == num_updates:
      return c.finish_up()
    for w in sorted(c.blocked_since):
      if min(clock) >= clock[w] - s:
        c.read(w, t)


def dssp(times: np.ndarray, num_updates: int, s_lower: int, s_upper: int) -> Result:
  c = Cluster(times)
  clock = [0] * c.num
  grant = [0] * c.num
  held = [s_lower] * c.num
  pushes: list[list[float]] = [[0.0] for _ in range(c.num)]
  r_max = s_upper - s_lower
  while True:
    t, m = c.next_push()
    c.event(m, t, c.version)
    c.apply(t, {m: (c.read_version[m], 1)})
    clock[m] += 1
    pushes[m].append(t)
    c.block(m, t)
    # Workers blocked earlier continue once they are within s_lower of the slowest.
    for w in sorted(c.blocked_since):
      if w != m and clock[w] - min(clock) <= s_lower and c.version < num_updates:
        c.read(w, t)
    gap = clock[m] - min(clock)
    if grant[m] > 0:
      grant[m] -= 1
      go, thr = True, held[m]
    elif gap <= s_lower:
      go, thr = True, s_lower
    elif clock[m] == max(clock):
      slow = min(w for w in range(c.num) if clock[w] == min(clock))
      t_slow = pushes[slow][-1]
      d_slow = pushes[slow][-1] - pushes[slow][-2] if len(pushes[slow]) > 1 else 0.0
      if d_slow <= 0:
        d_slow = t - t_slow
      d_fast = pushes[m][-1] - pushes[m][-2]
      best_i, best = 0, math.inf
      for i in range(min(r_max, s_upper - gap + 1) + 1):
        t_fast = t + i * d_fast
        if d_slow > 0:
          dist = min(abs(t_fast - t_slow - j * d_slow) for j in range(1, r_max + 2))
        else:
          dist = abs(t_fast - t_slow)
        if dist < best:
          best_i, best = i, dist
      if best_i > 0:
        grant[m] = best_i - 1
        thr = held[m] = gap - 1 + best_i
        go = True
      else:
        go, thr = False, s_lower
    else:
      go, thr = False, s_lower
    c.result.threshold.append(thr)
    if c.version == num_updates:
      return c.finish_up()
    if go:
      c.read(m, t)


def aggregate(times: np.ndarray, num_updates: int, count: int, wait_for_update: bool) -> Result:
  """softsync / K-batch-async (held pushes) and K-async (``wait_for_update``)."""
  c = Cluster(times)
  pending: dict[int, list[int]] = {}   # worker -> [read version, minibatches], in insertion order
  pushed = 0
  held: list[tuple[int, float]] = []

  def accept(w: int, t_push: float, t: float) -> bool:
    nonlocal pushed, pending
    c.event(w, t_push, c.version)
    pending.setdefault(w, [c.read_version[w], 0])[1] += 1
    pushed += 1
    if pushed < count:
      return False
    c.apply(t, {w: (v, n) for w, (v, n) in pending.items()})
    pending, pushed = {}, 0
    return True

  while True:
    t, m = c.next_push()
    if m in pending and pending[m][0] != c.read_version[m]:
      held.append((m, t))
      c.block(m, t)
      continue
    before = dict(pending)
    applied = accept(m, t, t)
    if c.version == num_updates:
      c.block(m, t)
      break
    if wait_for_update:
      c.block(m, t)
      if applied:
        for w in list(before) + [m]:
          c.read(w, t)
      continue
    c.read(m, t)
    if applied:
      queue, held = held, []
      while queue:
        w, t_push = queue.pop(0)
        accept(w, t_push, t)
        if c.version == num_updates:
          held = queue
          break
        c.read(w, t)
      if c.version == num_updates:
        break
  result = c.finish_up()
  for w, t_push in held:
    result.events.append((w, c.read_time[w], t_push, -2, c.read_version[w]))
  return result


def backup(times: np.ndarray, num_updates: int, b: int) -> Result:
  c = Cluster(times)
  needed = c.num - b
  fresh: list[int] = []
  while True:
    t, m = c.next_push()
    if c.read_version[m] != c.version:
      c.event(m, t, -1)
      c.read(m, t)
      continue
    c.event(m, t, c.version)
    fresh.append(m)
    c.block(m, t)
    if len(fresh) == needed:
      c.apply(t, {w: (c.read_version[w], 1) for w in fresh})
      if c.version == num_updates:
        return c.finish_up()
      for w in fresh:
        c.read(w, t)
      fresh = []


def k_sync(times: np.ndarray, num_updates: int, k: int) -> Result:
  dur = Durations(times)
  num = dur.times.shape[0]
  result = Result(num)
  t0 = 0.0
  for r in range(num_updates):
    finish = [(t0 + dur.next(m), m) for m in range(num)]
    ranked = sorted(finish)
    t = ranked[k - 1][0]
    first = {m for _, m in ranked[:k]}
    for f, m in finish:
      if m in first:
        result.events.append((m, t0, f, r, r))
        result.wait[m] += t - f
      else:
        result.events.append((m, t0, t, -1, r))
    result.updates.append((t, {m: (r, 1) for m in sorted(first)}))
    t0 = t
  return result


def k_batch_sync(times: np.ndarray, num_updates: int, k: int) -> Result:
  dur = Durations(times)
  num = dur.times.shape[0]
  result = Result(num)
  t = 0.0
  for r in range(num_updates):
    t0 = t
    start = [t0] * num
    finish = [t0 + dur.next(m) for m in range(num)]
    batches = [0] * num
    for i in range(k):
      t, m = min((finish[w], w) for w in range(num))
      batches[m] += 1
      result.events.append((m, start[m], t, r, r))
      if i + 1 < k:
        start[m] = t
        finish[m] = t + dur.next(m)
      else:
        finish[m] = math.inf
    for m in range(num):
      if finish[m] != math.inf:
        result.events.append((m, start[m], t, -1, r))
    result.updates.append((t, {m: (r, batches[m]) for m in range(num) if batches[m]}))
  return result
