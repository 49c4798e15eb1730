"""The cluster simulator: runs a paradigm on workers and records the ``Schedule``.

Asynchronous paradigms run a heap-based event loop over pushes (keys are
``(push time, worker)``, so simultaneous pushes are taken in worker order);
round-synchronous ones (BSP, K-sync, AdaSync) are vectorized over rounds
(the predictive cutoff loops over rounds, its ``K`` depending on the last ones).
Durations are pre-drawn in blocks per worker and gradient index (see
``Workers.draw``). Records grow in typed arrays (8 bytes an entry), and the
schedule stores its contributions sparsely, so memory grows with the number
of gradients, not with ``updates x workers``.

Besides the fields of :class:`Schedule`, every schedule records one entry per
gradient a worker started, in ``extras`` (sorted by worker, then time; left out
with ``record_events=False``):

- ``event_worker``: int64, the worker.
- ``event_read_time``: float64, when it read (started computing).
- ``event_end_time``: float64, when the push arrived, or when the
  computation was cancelled; for a gradient still in flight when the
  simulation ended, when it would have arrived.
- ``event_update``: int64, the update it is part of; ``-1`` if dropped or
  cancelled; ``-2`` if still in flight at the end.
- ``event_read_version``: int64, the version it was computed at.

The simulation ends the moment update ``U - 1`` is applied; ``busy`` and
``wait`` count seconds in ``[0, time[-1]]``, so ``busy + wait == time[-1]`` for
every worker (a worker is always either computing or blocked).
"""

from __future__ import annotations

import array
import heapq
import math
from typing import Any

import numpy as np

from delayjax._checks import check_float, check_int, check_seed
from delayjax.cluster import _paradigms as P
from delayjax.cluster._admission import VersionBudget
from delayjax._memory import available_memory, check_fits
from delayjax.cluster._schedule import Schedule
from delayjax.cluster._workers import Workers

__all__ = ["simulate", "Simulation"]

# Durations are drawn for this many gradient indices of a worker at a time;
# fixed, so the j-th gradient of a worker gets the same time whatever num_updates is.
_BLOCK = 2048

_ROUND_PARADIGMS = (P.BSP, P.KSync, P.KBatchSync, P.AdaSync)


def _window_factors(workers: Workers, t: float) -> np.ndarray:
  factor = np.ones(workers.num_workers)
  for w in workers.windows:
    if w.start <= t < w.stop:
      if w.workers is None:
        factor *= w.slowdown
      else:
        factor[list(w.workers)] *= w.slowdown
  return factor


