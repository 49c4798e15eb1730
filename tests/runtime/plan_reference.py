"""The wave planner of ``dj.simulate`` as it was written first, one contribution at a time in Python.

``delayjax/runtime/_waves.py`` computes the same tables with array operations;
``test_plan_vectorized.py`` asserts that both give identical plans, and
``experiments/bench_planning.py`` times one against the other.
"""

from __future__ import annotations

import heapq

import numpy as np

from delayjax.cluster._schedule import Schedule
from delayjax.runtime._waves import StepPlan

_STEP_COST = 1.0
_CHOICE_UPDATES = 20_000


def _waves(schedule: Schedule, cu: np.ndarray, cm: np.ndarray, cv: np.ndarray,
           first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Greedy waves: cut before an update that needs a version newer than the wave's start,
  or a second gradient from a worker already in the wave."""
  num_updates = schedule.num_updates
  wave_of_update = np.empty(num_updates, np.int64)
  starts = [0]
  last_wave = [-1] * schedule.num_workers
  wave = start = 0
  vs, ms, bounds = cv.tolist(), cm.tolist(), first.tolist()
  for u in range(num_updates):
    lo, hi = bounds[u], bounds[u + 1]
    if u > start and any(vs[c] > start or last_wave[ms[c]] == wave for c in range(lo, hi)):
      wave += 1
      start = u
      starts.append(u)
    for c in range(lo, hi):
      last_wave[ms[c]] = wave
    wave_of_update[u] = wave
  return wave_of_update, np.asarray(starts + [num_updates], np.int64)


def _schedule_steps(cu: np.ndarray, cv: np.ndarray, ready: np.ndarray, device: np.ndarray, num_devices: int,
                    lanes: int, per_update: np.ndarray, rank: np.ndarray, order: np.ndarray, num_slots: int | None,
                    after: np.ndarray | None = None):
  """Assigns every contribution a step and lane, and every update the step that applies it.

  ``cv`` is ``[n, G]``: the version each group of parameter leaves is read at
  (one group unless delays are per leaf); each group's read is stored on its
  own when its version is left behind.

  Steps are built one at a time at the server version ``V`` (updates applied
  so far). Each device computes up to ``lanes`` of the contributions already
  read and ready (``ready``, a version ``>=`` the read version, ``<= V``) and
  not yet computed, earliest update first
  (ties: lowest worker); the step then applies every update from ``V`` on
  whose contributions have all been computed. With ``after`` (per
  contribution, the one that must be computed in an earlier step, or -1: a
  worker's previous contribution when workers carry state from one to the
  next), a contribution waits for it. A contribution computed at its
  own read version reads the server state directly (*fresh*); one whose
  version is about to be left behind, uncomputed, is stored in its worker's
  slot ``rank mod num_slots`` at that version: before the step's updates
  (reads of ``V``) or right after update ``v - 1`` (reads of a version ``v``
  the step passes through).

  Returns ``None`` if a slot would be overwritten before the contribution
  that used it was computed (more slots are needed); without ``num_slots``,
  only the step count matters and slots are not checked. Otherwise returns
  ``compute_step``, ``lane_of`` (within its device), ``compute_version``
  (per contribution), ``apply_step`` (per update), and per step the number
  of reads of its own version and its reads as ``(contribution, group,
  after)`` triples (``after``: the update they follow, ``-1`` for the step's
  own version).
  """
  n, num_updates = cu.size, per_update.size
  prev = np.full(n, -1, np.int64)  # the contribution that used the same slot before
  if num_slots is not None:
    where = np.empty(n, np.int64)
    where[order] = np.arange(n)
    reuse = rank >= num_slots
    prev[reuse] = order[where[reuse] - num_slots]
  groups = cv.shape[1]
  pair_version = cv.reshape(-1)  # pair c * groups + g
  by_read = np.argsort(pair_version, kind="stable")
  read_bounds = np.searchsorted(pair_version[by_read], np.arange(num_updates + 2)).tolist()
  by_ready = np.argsort(ready, kind="stable").tolist()
  ready_l = ready.tolist()
  by_read, cu_l, dev_l, prev_l = by_read.tolist(), cu.tolist(), device.tolist(), prev.tolist()
  after_l = None if after is None else after.tolist()
  remaining = per_update.tolist()
  heaps: list[list[tuple[int, int]]] = [[] for _ in range(num_devices)]
  compute_step = [-1] * n
  lane_of = [0] * n
  compute_version = [0] * n
  apply_step = [0] * num_updates
  read_first_of: list[int] = []
  reads: list[list[tuple[int, int, int]]] = []
  version = released = step = 0
  while version < num_updates:
    # Contributions come sorted by update, then worker: the index orders ties.
    while released < n and ready_l[by_ready[released]] <= version:
      c = by_ready[released]
      heapq.heappush(heaps[dev_l[c]], (cu_l[c], c))
      released += 1
    for heap in heaps:
      lane, waiting = 0, []
      while lane < lanes and heap:
        entry = heapq.heappop(heap)
        c = entry[1]
        if after_l is not None and after_l[c] >= 0 and not 0 <= compute_step[after_l[c]] < step:
          waiting.append(entry)
          continue
        compute_step[c], lane_of[c], compute_version[c] = step, lane, version
        remaining[cu_l[c]] -= 1
        lane += 1
      for entry in waiting:
        heapq.heappush(heap, entry)
    new = version
    while new < num_updates and remaining[new] == 0:
      new += 1
    entries: list[tuple[int, int, int]] = []
    first = 0
    for v in range(version, new):
      for i in range(read_bounds[v], read_bounds[v + 1]):
        c, g = divmod(by_read[i], groups)
        if compute_step[c] >= 0:
          continue
        if prev_l[c] >= 0 and compute_step[prev_l[c]] < 0:
          return None
        entries.append((c, g, -1 if v == version else v - 1))
        first += v == version
    for u in range(version, new):
      apply_step[u] = step
    read_first_of.append(first)
    reads.append(entries)
    version = new
    step += 1
  return (np.asarray(compute_step, np.int64), np.asarray(lane_of, np.int64), np.asarray(compute_version, np.int64),
          np.asarray(apply_step, np.int64), read_first_of, reads)


def _buffer_blocks(compute_step: np.ndarray, cu: np.ndarray, apply_step: np.ndarray,
                   num_steps: int) -> tuple[np.ndarray, int]:
  """Each step's block of the gradient buffer: the lowest one whose gradients have all been applied."""
  # A block is busy from its step through the step applying its last update.
  busy_through = np.arange(num_steps)
  if cu.size:
    np.maximum.at(busy_through, compute_step, apply_step[cu])
  block_of_step = np.zeros(num_steps, np.int64)
  free_after: list[int] = []  # per block: the last step it is busy
  for s, last in enumerate(busy_through.tolist()):
    for b, until in enumerate(free_after):
      if until < s:
        break
    else:
      b = len(free_after)
      free_after.append(0)
    free_after[b] = last
    block_of_step[s] = b
  return block_of_step, max(len(free_after), 1)


def _choose_lanes(cu: np.ndarray, cv: np.ndarray, ready: np.ndarray, device: np.ndarray, num_devices: int,
                  per_device: int, per_update: np.ndarray, after: np.ndarray | None) -> int:
  """The lanes per device that minimize (steps) x (lanes + per-step overhead).

  Every width up to 8 is tried, then widths about 25% apart: each try plans
  the schedule's first ``_CHOICE_UPDATES`` updates (a long schedule's
  beginning stands for the rest; planning all of it once per width would
  cost seconds per 1e5 updates).
  """
  if per_update.size > _CHOICE_UPDATES:
    keep = cu < _CHOICE_UPDATES
    # Contributions are sorted by update: the kept ones are a prefix, and wait only for kept ones.
    cu, cv, ready, device = cu[keep], cv[keep], ready[keep], device[keep]
    after = None if after is None else after[keep]
    per_update = per_update[:_CHOICE_UPDATES]
  candidates = set(range(1, min(per_device, 8) + 1)) | {per_device}
  width = 8.0
  while width < per_device:
    candidates.add(int(round(width)))
    width *= 1.25
  best, best_cost = 1, np.inf
  empty = np.zeros(0, np.int64)
  for lanes in sorted(candidates):
    steps = len(_schedule_steps(cu, cv, ready, device, num_devices, lanes, per_update, empty, empty, None,
                                after)[4])
    cost = steps * (lanes + _STEP_COST)
    if cost < best_cost:
      best, best_cost = lanes, cost
  return best


def plan_steps(schedule: Schedule, num_workers: int, num_devices: int = 1,
               lanes: int | None = None, local_steps: np.ndarray | None = None,
               not_before: np.ndarray | None = None, group_versions: np.ndarray | None = None,
               sequential_workers: bool = False, dense_reads: bool = False) -> StepPlan:
  """Splits ``schedule`` into steps for ``num_workers`` workers on ``num_devices`` devices.

  ``num_workers`` is the schedule's, padded to a multiple of ``num_devices``
  (padding workers never contribute); ``lanes`` is the step width per device
  (default: chosen to minimize computed lanes plus per-step overhead);
  ``local_steps`` (``[num_workers]``, default all 1): each contribution of
  worker ``m`` draws ``num_batches * local_steps[m]`` minibatches, which
  ``lane_draw`` counts; ``not_before`` (``[num_updates]``, default 0): the
  earliest server version at which a contribution to each update may be
  computed, besides its read (e.g. its SVRG epoch's start, so that every
  lane of a step is in the step's epoch and shares its snapshot);
  ``group_versions`` (``[contributions, G]``, in the order of
  ``np.nonzero(schedule.contributes)``; default the schedule's
  ``read_version`` as one group): per-leaf delays, the version each group of
  parameter leaves is read at (``lane_fresh``, ``read_group`` and
  ``upd_staleness`` then have a group axis of size ``G``);
  ``sequential_workers``: a worker's contribution is computed in a later
  step than its previous one (workers that carry state from one to the next).
  ``dense_reads``: also return the reads as ``[steps, most reads of a step]``
  tables padded with worker ``num_workers``, as ``StepPlan.tables`` gives them.
  """
  num_updates = schedule.num_updates
  per_device = num_workers // num_devices
  cu, cm = np.nonzero(schedule.contributes)  # sorted by update, then worker
  if group_versions is None:
    cvg = schedule.read_version[cu, cm][:, None]
  else:
    cvg = np.asarray(group_versions, np.int64).reshape(cu.size, -1)
  # A gradient can be computed once its last group has been read.
  cv = cvg.max(axis=1) if cu.size else np.zeros(0, np.int64)
  cnb = schedule.num_batches[cu, cm]
  n = cu.size
  per_update = np.bincount(cu, minlength=num_updates)
  first = np.concatenate([[0], np.cumsum(per_update)])
  _, starts = _waves(schedule, cu, cm, cv, first)

  # Per-worker order: rank k, minibatches drawn before, slot k mod S.
  order = np.lexsort((cu, cm))
  m_sorted = cm[order]
  group_start = np.zeros(n, np.int64)
  if n:
    new_worker = np.concatenate([[True], m_sorted[1:] != m_sorted[:-1]])
    group_start = np.maximum.accumulate(np.where(new_worker, np.arange(n), 0))
  rank = np.empty(n, np.int64)
  rank[order] = np.arange(n) - group_start
  draws = cnb if local_steps is None else cnb * np.asarray(local_steps, np.int64)[cm]
  draws_sorted = draws[order]
  drawn = np.cumsum(draws_sorted) - draws_sorted
  draw = np.empty(n, np.int64)
  draw[order] = drawn - drawn[group_start] if n else drawn
  device = cm // per_device
  ready = cv if not_before is None else np.maximum(cv, np.asarray(not_before, np.int64)[cu])
  after = None
  if sequential_workers:
    after = np.full(n, -1, np.int64)
    previous = order[:-1][m_sorted[1:] == m_sorted[:-1]] if n else order[:0]
    after[order[1:][m_sorted[1:] == m_sorted[:-1]] if n else order[:0]] = previous
  if lanes is None:
    lanes = _choose_lanes(cu, cvg, ready, device, num_devices, per_device, per_update, after)
  # The fewest slots per worker that the steps never need to overwrite while
  # still in use.
  num_slots = 1
  while (sched := _schedule_steps(cu, cvg, ready, device, num_devices, lanes, per_update, rank, order,
                                  num_slots, after)) is None:
    num_slots += 1
  compute_step, lane_of, compute_version, apply_step, read_first_of, reads = sched
  fresh = cvg == compute_version[:, None]  # [n, G]: the group is read at the compute version
  slot = rank % num_slots
  num_steps = int(apply_step.max()) + 1 if num_updates else 1
  width = lanes * num_devices
  lane = device * lanes + lane_of

  # Each step writes its gradients to a block of `width` rows of the buffer:
  # the lowest block none of whose gradients still waits for its update.
  block_of_step, num_blocks = _buffer_blocks(compute_step, cu, apply_step, num_steps)
  buffer_offset = (block_of_step * width).astype(np.int32)
  pos = buffer_offset[compute_step] + lane if n else np.zeros(0, np.int64)
  buffer_size = num_blocks * width

  shape = (num_steps, width)
  lane_active = np.zeros(shape, bool)
  lane_worker = np.broadcast_to((np.arange(width) // lanes) * per_device, shape).astype(np.int32)
  lane_slot = np.zeros(shape, np.int32)
  lane_fresh = np.zeros(shape + (cvg.shape[1],), bool)
  lane_update = np.zeros(shape, np.int32)
  lane_draw = np.zeros(shape, np.int32)
  lane_batches = np.ones(shape, np.int32)
  lane_active[compute_step, lane] = True
  lane_worker[compute_step, lane] = cm
  lane_slot[compute_step, lane] = slot
  lane_fresh[compute_step, lane] = fresh
  lane_update[compute_step, lane] = cu
  lane_draw[compute_step, lane] = draw
  lane_batches[compute_step, lane] = cnb

  # Updates, in order, each in the step that computes its last gradient (or
  # later, behind an earlier update still waiting).
  upd_count = np.bincount(apply_step, minlength=num_steps).astype(np.int32)
  max_len = max(int(upd_count.max()) if num_updates else 1, 1)
  step_first = np.concatenate([[0], np.cumsum(upd_count)])
  position = np.arange(num_updates) - step_first[apply_step]
  upd_index = np.zeros((num_steps, max_len), np.int32)
  upd_index[apply_step, position] = np.arange(num_updates)
  max_contrib = max(int(per_update.max()) if num_updates else 1, 1)
  kshape = (num_steps, max_len, max_contrib)
  upd_pos = np.zeros(kshape, np.int32)
  upd_worker = np.zeros(kshape, np.int32)
  upd_batches = np.zeros(kshape, np.int32)
  upd_staleness = np.zeros(kshape + (cvg.shape[1],), np.int32)
  staleness = cu[:, None] - cvg  # [n, G]
  # Stalest first (by its stalest group), ties by lowest worker: the first kept entry supplies the
  # update's staleness, stale parameters and worker.
  by_update = np.lexsort((cm, -staleness.max(axis=1, initial=0), cu))
  k = np.arange(n) - first[cu[by_update]]
  rows = (apply_step[cu[by_update]], position[cu[by_update]], k)
  upd_pos[rows] = pos[by_update]
  upd_worker[rows] = cm[by_update]
  upd_batches[rows] = cnb[by_update]
  upd_staleness[rows] = staleness[by_update]

  # Reads through a slot, per step: first those of the step's own version
  # (after its gradients, before its updates), then those of version u + 1
  # right after update u.
  max_reads = max([len(r) for r in reads] + [1])
  read_worker = np.full((num_steps, max_reads), num_workers, np.int32)
  read_slot = np.zeros((num_steps, max_reads), np.int32)
  read_group = np.zeros((num_steps, max_reads), np.int32)
  read_first = np.zeros(num_steps, np.int32)
  read_begin = np.zeros((num_steps, max_len), np.int32)
  read_end = np.zeros((num_steps, max_len), np.int32)
  for s, entries in enumerate(reads):
    read_first[s] = read_first_of[s]
    for i, (c, g, after) in enumerate(entries):
      read_worker[s, i] = cm[c]
      read_slot[s, i] = slot[c]
      read_group[s, i] = g
    if entries:
      afters = np.asarray([a for _, _, a in entries], np.int64)
      us = upd_index[s, :upd_count[s]]
      read_begin[s, :upd_count[s]] = np.searchsorted(afters, us, side="left")
      read_end[s, :upd_count[s]] = np.searchsorted(afters, us, side="right")

  # The plan keeps the reads as one flat list in step order with per-step offsets.
  real = read_worker < num_workers
  plan = StepPlan(
      num_workers=num_workers, num_devices=num_devices, lanes=lanes, num_slots=num_slots,
      buffer_size=buffer_size, starts=starts, lane_active=lane_active,
      lane_worker=lane_worker, lane_slot=lane_slot, lane_fresh=lane_fresh, lane_update=lane_update,
      lane_draw=lane_draw, lane_batches=lane_batches, buffer_offset=buffer_offset, upd_count=upd_count,
      upd_index=upd_index, upd_pos=upd_pos, upd_worker=upd_worker, upd_batches=upd_batches,
      upd_staleness=upd_staleness, read_begin=read_begin, read_end=read_end, read_first=read_first,
      read_worker=read_worker[real], read_slot=read_slot[real], read_group=read_group[real],
      read_start=np.concatenate([[0], np.cumsum(real.sum(axis=1))]), read_width=max_reads)
  if dense_reads:
    return plan, {"read_worker": read_worker, "read_slot": read_slot, "read_group": read_group}
  return plan
