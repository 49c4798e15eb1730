"""Host-side planning of the wave-parallel runtime: which gradients are computed together.

Everything here is NumPy on the host; the device loop in ``_simulate.py``
only follows the tables built here.

A *wave* covers the updates ``[start, stop)``; waves are formed greedily so
that every contribution to those updates was computed at a version
``<= start`` and no worker contributes twice. All its gradients can then be
computed while the server holds version ``start`` (every read they need has
happened), and its updates applied in order afterwards.

A wave's gradients are packed into *steps* of ``lanes`` gradients per device
(one ``vmap`` each); a wave with more contributions than that takes several
steps, all at the same server version, and its updates are applied in the
last one. Packing keeps the masked (wasted) lanes few when waves vary in size,
as they do when workers have random speeds.

Each worker keeps its read parameters in one of ``num_slots`` slots (its
``k``-th contribution uses slot ``k mod num_slots``). One slot is enough when
a worker never reads again before its previous gradient has been computed;
schedules where a worker reads while an older push is still on its way to
the server get more.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from delayjax.cluster._schedule import Schedule

# Per-step overhead, in lane-equivalents, used to choose the step width.
_STEP_COST = 1.0


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The tables that drive the device loop (all NumPy), one row per step.

  Lanes, ``[T, lanes * devices]`` (lane ``l`` runs on device ``l // lanes``
  and only carries that device's workers):
    lane_active: the lane computes a real gradient.
    lane_worker: its worker (padding lanes: the device's first worker).
    lane_slot: the slot holding the worker's read parameters.
    lane_fresh: the contribution reads the step's own version (no slot).
    lane_update, lane_draw, lane_batches: which minibatches (see
      ``minibatch_indices``); ``lane_batches = num_batches >= 1``.
  Where each step's gradients go, ``[T]``:
    buffer_offset: lane ``l`` lands at row ``buffer_offset + l`` of the
      wave's gradient buffer (steps of a wave fill consecutive blocks).
  Updates applied at the end of the step, ``[T]`` and ``[T, L]``:
    upd_count: how many (0 except in a wave's last step).
    upd_index: update index ``u``.
    upd_pos, upd_worker, upd_batches, upd_staleness: ``[T, L, K]``, the
      update's contributions stalest first (ties: lowest worker), padded
      with batch count 0.
    read_begin, read_end: the reads of version ``u + 1`` done right after
      update ``u`` are entries ``read_begin .. read_end - 1`` of the step's
      read list.
  Reads, ``[T]`` and ``[T, R]``:
    read_first: reads ``0 .. read_first - 1`` are of the step's own version,
      done after its gradients and before its updates.
    read_worker, read_slot: who reads, into which slot.
  """

  num_workers: int
  num_devices: int
  lanes: int
  num_slots: int
  buffer_size: int
  starts: np.ndarray  # int64 [W + 1]: wave starts, then num_updates
  step_of_wave_end: np.ndarray  # int64 [W]: the step that applies each wave's updates
  lane_active: np.ndarray
  lane_worker: np.ndarray
  lane_slot: np.ndarray
  lane_fresh: np.ndarray
  lane_update: np.ndarray
  lane_draw: np.ndarray
  lane_batches: np.ndarray
  buffer_offset: np.ndarray
  upd_count: np.ndarray
  upd_index: np.ndarray
  upd_pos: np.ndarray
  upd_worker: np.ndarray
  upd_batches: np.ndarray
  upd_staleness: np.ndarray
  read_begin: np.ndarray
  read_end: np.ndarray
  read_first: np.ndarray
  read_worker: np.ndarray
  read_slot: np.ndarray

  _META = ("num_workers", "num_devices", "lanes", "num_slots", "buffer_size", "starts", "step_of_wave_end")

  @property
  def num_waves(self) -> int:
    return int(self.starts.shape[0] - 1)

  @property
  def num_steps(self) -> int:
    return int(self.upd_count.shape[0])

  def lane_utilization(self) -> float:
    """Fraction of computed lanes that carry a real gradient (the rest are masked)."""
    return float(self.lane_active.mean()) if self.lane_active.size else 0.0

  def wave_of_step(self, first: int, count: int) -> np.ndarray:
    """The wave of steps ``first .. first + count - 1`` (padding steps: the last wave)."""
    steps = np.arange(first, first + count)
    return np.minimum(np.searchsorted(self.step_of_wave_end, steps), max(self.num_waves - 1, 0))

  def tables(self, first: int, count: int) -> dict[str, np.ndarray]:
    """The tables of steps ``first .. first + count - 1``, padded with empty steps.

    Besides the fields, ``lane_next_worker``, ``lane_next_slot`` and
    ``lane_next_fresh`` describe the lanes of each following step, whose
    parameters each step gathers last.
    """
    out = self._rows(first, count)
    following = self._rows(first + 1, count)
    for name in ("worker", "slot", "fresh"):
      out[f"lane_next_{name}"] = following[f"lane_{name}"]
    return out

  def _rows(self, first: int, count: int) -> dict[str, np.ndarray]:
    out = {}
    for f in dataclasses.fields(self):
      if f.name in self._META:
        continue
      value = getattr(self, f.name)[first:first + count]
      if value.shape[0] < count:
        pad = np.zeros((count - value.shape[0],) + value.shape[1:], value.dtype)
        if f.name == "lane_worker":
          pad[...] = self.lane_worker[0]
        value = np.concatenate([value, pad])
      out[f.name] = value
    return out