class _Times:
  """Durations of each worker's gradients, by gradient index, drawn in blocks from per-worker streams.

  Event loops call ``take`` (per worker, with straggler windows at the read
  time); round engines call ``rows`` (all workers in step). ``take`` keeps
  only each worker's current block, so memory does not grow with the run.
  """

  def __init__(self, workers: Workers, seed: np.random.SeedSequence):
    self.workers = workers
    num = workers.num_workers
    self.rngs = [np.random.default_rng(s) for s in seed.spawn(num)]
    self.windows = workers.windows
    self.used = [0] * num
    self.filled = [0] * num
    # Each worker's current block as Python floats (fast to index); without windows a duration is
    # compute + comm, summed once when drawn.
    self.total: list[list[float]] = [[] for _ in range(num)]
    self.compute: list[list[float]] = [[] for _ in range(num)]
    self.comm: list[list[float]] = [[] for _ in range(num)]
    self.blocks: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(num)]

  def _draw(self, m: int) -> tuple[np.ndarray, np.ndarray]:
    block = self.workers.draw(self.rngs[m], m, self.filled[m], _BLOCK)
    self.filled[m] += _BLOCK
    return block

  def take(self, m: int, t: float) -> float:
    """Seconds of worker ``m``'s next gradient, read at time ``t``."""
    j = self.used[m]
    self.used[m] = j + 1
    if j >= self.filled[m]:
      compute, comm = self._draw(m)
      if self.windows:
        self.compute[m] = compute.tolist()
        self.comm[m] = comm.tolist()
      else:
        self.total[m] = (compute + comm).tolist()
    j %= _BLOCK
    if self.windows:
      factor = 1.0
      for w in self.windows:
        if w.start <= t < w.stop and (w.workers is None or m in w.workers):
          factor *= w.slowdown
      return self.compute[m][j] * factor + self.comm[m][j]
    return self.total[m][j]

  def rows(self, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Compute and comm ``[size, M]`` of gradients ``start .. start + size - 1``; forgets earlier blocks."""
    first, last = start // _BLOCK, (start + size - 1) // _BLOCK
    offset = start - first * _BLOCK
    columns = []
    for m, blocks in enumerate(self.blocks):
      while self.filled[m] < start + size:
        index = self.filled[m] // _BLOCK
        blocks[index] = self._draw(m)
      for b in [b for b in blocks if b < first]:
        del blocks[b]
      columns.append([np.concatenate([blocks[b][i] for b in range(first, last + 1)])[offset:offset + size]
                      for i in (0, 1)])
    return (np.stack([c[0] for c in columns], axis=1), np.stack([c[1] for c in columns], axis=1))


class _Record:
  """Growing records of updates, contributions and gradient events (compact typed arrays)."""

  def __init__(self, num_workers: int):
    self.num_workers = num_workers
    self.time = array.array("d")
    self.cu = array.array("q")   # contribution: update (unused when single)
    self.cw = array.array("q")   # contribution: worker
    self.cv = array.array("q")   # contribution: read version
    self.cb: Any = None          # contribution: num_batches (None: all 1)
    self.ew = array.array("q")   # event: worker
    self.ert = array.array("d")  # event: read time
    self.eet = array.array("d")  # event: end time
    self.eu = array.array("q")   # event: update (-1 dropped, -2 in flight)
    self.ev = array.array("q")   # event: read version
    self.single = False
    self.wait = [0.0] * num_workers
    self.extras: dict[str, Any] = {}

  def in_flight(self, heap: list[tuple[float, int]], read_time: list[float], read_version: list[int]) -> None:
    for t, m in heap:
      self.ew.append(m)
      self.ert.append(read_time[m])
      self.eet.append(t)
      self.eu.append(-2)
      self.ev.append(read_version[m])

  def single_pushes(self, heap: list[tuple[float, int]], read_time: list[float], read_version: list[int]) -> None:
    """Completes a record in which every update is one push (ASP, SSP, PSP, DSSP).

    Such loops record only the contributions and each push's read time (in
    ``ert``); the applied events are the contributions themselves, put in
    front of the events still in flight when the schedule is built.
    """
    self.single = True
    self.in_flight(heap, read_time, read_version)

  def rounds(self, start: np.ndarray, end: np.ndarray, duration: np.ndarray, contributes: np.ndarray) -> None:
    """Records rounds in which every worker reads version ``r`` at ``start[r]`` and computes for
    ``duration[r]``; update ``r`` is applied at ``end[r]`` with the ``contributes[r]`` gradients; the
    others are cancelled then (K-sync and its kin)."""
    num_updates, num = contributes.shape
    push_time = start[:, None] + duration
    updates = np.arange(num_updates)
    self.time = end  # type: ignore[assignment]
    cu, cw = np.nonzero(contributes)
    self.cu, self.cw, self.cv = cu, cw, cu  # type: ignore[assignment]
    self.ew = np.broadcast_to(np.arange(num), (num_updates, num)).ravel()  # type: ignore[assignment]
    self.ert = np.repeat(start, num)  # type: ignore[assignment]
    self.eet = np.where(contributes, push_time, end[:, None]).ravel()  # type: ignore[assignment]
    self.eu = np.where(contributes, updates[:, None], -1).ravel()  # type: ignore[assignment]
    self.ev = np.repeat(updates, num)  # type: ignore[assignment]
    self.wait = np.where(contributes, end[:, None] - push_time, 0.0).sum(axis=0)  # type: ignore[assignment]

  def blocked_until(self, since: dict[int, float], t_end: float) -> None:
    for m, t in since.items():
      self.wait[m] += t_end - t

  def schedule(self, paradigm: str, record_events: bool = True) -> Schedule:
    num = self.num_workers
    time = _array(self.time, np.float64)
    num_updates = time.shape[0]
    cw, cv = _array(self.cw, np.int64), _array(self.cv, np.int64)
    cb = None if self.cb is None else _array(self.cb, np.int64)
    ew, ert = _array(self.ew, np.int64), _array(self.ert, np.float64)
    eet, eu, ev = _array(self.eet, np.float64), _array(self.eu, np.int64), _array(self.ev, np.int64)
    t_end = float(time[-1])

    def seconds(end: np.ndarray, read: np.ndarray) -> np.ndarray:
      return np.clip(np.minimum(end, t_end) - read, 0.0, None)

    if self.single:
      offsets = np.arange(num_updates + 1, dtype=np.int64)
      # The applied events are the contributions; the in-flight ones (at most one per worker) follow
      # them, so adding the two parts' sums adds in the order of one pass over all events.
      busy = np.bincount(cw, weights=seconds(time, ert[:num_updates]), minlength=num)
      busy += np.bincount(ew, weights=seconds(eet, ert[num_updates:]), minlength=num)
      dropped = np.zeros(num, np.int64)
      if record_events:
        ew, eet, ev = np.concatenate([cw, ew]), np.concatenate([time, eet]), np.concatenate([cv, ev])
        eu = np.concatenate([np.arange(num_updates, dtype=np.int64), eu])
    else:
      cu = _array(self.cu, np.int64)
      # Contributions sorted by update, then worker (the order of np.nonzero on the dense view).
      if cu.shape[0] > 1 and not np.all((cu[1:] > cu[:-1]) | ((cu[1:] == cu[:-1]) & (cw[1:] > cw[:-1]))):
        order = np.lexsort((cw, cu))
        cu, cw, cv = cu[order], cw[order], cv[order]
        cb = None if cb is None else cb[order]
      offsets = np.concatenate([[0], np.cumsum(np.bincount(cu, minlength=num_updates))]).astype(np.int64)
      busy = np.bincount(ew, weights=seconds(eet, ert), minlength=num)
      dropped = np.bincount(ew[eu == -1], minlength=num).astype(np.int64)
    extras = {k: np.asarray(v) for k, v in self.extras.items()}
    if record_events:
      # Sorted by worker, keeping time order (a radix sort when the worker fits in 16 bits).
      order = np.argsort(ew.astype(np.int16) if num <= np.iinfo(np.int16).max else ew, kind="stable")
      extras = {"event_worker": ew[order], "event_read_time": ert[order], "event_end_time": eet[order],
                "event_update": eu[order], "event_read_version": ev[order], **extras}
    del ew, ert, eet, eu, ev
    return Schedule.from_contributions(
        time, offsets, cw, cv, np.asarray(self.wait, np.float64), num_workers=num,
        num_batches=None if cb is None or np.all(cb == 1) else cb, dropped=dropped, busy=busy,
        paradigm=paradigm, extras=extras)


def _array(values: Any, dtype: Any) -> np.ndarray:
  """A NumPy view of a typed ``array.array`` (no copy), or the array a vectorized engine stored."""
  if isinstance(values, array.array):
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype)
  return np.asarray(values, dtype=dtype)


def _start(times: _Times, num: int) -> tuple[list[tuple[float, int]], list[float], list[int]]:
  heap = [(times.take(m, 0.0), m) for m in range(num)]
  heapq.heapify(heap)
  return heap, [0.0] * num, [0] * num


def _run_asp(workers: Workers, times: _Times, num_updates: int) -> _Record:
  """ASP: every push is one update and the pusher reads the new version at once."""
  num = workers.num_workers
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  T, cw, cv = rec.time, rec.cw, rec.cv
  ert = rec.ert
  take, replace = times.take, heapq.heapreplace
  # Without windows, a duration is read from the worker's current block here (``take`` draws the next).
  total, used = (None, None) if times.windows else (times.total, times.used)
  for u in range(num_updates - 1):
    # The pusher is the heap's top; it is replaced by its next push (one sift, not a pop and a push).
    t, m = heap[0]
    T.append(t)
    cw.append(m)
    cv.append(rv[m])
    ert.append(rt[m])
    rv[m] = u + 1
    rt[m] = t
    if used is not None and used[m] % _BLOCK:
      j = used[m]
      used[m] = j + 1
      replace(heap, (t + total[m][j % _BLOCK], m))
    else:
      replace(heap, (t + take(m, t), m))
  t, m = heapq.heappop(heap)
  T.append(t)
  cw.append(m)
  cv.append(rv[m])
  ert.append(rt[m])
  rec.single_pushes(heap, rt, rv)
  return rec


def _budget_holds(readers: dict[int, int], applied: int, next_update: int, budget: int) -> bool:
  """Whether the gradients not yet applied, less one read at ``applied``, can all be applied within
  ``budget`` from update ``next_update`` on, oldest first: the ``i``-th oldest (from 0) at
  ``next_update + i`` needs its version ``>= next_update + i - budget``."""
  before = 0
  for version in sorted(readers):
    count = readers[version] - (version == applied)
    if count and version < next_update + before + count - 1 - budget:
      return False
    before += count
  return True


def _run_version_budget(workers: Workers, times: _Times, num_updates: int, budget: int) -> _Record:
  """Admission by version (``VersionBudget``): the oldest-read arrived push first, each within the budget.

  A push may wait between its arrival and its update, so the record keeps
  each gradient's event (its arrival, not its update, ends the worker's
  computing) rather than ASP's one-push-per-update shortcut.
  """
  num = workers.num_workers
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  pending: list[tuple[int, int]] = []  # arrived pushes waiting: (read version, worker)
  pushed_at = [0.0] * num
  # How many unapplied gradients (one per worker) read each version (at most M versions).
  readers: dict[int, int] = {0: num}
  lowest = 0  # no unapplied gradient read an older version
  u = 0
  while u < num_updates:
    t, m = heapq.heappop(heap)
    pushed_at[m] = t
    heapq.heappush(pending, (rv[m], m))
    while pending and u < num_updates:
      v, c = pending[0]
      if readers.get(0, 0) > 1:
        # Only the first reads share a version; while they last, every pending version is tested.
        fits = _budget_holds(readers, v, u + 1, budget)
      else:
        # Distinct versions: the i-th oldest is at least i newer than the oldest, so the oldest other decides.
        while lowest not in readers:
          lowest += 1
        oldest = lowest
        if oldest == v:
          oldest += 1
          while oldest not in readers and oldest <= u:
            oldest += 1
        fits = oldest >= u + 1 - budget
      if not fits:
        break  # another gradient would fall out of the budget: wait for it
      heapq.heappop(pending)
      rec.time.append(t)
      rec.cu.append(u)
      rec.cw.append(c)
      rec.cv.append(v)
      for field, value in ((rec.ew, c), (rec.ert, rt[c]), (rec.eet, pushed_at[c]), (rec.eu, u), (rec.ev, v)):
        field.append(value)
      rec.wait[c] += t - pushed_at[c]
      readers[v] -= 1
      if not readers[v]:
        del readers[v]
      u += 1
      if u < num_updates:
        rv[c], rt[c] = u, t
        readers[u] = readers.get(u, 0) + 1
        heapq.heappush(heap, (t + times.take(c, t), c))
  # Arrived pushes still waiting at the end count as in flight, ending when they arrived; the rest of their
  # wait lies past the end.
  for _, w in pending:
    rec.wait[w] += rec.time[-1] - pushed_at[w]
  rec.in_flight(heap + [(pushed_at[w], w) for _, w in pending], rt, rv)
  return rec

def _run_psp(workers: Workers, times: _Times, num_updates: int, sample_size: int, staleness: int,
             rng: np.random.Generator) -> _Record:
  """PSP: SSP with the barrier evaluated on a fresh random sample of workers after each push."""
  num = workers.num_workers
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  clock = [0] * num
  everyone = list(range(num))
  samples: list[list[int]] = []
  blocked: dict[int, list[int]] = {}   # worker -> the sample it waits on
  since: dict[int, float] = {}
  for u in range(num_updates):
    t, m = pop(heap)
    v = rv[m]
    rec.time.append(t)
    rec.cw.append(m)
    rec.cv.append(v)
    rec.ert.append(rt[m])
    clock[m] += 1
    if u + 1 == num_updates:
      since[m] = t
      break
    for w in [w for w, sample in blocked.items() if m in sample]:
      if min(clock[x] for x in blocked[w]) >= clock[w] - staleness:
        del blocked[w]
        rec.wait[w] += t - since.pop(w)
        rv[w] = u + 1
        rt[w] = t
        push(heap, (t + take(w, t), w))
    if sample_size == num:
      sample = everyone
    else:
      if not samples:
        samples = np.argsort(rng.random((_BLOCK, num)), axis=1)[:, :sample_size].tolist()
        samples.reverse()
      sample = samples.pop()
    if min(clock[x] for x in sample) >= clock[m] - staleness:
      rv[m] = u + 1
      rt[m] = t
      push(heap, (t + take(m, t), m))
    else:
      blocked[m] = sample
      since[m] = t
  rec.single_pushes(heap, rt, rv)
  rec.blocked_until(since, rec.time[-1])
  return rec


def _dssp_extra_iterations(t: float, delta_fast: float, t_slow: float, delta_slow: float,
                           max_extra: int, horizon: int) -> int:
  """The controller: ``i`` in 0..max_extra whose predicted push best meets a predicted push of the slowest."""
  best_i, best = 0, math.inf
  for i in range(max_extra + 1):
    t_fast = t + i * delta_fast
    if delta_slow > 0:
      j = min(max(round((t_fast - t_slow) / delta_slow), 1), horizon)
      dist = min(abs(t_fast - t_slow - jj * delta_slow) for jj in {max(j - 1, 1), j, min(j + 1, horizon)})
    else:
      dist = abs(t_fast - t_slow)
    if dist < best:
      best_i, best = i, dist
  return best_i


def _run_dssp(workers: Workers, times: _Times, num_updates: int, s_lower: int, s_upper: int) -> _Record:
  """DSSP (see ``DSSP``): SSP at ``s_lower`` with controller-granted extra iterations up to ``s_upper``.

  With ``s_lower == s_upper`` the controller can grant nothing, and this is SSP.
  """
  num = workers.num_workers
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  T, cw, cv = rec.time, rec.cw, rec.cv
  ert = rec.ert
  wait = rec.wait
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  clock = [0] * num
  num_at = [num, 0]
  min_clock = max_clock = 0
  blocked: dict[int, list[int]] = {}
  since: dict[int, float] = {}
  grant = [0] * num          # r_p: extra iterations left without a check
  held = [s_lower] * num     # the threshold in force for worker p's grant
  last = [0.0] * num
  before_last = [0.0] * num
  threshold: list[int] = []
  r_max = s_upper - s_lower
  for u in range(num_updates):
    t, m = pop(heap)
    v = rv[m]
    T.append(t)
    cw.append(m)
    cv.append(v)
    ert.append(rt[m])
    c = clock[m] + 1
    clock[m] = c
    if c + 1 > len(num_at):
      num_at.append(0)
    num_at[c - 1] -= 1
    num_at[c] += 1
    if c > max_clock:
      max_clock = c
    before_last[m] = last[m]
    last[m] = t
    if c - 1 == min_clock and num_at[c - 1] == 0:
      min_clock += 1
      if u + 1 < num_updates:
        for w in blocked.pop(min_clock + s_lower, ()):
          wait[w] += t - since.pop(w)
          rv[w] = u + 1
          rt[w] = t
          push(heap, (t + take(w, t), w))
    gap = c - min_clock
    if grant[m] > 0:
      grant[m] -= 1
      go, thr = True, held[m]
    elif gap <= s_lower:
      go, thr = True, s_lower
    elif c == max_clock and r_max > 0:
      slow = clock.index(min_clock)
      delta_slow = last[slow] - before_last[slow]
      if delta_slow <= 0:
        delta_slow = t - last[slow]
      extra = _dssp_extra_iterations(t, last[m] - before_last[m], last[slow], delta_slow,
                                     min(r_max, s_upper - gap + 1), r_max + 1)
      if extra > 0:
        grant[m] = extra - 1
        thr = held[m] = gap - 1 + extra
        go = True
      else:
        go, thr = False, s_lower
    else:
      go, thr = False, s_lower
    threshold.append(thr)
    if u + 1 == num_updates:
      since[m] = t
      break
    if go:
      rv[m] = u + 1
      rt[m] = t
      push(heap, (t + take(m, t), m))
    else:
      blocked.setdefault(c, []).append(m)
      since[m] = t
  rec.extras["threshold"] = np.asarray(threshold, np.int64)
  rec.single_pushes(heap, rt, rv)
  rec.blocked_until(since, T[-1])
  return rec


def _run_aggregate(workers: Workers, times: _Times, num_updates: int, count: int, wait_for_update: bool,
                   ) -> _Record:
  """Every ``count`` pushes form one update (softsync, K-batch-async; K-async when ``wait_for_update``).

  Without ``wait_for_update`` a pusher reads at once, and a worker whose
  earlier contribution to the pending update has another read version holds
  its push until that update is applied (see ``KBatchAsync``).
  """
  num = workers.num_workers
  rec = _Record(num)
  rec.cb = array.array("q")
  heap, rt, rv = _start(times, num)
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  pending_version = [-1] * num   # read version of each worker's contribution to the pending update
  pending_batches = [0] * num
  pending: list[int] = []        # workers in the pending update, in order of first push
  waiting: list[int] = []        # K-async: pushers waiting for the update
  held: list[tuple[int, float]] = []   # (worker, push time) held for the next update
  since: dict[int, float] = {}
  pushed = 0
  u = 0

  def read(w: int, t: float) -> None:
    rv[w] = u
    rt[w] = t
    push(heap, (t + take(w, t), w))

  def accept(w: int, t_push: float, t: float) -> bool:
    """Adds worker w's gradient (pushed at t_push) to the pending update at t; True if that applied it."""
    nonlocal pushed, u, pending
    if pending_version[w] < 0:
      pending.append(w)
      pending_version[w] = rv[w]
    pending_batches[w] += 1
    rec.ew.append(w)
    rec.ert.append(rt[w])
    rec.eet.append(t_push)
    rec.eu.append(u)
    rec.ev.append(rv[w])
    pushed += 1
    if pushed < count:
      return False
    rec.time.append(t)
    for p in pending:
      rec.cu.append(u)
      rec.cw.append(p)
      rec.cv.append(pending_version[p])
      rec.cb.append(pending_batches[p])  # type: ignore[union-attr]
      pending_version[p] = -1
      pending_batches[p] = 0
    pending = []
    pushed = 0
    u += 1
    return True

  while u < num_updates:
    t, m = pop(heap)
    if 0 <= pending_version[m] != rv[m]:
      held.append((m, t))
      since[m] = t
      continue
    applied = accept(m, t, t)
    if u == num_updates:
      since[m] = t
      break
    if wait_for_update:
      if applied:
        for w in waiting:
          rec.wait[w] += t - since.pop(w)
          read(w, t)
        waiting = []
        read(m, t)
      else:
        waiting.append(m)
        since[m] = t
      continue
    read(m, t)
    if applied and held:
      releasing, held = held, []
      for i, (w, t_push) in enumerate(releasing):
        rec.wait[w] += t - since.pop(w)
        accept(w, t_push, t)
        if u == num_updates:
          since[w] = t
          held = releasing[i + 1:]
          break
        read(w, t)
  rec.in_flight(heap, rt, rv)
  for w, t_push in held:
    rec.ew.append(w)
    rec.ert.append(rt[w])
    rec.eet.append(t_push)
    rec.eu.append(-2)
    rec.ev.append(rv[w])
  rec.blocked_until(since, rec.time[-1])
  return rec


def _run_backup(workers: Workers, times: _Times, num_updates: int, b: int) -> _Record:
  """Backup workers (see ``BackupWorkers``): the first ``M - b`` fresh gradients form each update."""
  num = workers.num_workers
  needed = num - b
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  waiting: list[int] = []
  since: dict[int, float] = {}
  # Bound once: these run for every gradient.
  ew, ert, eet, ev, eu = rec.ew.append, rec.ert.append, rec.eet.append, rec.ev.append, rec.eu.append
  cu, cw, cv = rec.cu.append, rec.cw.append, rec.cv.append
  u = 0
  while u < num_updates:
    t, m = pop(heap)
    ew(m)
    ert(rt[m])
    eet(t)
    ev(rv[m])
    if rv[m] != u:
      eu(-1)
      rv[m] = u
      rt[m] = t
      push(heap, (t + take(m, t), m))
      continue
    eu(u)
    cu(u)
    cw(m)
    cv(u)
    if len(waiting) + 1 < needed:
      waiting.append(m)
      since[m] = t
      continue
    rec.time.append(t)
    u += 1
    if u == num_updates:
      since[m] = t
      break
    for w in waiting + [m]:
      if w != m:
        rec.wait[w] += t - since.pop(w)
      rv[w] = u
      rt[w] = t
      push(heap, (t + take(w, t), w))
    waiting = []
  rec.in_flight(heap, rt, rv)
  rec.blocked_until(since, rec.time[-1])
  return rec