def _waves(schedule: Schedule, cu: np.ndarray, cm: np.ndarray, cv: np.ndarray,
           first: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Greedy waves: cut before an update that needs a version newer than the wave's start,
  a second gradient from a worker already in the wave, or one of ``cuts`` (bool ``[U]``)."""
  num_updates = schedule.num_updates
  wave_of_update = np.empty(num_updates, np.int64)
  starts = [0]
  last_wave = [-1] * schedule.num_workers
  wave = start = 0
  vs, ms, bounds, cut = cv.tolist(), cm.tolist(), first.tolist(), cuts.tolist()
  for u in range(num_updates):
    lo, hi = bounds[u], bounds[u + 1]
    if u > start and (cut[u] or any(vs[c] > start or last_wave[ms[c]] == wave for c in range(lo, hi))):
      wave += 1
      start = u
      starts.append(u)
    for c in range(lo, hi):
      last_wave[ms[c]] = wave
    wave_of_update[u] = wave
  return wave_of_update, np.asarray(starts + [num_updates], np.int64)


def _choose_lanes(counts: np.ndarray, per_device: int) -> int:
  """The lanes per device that minimize (steps) x (lanes + per-step overhead)."""
  best, best_cost = 1, np.inf
  for lanes in range(1, per_device + 1):
    steps = np.maximum(1, (-(-counts // lanes)).max(axis=1))
    cost = steps.sum() * (lanes + _STEP_COST)
    if cost < best_cost:
      best, best_cost = lanes, cost
  return best


def plan_steps(schedule: Schedule, num_workers: int, num_devices: int = 1,
               lanes: int | None = None, local_steps: np.ndarray | None = None,
               wave_starts: np.ndarray | None = None) -> StepPlan:
  """Splits ``schedule`` into waves and steps for ``num_workers`` workers on ``num_devices`` devices.

  ``num_workers`` is the schedule's, padded to a multiple of ``num_devices``
  (padding workers never contribute); ``lanes`` is the step width per device
  (default: chosen to minimize computed lanes plus per-step overhead);
  ``local_steps`` (``[num_workers]``, default all 1): each contribution of
  worker ``m`` draws ``num_batches * local_steps[m]`` minibatches, which
  ``lane_draw`` counts; ``wave_starts``: updates that must begin a wave (e.g.
  the epoch starts of SVRG, whose lanes then all share one snapshot).
  """
  num_updates = schedule.num_updates
  per_device = num_workers // num_devices
  cu, cm = np.nonzero(schedule.contributes)  # sorted by update, then worker
  cv = schedule.read_version[cu, cm]
  cnb = schedule.num_batches[cu, cm]
  n = cu.size
  per_update = np.bincount(cu, minlength=num_updates)
  first = np.concatenate([[0], np.cumsum(per_update)])
  cuts = np.zeros(num_updates, bool)
  if wave_starts is not None:
    cuts[np.asarray(wave_starts, np.int64)] = True
  wave_of_update, starts = _waves(schedule, cu, cm, cv, first, cuts)
  num_waves = starts.shape[0] - 1
  cw = wave_of_update[cu]
  compute_at = starts[cw]  # the version each gradient is computed at

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
  # Slot k mod S is reused by contribution k + S, whose read must not come
  # before contribution k's gradient is computed (at the same version is fine:
  # a wave stores reads of its own version after computing).
  num_slots = 1
  v_sorted, at_sorted = cv[order], compute_at[order]
  while n > num_slots and np.any((m_sorted[num_slots:] == m_sorted[:-num_slots])
                                 & (v_sorted[num_slots:] < at_sorted[:-num_slots])):
    num_slots += 1
  slot = rank % num_slots
  fresh = cv == compute_at

  # Pack each wave's contributions into steps, per device, in worker order.
  device = cm // per_device
  counts = np.zeros((num_waves, num_devices), np.int64)
  np.add.at(counts, (cw, device), 1)
  if lanes is None:
    lanes = _choose_lanes(counts, per_device)
  steps_of_wave = np.maximum(1, (-(-counts // lanes)).max(axis=1))
  step_offset = np.concatenate([[0], np.cumsum(steps_of_wave)])
  num_steps = int(step_offset[-1])
  width = lanes * num_devices
  by_wave_device = np.lexsort((cm, device, cw))
  key = cw[by_wave_device] * num_devices + device[by_wave_device]
  key_first = np.searchsorted(key, key)
  j = np.empty(n, np.int64)
  j[by_wave_device] = np.arange(n) - key_first
  step = step_offset[cw] + j // lanes
  lane = device * lanes + j % lanes
  pos = (j // lanes) * width + lane  # position in the wave's gradient buffer
  buffer_size = int(steps_of_wave.max()) * width

  shape = (num_steps, width)
  lane_active = np.zeros(shape, bool)
  lane_worker = np.broadcast_to((np.arange(width) // lanes) * per_device, shape).astype(np.int32)
  lane_slot = np.zeros(shape, np.int32)
  lane_fresh = np.zeros(shape, bool)
  lane_update = np.zeros(shape, np.int32)
  lane_draw = np.zeros(shape, np.int32)
  lane_batches = np.ones(shape, np.int32)
  lane_active[step, lane] = True
  lane_worker[step, lane] = cm
  lane_slot[step, lane] = slot
  lane_fresh[step, lane] = fresh
  lane_update[step, lane] = cu
  lane_draw[step, lane] = draw
  lane_batches[step, lane] = cnb
  buffer_offset = ((np.arange(num_steps) - np.repeat(step_offset[:-1], steps_of_wave)) * width).astype(np.int32)

  # Updates, applied in their wave's last step.
  end_step = step_offset[1:] - 1
  lengths = np.diff(starts)
  max_len = int(lengths.max()) if num_waves else 1
  position = np.arange(num_updates) - starts[wave_of_update]
  ustep = end_step[wave_of_update]
  upd_count = np.zeros(num_steps, np.int32)
  upd_count[end_step] = lengths
  upd_index = np.zeros((num_steps, max_len), np.int32)
  upd_index[ustep, position] = np.arange(num_updates)
  max_contrib = max(int(per_update.max()) if num_updates else 1, 1)
  kshape = (num_steps, max_len, max_contrib)
  upd_pos = np.zeros(kshape, np.int32)
  upd_worker = np.zeros(kshape, np.int32)
  upd_batches = np.zeros(kshape, np.int32)
  upd_staleness = np.zeros(kshape, np.int32)
  staleness = cu - cv
  # Stalest first, ties by lowest worker: the first kept entry supplies the
  # update's staleness, stale parameters and worker.
  by_update = np.lexsort((cm, -staleness, cu))
  k = np.arange(n) - first[cu[by_update]]
  rows = (ustep[cu[by_update]], position[cu[by_update]], k)
  upd_pos[rows] = pos[by_update]
  upd_worker[rows] = cm[by_update]
  upd_batches[rows] = cnb[by_update]
  upd_staleness[rows] = staleness[by_update]

  # Reads through a slot: of a wave's start version (after its gradients),
  # or of version v right after update v - 1 (inside v's wave).
  stored = ~fresh
  sv, sm, ss = cv[stored], cm[stored], slot[stored]
  read_wave = np.searchsorted(starts[:-1], sv, side="right") - 1
  after = np.where(starts[read_wave] == sv, -1, sv - 1)  # -1: at the wave start
  r_order = np.lexsort((sm, after, read_wave))
  read_wave, after, sm, ss = read_wave[r_order], after[r_order], sm[r_order], ss[r_order]
  per_wave_reads = np.bincount(read_wave, minlength=num_waves)
  max_reads = max(int(per_wave_reads.max()) if sv.size else 0, 1)
  r_first = np.concatenate([[0], np.cumsum(per_wave_reads)])
  r_index = np.arange(sv.size) - r_first[read_wave]
  rstep = end_step[read_wave]
  read_worker = np.full((num_steps, max_reads), num_workers, np.int32)
  read_slot = np.zeros((num_steps, max_reads), np.int32)
  read_worker[rstep, r_index] = sm
  read_slot[rstep, r_index] = ss
  read_first = np.zeros(num_steps, np.int32)
  np.add.at(read_first, rstep[after < 0], 1)
  # Entries for update u are contiguous (sorted by `after`): begin = first
  # index with after >= u, end = first with after > u, within the wave.
  read_begin = np.zeros((num_steps, max_len), np.int32)
  read_end = np.zeros((num_steps, max_len), np.int32)
  global_after = np.where(after < 0, -1, after)
  sort_key = read_wave * (num_updates + 1) + (global_after + 1)
  u_key = wave_of_update * (num_updates + 1) + (np.arange(num_updates) + 1)
  read_begin[ustep, position] = np.searchsorted(sort_key, u_key, side="left") - r_first[wave_of_update]
  read_end[ustep, position] = np.searchsorted(sort_key, u_key, side="right") - r_first[wave_of_update]

  return StepPlan(
      num_workers=num_workers, num_devices=num_devices, lanes=lanes, num_slots=num_slots,
      buffer_size=buffer_size, starts=starts, step_of_wave_end=end_step, lane_active=lane_active,
      lane_worker=lane_worker, lane_slot=lane_slot, lane_fresh=lane_fresh, lane_update=lane_update,
      lane_draw=lane_draw, lane_batches=lane_batches, buffer_offset=buffer_offset, upd_count=upd_count,
      upd_index=upd_index, upd_pos=upd_pos, upd_worker=upd_worker, upd_batches=upd_batches,
      upd_staleness=upd_staleness, read_begin=read_begin, read_end=read_end, read_first=read_first,
      read_worker=read_worker, read_slot=read_slot)