def _zipline(t0: float, interval: list[float], lookahead: int) -> list[int]:
  """ElasticBSP's choice of iterations per worker (see ``ElasticBSP``).

  One pass over the ``M R`` predicted end times, sorted: for each right end,
  the left end moves as far as the window still holds a point of every
  worker; the narrowest window (then the earliest) wins.
  """
  num = len(interval)
  points = sorted((t0 + k * interval[p], p) for p in range(num) for k in range(1, lookahead + 1))
  count = [0] * num
  covered = left = 0
  best = (math.inf, math.inf)
  for t, p in points:
    if count[p] == 0:
      covered += 1
    count[p] += 1
    while covered == num:
      t_left, p_left = points[left]
      if count[p_left] > 1:
        count[p_left] -= 1
        left += 1
        continue
      best = min(best, (t - t_left, t))
      break
  end = best[1]
  return [max(k for k in range(1, lookahead + 1) if k == 1 or t0 + k * interval[p] <= end)
          for p in range(num)]


def _run_elastic(workers: Workers, times: _Times, num_updates: int, lookahead: int) -> _Record:
  """ElasticBSP (see ``ElasticBSP``): ASP within periods of ``k_p`` iterations, a barrier between them."""
  num = workers.num_workers
  rec = _Record(num)
  heap, rt, rv = _start(times, num)
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  left = [1] * num               # iterations each worker has left in this period
  spent = [0.0] * num            # seconds of each worker's finished iterations
  done = [0] * num
  since: dict[int, float] = {}   # workers at the barrier, since when
  period: list[int] = []
  current = 0
  for u in range(num_updates):
    t, m = pop(heap)
    rec.time.append(t)
    rec.cw.append(m)
    rec.cv.append(rv[m])
    rec.ert.append(rt[m])
    period.append(current)
    spent[m] += t - rt[m]
    done[m] += 1
    left[m] -= 1
    if u + 1 == num_updates:
      since[m] = t
      break
    if left[m] > 0:
      rv[m] = u + 1
      rt[m] = t
      push(heap, (t + take(m, t), m))
      continue
    since[m] = t
    if len(since) < num:
      continue
    # The barrier opens: the next period's iterations come from each worker's mean duration.
    left = _zipline(t, [spent[p] / done[p] for p in range(num)], lookahead)
    current += 1
    for w in range(num):
      rec.wait[w] += t - since.pop(w)
      rv[w] = u + 1
      rt[w] = t
      push(heap, (t + take(w, t), w))
  rec.extras["period"] = np.asarray(period, np.int64)
  rec.single_pushes(heap, rt, rv)
  rec.blocked_until(since, rec.time[-1])
  return rec


def _run_cutoff(workers: Workers, times: _Times, num_updates: int, window: int) -> _Record:
  """Predictive cutoff (see ``PredictiveCutoff``): K-sync rounds with ``K`` chosen from past order statistics."""
  num = workers.num_workers
  rec = _Record(num)
  compute, comm = times.rows(0, num_updates)
  # The last rounds' sorted durations, NaN where cut off (then only known to exceed the cut).
  observed = np.full((window, num), np.nan)
  bound = np.zeros(window)
  rates = np.arange(1, num + 1, dtype=np.float64)
  start = np.empty(num_updates)
  end = np.empty(num_updates)
  ks = np.empty(num_updates, np.int64)
  cutoff = np.empty(num_updates)
  contributes = np.zeros((num_updates, num), bool)
  duration = compute + comm
  t = 0.0
  for r in range(num_updates):
    if workers.windows:
      duration[r] = compute[r] * _window_factors(workers, t) + comm[r]
    if r == 0:
      k, c = num, math.inf
    else:
      recent = observed[:min(r, window)]
      seen = ~np.isnan(recent)
      count = seen.sum(axis=0)
      # Never seen in the window: only the largest cut is known, an optimistic guess that makes it tried.
      predicted = np.where(count > 0, np.where(seen, recent, 0.0).sum(axis=0) / np.maximum(count, 1),
                           bound[:min(r, window)].max())
      with np.errstate(divide="ignore"):
        speed = rates / predicted
      k = int(np.argmax(speed)) + 1
      c = float(predicted[k - 1])
    order = np.argsort(duration[r], kind="stable")
    contributes[r, order[:k]] = True
    ordered = duration[r, order]
    cut = float(ordered[k - 1])
    observed[r % window] = np.where(np.arange(num) < k, ordered, np.nan)
    bound[r % window] = cut
    start[r], ks[r], cutoff[r] = t, k, c
    t += cut
    end[r] = t
  rec.rounds(start, end, duration, contributes)
  rec.extras["k"] = ks
  rec.extras["cutoff"] = cutoff
  return rec


def _run_pisces(workers: Workers, times: _Times, num_updates: int, paradigm: P.Pisces,
                rng: np.random.Generator) -> _Record:
  """Pisces (see ``Pisces``): selected clients train, push into a buffer, and the buffer is applied by the pace."""
  num = workers.num_workers
  rec = _Record(num)
  take, pop, push = times.take, heapq.heappop, heapq.heappush
  utility = [1.0] * num if paradigm.utility is None else list(paradigm.utility)
  bound, every = paradigm.bound, paradigm.aggregate_every
  heap: list[tuple[float, int]] = []
  rt, rv = [0.0] * num, [0] * num
  running: set[int] = set()
  buffer: list[int] = []                 # buffered clients, in push order
  buffered = [False] * num
  push_time = [0.0] * num
  latency: list[float | None] = [None] * num
  longest = 0.0                          # the largest latency measured so far
  history: list[list[int]] = [[] for _ in range(num)]   # each client's last `window` staleness values
  score = np.array(utility, np.float64)  # utility / (mean of history + 1) ** beta, updated when history is
  since = {m: 0.0 for m in range(num)}   # idle since (not training)
  epsilon = paradigm.explore
  t_last = 0.0
  u = 0

  def select(t: float) -> None:
    nonlocal epsilon
    idle = [m for m in range(num) if m not in running and not buffered[m]]
    n = min(paradigm.concurrency - len(running), len(idle))
    if n <= 0:
      return
    if paradigm.selection == "random":
      chosen = [int(m) for m in rng.choice(idle, n, replace=False)]
    else:
      unexplored = [m for m in idle if latency[m] is None]
      explored = [m for m in idle if latency[m] is not None]
      planned = min(len(unexplored), int(rng.binomial(n, epsilon)))
      epsilon = max(epsilon * paradigm.explore_decay, paradigm.min_explore)
      n_exploit = min(len(explored), n - planned)
      n_explore = min(len(unexplored), n - n_exploit)
      shuffled = np.asarray(explored, np.int64)[rng.permutation(len(explored))]
      # A stable sort of the shuffled clients by decreasing score: ties keep the permutation's order.
      chosen = [int(m) for m in shuffled[np.argsort(-score[shuffled], kind="stable")[:n_exploit]]]
      if n_explore:
        chosen += [int(m) for m in rng.choice(unexplored, n_explore, replace=False)]
    for m in chosen:
      rec.wait[m] += t - since.pop(m)
      running.add(m)
      rv[m], rt[m] = u, t
      push(heap, (t + take(m, t), m))

  def interval() -> float:
    if not running:
      return 0.0
    return max(longest if latency[m] is None else latency[m] for m in running) / bound  # type: ignore[type-var]

  def due(t: float) -> bool:
    if not buffer:
      return False
    if every is not None:
      return len(buffer) >= every
    return t - t_last >= interval()

  def apply(t: float) -> None:
    nonlocal u, t_last, buffer
    rec.time.append(t)
    for m in sorted(buffer):
      tau = u - rv[m]
      rec.cu.append(u)
      rec.cw.append(m)
      rec.cv.append(rv[m])
      rec.ew.append(m)
      rec.ert.append(rt[m])
      rec.eet.append(push_time[m])
      rec.eu.append(u)
      rec.ev.append(rv[m])
      history[m] = (history[m] + [tau])[-paradigm.window:]
      score[m] = utility[m] / (sum(history[m]) / len(history[m]) + 1.0) ** paradigm.beta
      buffered[m] = False
    buffer = []
    t_last = t
    u += 1

  def settle(t: float, pace_due: bool = False) -> None:
    if pace_due or due(t):
      apply(t)
      if u == num_updates:
        return
    select(t)

  settle(0.0)
  while u < num_updates:
    t_push = heap[0][0] if heap else math.inf
    if every is None and buffer:
      t_due = t_last + interval()
      if t_due <= t_push:
        # The pace falls due between pushes (the running set, hence I, is constant until the next push); told,
        # not re-tested, since (t_last + I) - t_last may round below I.
        settle(t_due, pace_due=True)
        continue
    if not heap:
      raise AssertionError("pisces: no client is training and the buffer is empty")  # unreachable: C >= 1
    t, m = pop(heap)
    running.discard(m)
    latency[m] = t - rt[m]
    longest = max(longest, latency[m])  # type: ignore[type-var]
    push_time[m] = t
    buffer.append(m)
    buffered[m] = True
    since[m] = t
    settle(t)
  rec.in_flight(heap, rt, rv)
  for m in buffer:
    rec.ew.append(m)
    rec.ert.append(rt[m])
    rec.eet.append(push_time[m])
    rec.eu.append(-2)
    rec.ev.append(rv[m])
  rec.blocked_until(since, rec.time[-1])
  return rec


class Simulation:
  """A resumable simulation that hands out its schedule in chunks (for feedback-driven paradigms).

  ``run(n)`` simulates the next ``n`` updates and returns them as a
  :class:`Schedule` whose updates and versions count from the start of the
  chunk (and whose times continue the simulated clock); ``concatenate`` joins
  chunks into the schedule of the whole run. When no feedback changes the
  paradigm, its times, contributions, versions and events are identical to
  those of one ``simulate(...)`` call with the same seed (``wait`` and
  ``busy`` are summed per chunk, so they agree up to float rounding).
  ``feedback(loss)`` reports the current training loss (used by ``adasync``
  to raise ``K``; ignored by the others).

  Only round-synchronous paradigms (``bsp``, ``k_sync``, ``k_batch_sync``,
  ``adasync``) can be cut into chunks: in them every update uses gradients
  read during its own round, so a chunk is a complete schedule.

  Example::

    >>> import delayjax as dj
    >>> sim = dj.cluster.Simulation(dj.cluster.adasync(2), dj.cluster.workers(8), seed=0)
    >>> first = sim.run(100)
    >>> sim.feedback(2.0); sim.feedback(0.5)   # F(w0) = 2, now 0.5: K = ceil(2 * 2) = 4
    >>> sim.k
    4
    >>> whole = dj.cluster.concatenate([first, sim.run(100)])
  """

  def __init__(self, paradigm: P.Paradigm, workers: Workers, seed: int = 0):
    _check_inputs(paradigm, workers, seed)
    if not isinstance(paradigm, _ROUND_PARADIGMS):
      raise TypeError(
          f"paradigm must be one of bsp(), k_sync(k), k_batch_sync(k), adasync(k0) to run in chunks, got "
          f"{paradigm}; use simulate(...) for the others (their updates use gradients read earlier).")
    self.paradigm = paradigm
    self.workers = workers
    time_seq, _ = _seed_sequences(seed, workers)
    self._times = _Times(workers, time_seq)
    self._now = 0.0
    self._round = 0
    self._loss0: float | None = None
    num = workers.num_workers
    if isinstance(paradigm, P.BSP):
      self._k = num
    elif isinstance(paradigm, P.AdaSync):
      self._k = paradigm.k0
    else:
      self._k = paradigm.k  # type: ignore[attr-defined]

  @property
  def k(self) -> int:
    """The ``K`` the next chunk uses (``M`` for BSP)."""
    return self._k

  def feedback(self, loss: float) -> None:
    """Reports the training loss ``F(w_t)``: the first call sets ``F(w_0)``."""
    loss = check_float("loss", loss, minimum=0.0, strict_minimum=True)
    if not isinstance(self.paradigm, P.AdaSync):
      return
    if self._loss0 is None:
      self._loss0 = loss
      return
    k = math.ceil(math.sqrt(self._loss0 / loss) * self.paradigm.k0)
    self._k = min(max(k, 1), self.workers.num_workers)

  def run(self, num_updates: int) -> Schedule:
    """Simulates the next ``num_updates`` updates and returns them as a chunk."""
    num_updates = check_int("num_updates", num_updates, minimum=1)
    check_record_fits(self.paradigm, self.workers, num_updates, True)
    return self._record(num_updates).schedule(str(self.paradigm))

  def _record(self, num_updates: int) -> _Record:
    if isinstance(self.paradigm, P.KBatchSync):
      return self._run_batch_rounds(num_updates)
    return self._run_rounds(num_updates)

  def _run_rounds(self, num_updates: int) -> _Record:
    num, k = self.workers.num_workers, self._k
    rec = _Record(num)
    compute, comm = self._times.rows(self._round, num_updates)
    if self.workers.windows:
      duration = np.empty_like(compute)
      t = self._now
      for r in range(num_updates):
        duration[r] = compute[r] * _window_factors(self.workers, t) + comm[r]
        t += np.sort(duration[r], kind="stable")[k - 1]
    else:
      duration = compute + comm
    order = np.argsort(duration, axis=1, kind="stable")
    kth = np.take_along_axis(duration, order[:, k - 1:k], axis=1)[:, 0]
    # Sequential sums from the current time, so chunks add up exactly like one long run.
    clock = np.cumsum(np.concatenate([[self._now], kth]))
    start, end = clock[:-1], clock[1:]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(num), order.shape), axis=1)
    contributes = rank < k
    rec.rounds(start, end, duration, contributes)
    if isinstance(self.paradigm, P.AdaSync):
      rec.extras["k"] = np.full(num_updates, k, np.int64)
    self._now = float(end[-1])
    self._round += num_updates
    return rec

  def _run_batch_rounds(self, num_updates: int) -> _Record:
    num, k = self.workers.num_workers, self._k
    rec = _Record(num)
    rec.cb = array.array("q")
    take, pop, push = self._times.take, heapq.heappop, heapq.heappush
    t = self._now
    for r in range(num_updates):
      t0 = t
      heap = [(t0 + take(m, t0), m) for m in range(num)]
      heapq.heapify(heap)
      started = [t0] * num
      batches = [0] * num
      for i in range(k):
        t, m = pop(heap)
        batches[m] += 1
        rec.ew.append(m)
        rec.ert.append(started[m])
        rec.eet.append(t)
        rec.eu.append(r)
        rec.ev.append(r)
        if i + 1 < k:
          started[m] = t
          push(heap, (t + take(m, t), m))
      for _, m in heap:
        rec.ew.append(m)
        rec.ert.append(started[m])
        rec.eet.append(t)
        rec.eu.append(-1)
        rec.ev.append(r)
      rec.time.append(t)
      for m in range(num):
        if batches[m]:
          rec.cu.append(r)
          rec.cw.append(m)
          rec.cv.append(r)
          rec.cb.append(batches[m])
    self._now = t
    self._round += num_updates
    return rec


def _recorded_per_update(paradigm: P.Paradigm, num_workers: int) -> tuple[int, int]:
  """The fewest (contributions, gradient events) ``simulate`` records per update of ``paradigm``."""
  m = num_workers
  if isinstance(paradigm, P.BSP):
    return m, m
  if isinstance(paradigm, P.KSync):
    return paradigm.k, m  # every worker reads each round; the slow ones are cancelled
  if isinstance(paradigm, (P.AdaSync, P.PredictiveCutoff)):
    return 1, m
  if isinstance(paradigm, P.KAsync):
    return paradigm.k, paradigm.k  # a pusher waits for the update: k distinct workers
  if isinstance(paradigm, (P.KBatchAsync, P.KBatchSync)):
    return 1, paradigm.k  # one fast worker may push all k minibatches
  if isinstance(paradigm, P.GBA):
    return 1, paradigm.global_batch
  if isinstance(paradigm, P.SoftSync):
    return 1, max(m // paradigm.n, 1)
  if isinstance(paradigm, P.BackupWorkers):
    return m - paradigm.b, m - paradigm.b
  return 1, 1


def record_bytes_per_update(paradigm: P.Paradigm, num_workers: int, record_events: bool) -> int:
  """A lower bound on the bytes a schedule of ``paradigm`` records per update.

  The record grows with the gradients: per update its time and offset (16
  bytes), per contribution its worker and version (16 bytes) and, with
  ``record_events``, per gradient event its five fields (40 bytes), each in
  the fewest the paradigm records per update. The schedule's arrays are also
  copied while it is built, and round paradigms draw dense
  ``[updates, workers]`` tables, so a run needs more than this, about twice.
  """
  contributions, events = _recorded_per_update(paradigm, num_workers)
  return 16 + 16 * contributions + 40 * events * bool(record_events)


def check_record_fits(paradigm: P.Paradigm, workers: Workers, num_updates: int, record_events: bool) -> None:
  """Refuses, before simulating, a ``num_updates`` whose record cannot fit in the available memory.

  The size is :func:`record_bytes_per_update` times ``num_updates``, a lower
  bound: a run refused here could never have finished.
  """
  per_update = record_bytes_per_update(paradigm, workers.num_workers, record_events)
  check_fits(f"num_updates={num_updates} with {paradigm} on {workers.num_workers} workers: its schedule, at "
             f"least {per_update} bytes per update,", per_update * num_updates, available_memory())


def _check_inputs(paradigm: Any, workers: Any, seed: Any) -> None:
  if not isinstance(paradigm, P.Paradigm):
    raise TypeError(f"paradigm must be a paradigm such as dj.cluster.ssp(3), got {paradigm!r}.")
  if not isinstance(workers, Workers):
    raise TypeError(f"workers must be built with dj.cluster.workers(...), got {workers!r}.")
  check_seed("seed", seed)
  paradigm.check(workers.num_workers)


def _seed_sequences(seed: int, workers: Workers) -> list[np.random.SeedSequence]:
  entropy = seed if workers.seed is None else [seed, workers.seed]
  return np.random.SeedSequence(entropy).spawn(2)


def simulate(paradigm: P.Paradigm, workers: Workers, num_updates: int, seed: int = 0, *,
             record_events: bool = True) -> Schedule:
  """Simulates ``num_updates`` updates of ``paradigm`` on ``workers`` and returns the :class:`Schedule`.

  Args:
    paradigm: a synchronization paradigm, e.g. ``dj.cluster.ssp(3)``.
    workers: the cluster, from ``dj.cluster.workers(...)``.
    num_updates: ``U >= 1``; one whose record cannot fit in the available
      memory is refused before anything is simulated (see
      :func:`check_record_fits`).
    seed: the same seed gives a bit-identical schedule.
    record_events: keep the per-gradient events in ``extras`` (40 bytes per
      gradient); ``False`` keeps only what ``dj.simulate`` needs (the
      contributions, ``time``, ``wait``, ``busy``, ``dropped``), for very long
      runs. A schedule without events cannot be drawn by ``plot_timeline``.

  Returns:
    The schedule, with the per-gradient events described in this module's
    docstring in ``extras`` (and DSSP's ``threshold``, AdaSync's ``k``, ElasticBSP's
    ``period``, the predictive cutoff's ``k`` and ``cutoff``).
    Contributions are stored sparsely: memory and time grow with the number
    of gradients, not with ``num_updates x num_workers``.

  Example::

    >>> import delayjax as dj
    >>> sched = dj.cluster.simulate(dj.cluster.ssp(3), dj.cluster.workers(8), num_updates=1000, seed=0)
    >>> # Each other worker pushes at most 2s + 1 times while one gradient is computed.
    >>> int(sched.staleness.max()) <= (8 - 1) * (2 * 3 + 1)
    True
  """
  _check_inputs(paradigm, workers, seed)
  num_updates = check_int("num_updates", num_updates, minimum=1)
  if not isinstance(record_events, bool):
    raise TypeError(f"record_events must be a bool, got {record_events!r}.")
  check_record_fits(paradigm, workers, num_updates, record_events)
  if isinstance(paradigm, _ROUND_PARADIGMS):
    return Simulation(paradigm, workers, seed)._record(num_updates).schedule(str(paradigm), record_events)
  time_seq, barrier_seq = _seed_sequences(seed, workers)
  times = _Times(workers, time_seq)
  num = workers.num_workers
  if isinstance(paradigm, P.ASP):
    rec = _run_asp(workers, times, num_updates)
  elif isinstance(paradigm, P.SSP):
    rec = _run_dssp(workers, times, num_updates, paradigm.staleness, paradigm.staleness)
    del rec.extras["threshold"]   # always the staleness
  elif isinstance(paradigm, P.PSP):
    rec = _run_psp(workers, times, num_updates, paradigm.sample_size, paradigm.staleness,
                   np.random.default_rng(barrier_seq))
  elif isinstance(paradigm, P.DSSP):
    rec = _run_dssp(workers, times, num_updates, paradigm.s_lower, paradigm.s_upper)
  elif isinstance(paradigm, P.KAsync):
    rec = _run_aggregate(workers, times, num_updates, paradigm.k, wait_for_update=True)
  elif isinstance(paradigm, P.KBatchAsync):
    rec = _run_aggregate(workers, times, num_updates, paradigm.k, wait_for_update=False)
  elif isinstance(paradigm, P.GBA):
    rec = _run_aggregate(workers, times, num_updates, paradigm.global_batch, wait_for_update=False)
  elif isinstance(paradigm, P.SoftSync):
    rec = _run_aggregate(workers, times, num_updates, num // paradigm.n, wait_for_update=False)
  elif isinstance(paradigm, P.BackupWorkers):
    rec = _run_backup(workers, times, num_updates, paradigm.b)
  elif isinstance(paradigm, P.ElasticBSP):
    rec = _run_elastic(workers, times, num_updates, paradigm.lookahead)
  elif isinstance(paradigm, P.PredictiveCutoff):
    rec = _run_cutoff(workers, times, num_updates, paradigm.window)
  elif isinstance(paradigm, P.Pisces):
    rec = _run_pisces(workers, times, num_updates, paradigm, np.random.default_rng(barrier_seq))
  elif isinstance(paradigm, VersionBudget):
    rec = _run_version_budget(workers, times, num_updates, paradigm.max_staleness)
  else:
    raise TypeError(f"paradigm {paradigm!r} is not supported by simulate.")
  return rec.schedule(str(paradigm), record_events)
