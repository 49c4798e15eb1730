"""Host-side planning of the wave-parallel runtime: which gradients are computed together.

Everything here is NumPy on the host; the device loop in ``_simulate.py``
only follows the tables built here. Planning is array operations over the
contributions, except one pass that places each contribution in its step
(``_assign_steps``: a few list operations per contribution) and chains
followed one link at a time through array.arrays (the waves, each buffer
block's steps), and it reads the schedule's sparse contributions, never an
``[updates, workers]`` array.

The device loop runs *steps*: each computes ``lanes`` gradients per device
(one ``vmap``) at the current server version ``V``, then applies, in order,
every update from ``V`` on whose gradients have all been computed. Any
contribution whose read has happened (read version ``<= V``) may be computed,
however far ahead its update is, so steps are filled earliest update first
(``_schedule_steps``) and lanes are rarely masked, even when workers have
random speeds and the schedule's *waves* (maximal runs of updates whose
contributions all read a version no newer than the run's start, one per worker:
what a whole step could compute at once) vary in size. Gradients computed
ahead wait in a buffer until their update.

Each worker keeps its read parameters in one of ``num_slots`` slots (its
``k``-th contribution uses slot ``k mod num_slots``) when the version it read
is left behind before its gradient is computed. One slot is enough when a
worker never reads again before its previous gradient has been computed;
schedules where a worker reads while an older push is still on its way to
the server get more.
"""

from __future__ import annotations

import array
import dataclasses

import numpy as np

from delayjax.cluster._schedule import Schedule

# Per-step overhead, in lane-equivalents, used to choose the step width.
_STEP_COST = 1.0
# Updates planned per candidate width when choosing it.
_CHOICE_UPDATES = 20_000


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The tables that drive the device loop (all NumPy), one row per step.

  Lanes, ``[T, lanes * devices]`` (lane ``l`` runs on device ``l // lanes``
  and only carries that device's workers):
    lane_active: the lane computes a real gradient.
    lane_worker: its worker (padding lanes: the device's first worker).
    lane_slot: the slot holding the worker's read parameters.
    lane_fresh: ``[T, lanes * devices, G]``, per group of parameter leaves:
      the contribution reads the step's own version (no slot).
    lane_update, lane_draw, lane_batches: which minibatches (see
      ``minibatch_indices``); ``lane_batches = num_batches >= 1``.
  Where each step's gradients go, ``[T]``:
    buffer_offset: lane ``l`` lands at row ``buffer_offset + l`` of the
      gradient buffer (a block of ``lanes * devices`` rows none of whose
      gradients still waits for its update).
  Updates applied at the end of the step, ``[T]`` and ``[T, L]``:
    upd_count: how many.
    upd_index: update index ``u``.
    upd_pos, upd_worker, upd_batches: ``[T, L, K]``, the update's
      contributions stalest first (ties: lowest worker), padded with batch
      count 0; upd_staleness ``[T, L, K, G]``, per group.
    read_begin, read_end: the reads of version ``u + 1`` done right after
      update ``u`` are entries ``read_begin .. read_end - 1`` of the step's
      read list.
  Reads, ``[T]``:
    read_first: reads ``0 .. read_first - 1`` are of the step's own version,
      done after its gradients and before its updates.
  The reads themselves, one flat list of every step's in order (step ``s``'s
  are entries ``read_start[s] .. read_start[s + 1] - 1``; a few per step on
  average however many one step has, so the list grows with the reads, not
  with steps times the widest step): ``read_worker``, ``read_slot``,
  ``read_group``, who reads, into which slot, which group of parameter leaves
  (always 0 without per-leaf delays). :meth:`tables` gives them per step as
  ``[count, read_width]`` rows padded with worker ``num_workers``.
  """

  num_workers: int
  num_devices: int
  lanes: int
  num_slots: int
  buffer_size: int
  starts: np.ndarray  # int64 [W + 1]: wave starts, then num_updates (statistics only)
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
  read_group: np.ndarray
  read_start: np.ndarray  # int64 [T + 1]: offsets of each step's reads in the flat read list
  read_width: int  # the reads' table width in `tables`: at least the most reads of one step

  _META = ("num_workers", "num_devices", "lanes", "num_slots", "buffer_size", "starts", "read_worker", "read_slot",
           "read_group", "read_start", "read_width")

  @property
  def num_waves(self) -> int:
    return int(self.starts.shape[0] - 1)

  @property
  def num_steps(self) -> int:
    return int(self.upd_count.shape[0])

  def lane_utilization(self) -> float:
    """Fraction of computed lanes that carry a real gradient (the rest are masked)."""
    return float(self.lane_active.mean()) if self.lane_active.size else 0.0

  def version_of_step(self, first: int, count: int) -> np.ndarray:
    """The server version (updates applied before it) of steps ``first .. first + count - 1``."""
    before = np.concatenate([[0], np.cumsum(self.upd_count)])
    return before[np.minimum(np.arange(first, first + count), self.num_steps)]

  def tables(self, first: int, count: int) -> dict[str, np.ndarray]:
    """The tables of steps ``first .. first + count - 1``, padded with empty steps.

    Besides the fields, ``lane_next_worker``, ``lane_next_slot`` and
    ``lane_next_fresh`` describe the lanes of each following step, whose
    parameters each step gathers last.
    """
    reads = self._read_rows(first, count)
    rows = self._rows(first, count, [f.name for f in dataclasses.fields(self) if f.name not in self._META])
    out = {f.name: reads[f.name] if f.name in reads else rows[f.name] for f in dataclasses.fields(self)
           if f.name in reads or f.name in rows}
    following = self._rows(first + 1, count, ["lane_worker", "lane_slot", "lane_fresh"])
    for name in ("worker", "slot", "fresh"):
      out[f"lane_next_{name}"] = following[f"lane_{name}"]
    return out

  def _rows(self, first: int, count: int, names: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
      value = getattr(self, name)[first:first + count]
      if value.shape[0] < count:
        pad = np.zeros((count - value.shape[0],) + value.shape[1:], value.dtype)
        if name == "lane_worker":
          pad[...] = self.lane_worker[0]
        value = np.concatenate([value, pad])
      out[name] = value
    return out

  def _read_rows(self, first: int, count: int) -> dict[str, np.ndarray]:
    """Steps ``first .. first + count - 1``'s reads as ``[count, read_width]`` rows (empty steps past the end)."""
    bounds = self.read_start[np.clip(np.arange(first, first + count + 1), 0, self.num_steps)]
    lo, hi = int(bounds[0]), int(bounds[-1])
    row = np.repeat(np.arange(count), np.diff(bounds))
    column = np.arange(lo, hi) - bounds[row]
    out = {}
    for name, fill in (("read_worker", self.num_workers), ("read_slot", 0), ("read_group", 0)):
      table = np.full((count, self.read_width), fill, np.int32)
      table[row, column] = getattr(self, name)[lo:hi]
      out[name] = table
    return out


def _wave_starts(cu: np.ndarray, cv: np.ndarray, order: np.ndarray, new_worker: np.ndarray, per_update: np.ndarray,
                 first: np.ndarray) -> np.ndarray:
  """Greedy waves: cut before an update that needs a version newer than the wave's start,
  or a second gradient from a worker already in the wave.

  Update ``u`` cuts a wave that started at ``s < u`` exactly when ``need[u] > s``, where ``need[u]`` is
  the largest, over its contributions, of the read version and one past the worker's previous update
  (both at most ``u``). So the wave after the one starting at ``s`` starts at the first update whose
  ``need`` exceeds ``s``: a suffix minimum over ``need``, followed from update 0.

  ``order`` sorts the contributions by worker, then update; ``new_worker``
  (in that order) marks each worker's first.
  """
  n, num_updates = cu.size, per_update.size
  # In worker order: one past the update of the worker's previous contribution (0 for its first).
  filled = cu[order]  # the updates with a contribution
  after_previous = np.empty(n, np.int64)
  after_previous[1:] = filled[:-1] + 1
  after_previous[new_worker] = 0
  need = np.maximum(cv[order], after_previous)
  if n and (n != num_updates or per_update.max() > 1):
    # Contributions are sorted by update: each update's are one run.
    in_order = np.empty(n, np.int64)
    in_order[order] = need
    filled = np.flatnonzero(per_update)
    need = np.maximum.reduceat(in_order, first[filled])
  # lowest[t]: the first update whose need is t; nxt[s], the first update whose need exceeds s, is the
  # minimum of lowest[s + 1:].
  lowest = np.full(num_updates + 1, num_updates, np.int64)
  np.minimum.at(lowest, need, filled)
  # Followed from update 0, one wave at a time, in an array.array (read without converting every entry):
  # nxt[s] is entry num_updates - 1 - s of the running minimum of `lowest` from its end.
  from_end = np.empty(num_updates + 1, np.int64)
  np.minimum.accumulate(lowest[::-1], out=from_end)
  nxt = array.array("q")
  nxt.frombytes(memoryview(from_end).cast("B"))
  last = num_updates - 1
  starts = array.array("q")
  begin = starts.append
  s = 0
  while s < num_updates:
    begin(s)
    s = nxt[last - s]
  begin(num_updates)
  return np.frombuffer(starts, np.int64).copy()


def _assign_steps(cu: np.ndarray, ready: np.ndarray, device: np.ndarray, num_devices: int, lanes: int,
                  after: np.ndarray | None, limit: float = np.inf) -> tuple[list[int], list[int], list[int]] | None:
  """Assigns every contribution its step and lane, building the steps' versions.

  The device loop builds steps one at a time at the server version ``V``
  (updates applied so far): each device computes up to ``lanes`` of the
  contributions read and ready (``ready <= V``) and not yet computed, lowest
  index (update, then worker) first, skipping one whose ``after`` (a
  contribution that must be computed in an earlier step, or -1) is not; the
  next step's version is the update of the lowest-index contribution still
  uncomputed. Lower indices take lanes first, so the same steps come from
  placing contributions in index order, each in the first step at or after
  the one where it becomes ready (and after its ``after``'s) with a lane free
  on its device, in that device's next lane; and the version of every step
  up to the last one used is then known: a step's version is the update of
  the lowest-index contribution placed in it or later (version 0 for step 0).
  A contribution opens a new step only as the first placed in it, so that
  step's version is its update.

  Returns ``(compute_step, versions, lane)`` (``versions[s]``: step ``s``'s
  version; ``lane``: within the device, ``None`` on one device without
  ``after``, where it is the contribution's rank in its step), or
  ``None`` once the steps cost more than ``limit`` (steps times
  ``lanes + _STEP_COST``).
  """
  n = cu.size
  if num_devices == 1 and after is None:
    placement = _Placement(lanes, n)
    if not placement.extend(cu, ready, limit):
      return None
    step, _, versions = placement.finish(cu)
    return step.tolist(), versions.tolist(), None
  cu_l, ready_l = cu.tolist(), ready.tolist()
  dev_l = device.tolist() if num_devices > 1 else [0] * n
  after_l = [-1] * n if after is None else after.tolist()
  step = [0] * n
  lane_of = [0] * n
  versions = [0]  # step 0 is built at version 0
  top = 0  # versions[-1]
  # ready_step[v]: the first step whose version is at least v, for v <= top.
  ready_step = [0] * (int(cu[-1]) + 2 if n else 1)
  # Per device: contributions placed in each step, and a pointer towards a later step with a free lane
  # (itself where the step has one), followed with path halving.
  size = 64
  loads = [[0] * size for _ in range(num_devices)]
  links = [list(range(size)) for _ in range(num_devices)]
  cost = lanes + _STEP_COST
  known = 1  # len(versions)
  for c in range(n):
    r = ready_l[c]
    t = ready_step[r] if r <= top else known
    a = after_l[c]
    if a >= 0 and step[a] >= t:
      t = step[a] + 1
    d = dev_l[c]
    link = links[d]
    while link[t] != t:
      link[t] = link[link[t]]
      t = link[t]
    load = loads[d]
    k = load[t]
    lane_of[c] = k
    k += 1
    load[t] = k
    if k == lanes:
      link[t] = t + 1
    step[c] = t
    if t >= known:
      u = cu_l[c]
      versions.extend([u] * (t + 1 - known))
      ready_step[top + 1:u + 1] = [known] * (u - top)
      top, known = u, t + 1
      if known * cost > limit:
        return None
      if known + 2 > size:
        for d in range(num_devices):
          loads[d].extend([0] * size)
          links[d].extend(range(size, 2 * size))
        size *= 2
  return step, versions, lane_of


class _Placement:
  """:func:`_assign_steps` on one device for contributions that wait for no other (the common case), in fewer
  operations per contribution, and resumable: :meth:`extend` places the next contributions in index order,
  so the prefix placed while choosing the lane width is continued, not placed again (a contribution's
  placement depends only on those of lower index).

  A contribution lands in the first step at or after the first whose version is at least its ``ready``
  (``ready_step``) with a free lane, which is at most the step after the last one, which it then opens.
  ``free[t]`` is step ``t``'s free lanes (``1 .. lanes``) or, once the step is full, minus a later step
  towards one with a free lane (followed with path halving). Only steps are recorded: a contribution's lane
  is its rank among its step's in index order, and a step's version (after step 0's, 0) is the update of its
  first contribution, which opened it (:meth:`finish`). No exact array form of this greedy is known (a
  contribution's step depends on how all lower-index ones filled the steps and which steps they opened), so
  it stays one loop with few operations per contribution.
  """

  def __init__(self, lanes: int, num_contributions: int):
    self.lanes = lanes
    self.step: list[int] = []  # per contribution placed
    self.top = 0  # the last step's version
    self.known = 1  # steps so far; step 0 is built at version 0
    self.ready_step = [0]  # [v]: the first step whose version is at least v, for v <= top
    # Per step, about num_contributions / lanes of them when lanes are the bound; grown as needed. A step
    # after step 0 is opened by a contribution: its lane is taken in advance.
    self.free = [lanes] + [lanes - 1] * (num_contributions // lanes + 63)

  def extend(self, cu: np.ndarray, ready: np.ndarray, limit: float = np.inf) -> bool:
    """Places the next contributions (updates ``cu``, ready at versions ``ready``); ``False`` once the
    steps cost more than ``limit`` (steps times ``lanes + _STEP_COST``; the placement is then unusable)."""
    if not cu.size:
      return True
    if self.lanes == 1:
      return self._extend_one_lane(cu, ready, limit)
    lanes, free, ready_step = self.lanes, self.free, self.ready_step
    if len(ready_step) < int(cu[-1]) + 2:
      ready_step.extend([0] * (int(cu[-1]) + 2 - len(ready_step)))
    place = self.step.append
    top, known = self.top, self.known
    cost = lanes + _STEP_COST
    # Checked only when `known` passes it: the step tables' size, or the steps that `limit` allows.
    bound = min(len(free) - 2, limit / cost)
    for r, u in zip(ready.tolist(), cu.tolist()):
      if r <= top:
        t = ready_step[r]
        f = free[t]
        if f > 1:
          free[t] = f - 1
          place(t)
          continue
        if f == 1:
          free[t] = -1 - t
          place(t)
          continue
        while f < 0:
          later = -f
          f = free[later]
          if f < 0:
            free[t] = f
            t = -f
            f = free[t]
          else:
            t = later
        if t < known:
          free[t] = f - 1 if f > 1 else -1 - t
          place(t)
          continue
      # A new step, built at this contribution's update (its lane already taken in `free`).
      place(known)
      if u == top + 1:
        ready_step[u] = known
      else:
        ready_step[top + 1:u + 1] = [known] * (u - top)
      top = u
      known += 1
      if known > bound:
        if known * cost > limit:
          return False
        free.extend([lanes - 1] * len(free))
        bound = min(len(free) - 2, limit / cost)
    self.top, self.known = top, known
    return True

  def _extend_one_lane(self, cu: np.ndarray, ready: np.ndarray, limit: float) -> bool:
    """:meth:`extend` with one lane: every step after step 0 holds only its opener, so the first contribution
    ready at version 0 takes step 0 while it is free and every other opens the next step."""
    opens = np.ones(cu.size, bool)
    if self.free[0] == 1:
      zero = np.flatnonzero(ready == 0)
      if zero.size:
        opens[zero[0]] = False
        self.free[0] = -1
    step = np.cumsum(opens) + (self.known - 1)
    step[~opens] = 0
    self.step.extend(step.tolist())
    openers = np.flatnonzero(opens)
    if openers.size:
      self.top, self.known = int(cu[openers[-1]]), self.known + openers.size
    return self.known * (1 + _STEP_COST) <= limit

  def finish(self, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(compute_step, lane, versions)`` of the contributions placed (updates ``cu``). The placement is then
    spent: its lists (Python objects, several times the arrays' memory) are released."""
    step = np.asarray(self.step, np.int64)
    del self.step, self.free, self.ready_step
    order = np.argsort(step, kind="stable")  # steps are nearly sorted: a few passes
    counts = np.bincount(step, minlength=self.known)
    first = np.cumsum(counts) - counts
    lane = np.empty_like(step)
    lane[order] = np.arange(step.size) - first[step[order]]
    versions = np.zeros(self.known, np.int64)
    versions[1:] = cu[order[first[1:]]]  # every step after step 0 has its opener
    return step, lane, versions


def _schedule_steps(cu: np.ndarray, ready: np.ndarray, device: np.ndarray, num_devices: int, lanes: int,
                    num_updates: int, after: np.ndarray | None = None, placement: _Placement | tuple | None = None):
  """Every contribution's step, lane (within its device) and version, every update's step, and every
  step's version.

  See :func:`_assign_steps`; an update is applied in the step whose version
  it is at least and the next step's version it is below. ``placement``: the
  placement of the lane choice at ``lanes`` (see :func:`_choose_lanes`).
  """
  if num_devices == 1 and after is None:
    if placement is None:
      placement = _Placement(lanes, cu.size)
    done = len(placement.step)
    placement.extend(cu[done:], ready[done:])
    compute_step, lane_of, versions = placement.finish(cu)
  else:
    placed = placement if placement is not None else _assign_steps(cu, ready, device, num_devices, lanes, after)
    compute_step, versions, lane_of = (np.asarray(x, np.int64) for x in placed)
  # last_step[v]: the last step whose version is at most v (versions are sorted).
  last_step = np.cumsum(np.bincount(versions, minlength=num_updates + 1)) - 1
  return compute_step, lane_of, versions[compute_step], last_step[:num_updates], versions, last_step


def _reads(cv: np.ndarray, compute_step: np.ndarray, versions: np.ndarray, last_step: np.ndarray):
  """The reads through a slot, in each step's order.

  A group read at version ``v`` is stored when its gradient is computed after
  the step that passes through ``v``: in that step, before its updates when
  ``v`` is the step's own version, else right after update ``v - 1``. Reads
  are ordered by version, then by (contribution, group).

  Returns, per entry in order, its contribution, group (``None`` with one group), step and ``after``
  (the update it follows, ``-1`` for the step's own version). ``last_step``:
  per version, the last step whose version is at most it.
  """
  groups = cv.shape[1]
  through = last_step[cv]  # [n, G]
  # The stored reads in (contribution, group) order, then stably by version (fewer to sort than all).
  pair = np.flatnonzero(compute_step[:, None] > through)
  version = cv.reshape(-1)[pair]
  by_read = np.argsort(version, kind="stable")
  pair, version = pair[by_read], version[by_read]
  s = through.reshape(-1)[pair]
  c = pair if groups == 1 else pair // groups
  g = None if groups == 1 else pair % groups  # None: all group 0
  after = np.where(version == versions[s], -1, version - 1)
  return c, g, s, after


def _num_slots(c: np.ndarray, s: np.ndarray, compute_step: np.ndarray, rank: np.ndarray, order: np.ndarray) -> int:
  """The fewest slots per worker such that no read (of contribution ``c`` in step ``s``) overwrites a slot
  whose previous contribution is not computed by then.

  ``order`` sorts the contributions by worker, then update: a slot's previous
  contribution is ``num_slots`` places before in it.
  """
  num_slots = 1
  if not c.size:
    return num_slots
  r = rank[c]
  where = np.empty(order.size, np.int64)  # position in worker order
  where[order] = np.arange(order.size)
  at = where[c]
  step_sorted = compute_step[order]
  while True:
    reuse = r >= num_slots
    if bool(np.all(step_sorted[at[reuse] - num_slots] <= s[reuse])):
      return num_slots
    num_slots += 1


def _buffer_blocks(compute_step: np.ndarray, cu: np.ndarray, apply_step: np.ndarray,
                   num_steps: int) -> tuple[np.ndarray, int]:
  """Each step's block of the gradient buffer: the lowest one whose gradients have all been applied.

  Taken in step order, block 0 goes to step 0 and then to the first step after the last one busy with its
  gradients; block ``b`` likewise among the steps the lower blocks left, since at each of those every lower
  block is busy. So each block's steps are one chain, followed over the steps still without a block.
  """
  # A block is busy from its step through the step applying its last update.
  busy_through = np.arange(num_steps)
  if cu.size:
    np.maximum.at(busy_through, compute_step, apply_step[cu])
  block_of_step = np.full(num_steps, -1, np.int64)
  left = np.arange(num_steps)  # the steps without a block, in order
  block = 0
  while left.size:
    # nxt[i]: where in `left` the first step after left[i]'s busy ones is, i.e. how many of `left` are
    # busy_through[left[i]] or earlier (more than i), read from an array.array without converting entries.
    left_through = np.cumsum(block_of_step < 0)
    nxt = array.array("q")
    nxt.frombytes(memoryview(left_through[busy_through[left]]).cast("B"))
    chain = array.array("q")
    take = chain.append
    i, end = 0, left.size
    while i < end:
      take(i)
      i = nxt[i]
    chain = np.frombuffer(chain, np.int64)
    block_of_step[left[chain]] = block
    left = np.delete(left, chain)
    block += 1
  return block_of_step, max(block, 1)


def _step_bound(cu: np.ndarray, ready: np.ndarray, num_updates: int) -> int:
  """A lower bound on the steps of any width: the steps when every ready contribution is computed at once.

  With more lanes no step's version is lower, since the next version is at
  most the lowest update among contributions not yet ready.
  """
  if not cu.size:
    return 1 if num_updates else 0
  # jump[v]: the lowest update among contributions ready only after version v.
  lowest = np.full(num_updates + 1, num_updates, np.int64)
  np.minimum.at(lowest, ready, cu)
  jump = np.minimum.accumulate(lowest[::-1])[::-1][1:].tolist()
  steps, v = 0, 0
  while v < num_updates:
    steps += 1
    v = jump[v]
  return steps


def _choose_lanes(cu: np.ndarray, ready: np.ndarray, device: np.ndarray, num_devices: int,
                  per_device: int, per_update: np.ndarray,
                  after: np.ndarray | None) -> tuple[int, _Placement | tuple | None]:
  """The lanes per device that minimize (steps) x (lanes + per-step overhead).

  Every width up to 8 is tried, then widths about 25% apart: each try plans
  the schedule's first ``_CHOICE_UPDATES`` updates (a long schedule's
  beginning stands for the rest). A width whose lower bound on the cost
  (its steps are at least those of unlimited lanes, and of its busiest device
  at full lanes) cannot beat the best so far is not planned, and a plan
  stops once it costs more; ties go to the fewest lanes.

  Returns the width and its placement of the planned contributions, to be
  continued with the rest (on one device without ``after``: a
  :class:`_Placement`), or reused when they were all (elsewhere:
  :func:`_assign_steps`'s result; ``None`` when they were not).
  """
  whole = per_update.size <= _CHOICE_UPDATES
  if not whole:
    keep = cu < _CHOICE_UPDATES
    # Contributions are sorted by update: the kept ones are a prefix, and wait only for kept ones.
    cu, ready, device = cu[keep], ready[keep], device[keep]
    after = None if after is None else after[keep]
    per_update = per_update[:_CHOICE_UPDATES]
  candidates = set(range(1, min(per_device, 8) + 1)) | {per_device}
  width = 8.0
  while width < per_device:
    candidates.add(int(round(width)))
    width *= 1.25
  num_updates = per_update.size
  base = _step_bound(cu, ready, num_updates)
  busiest = int(np.bincount(device, minlength=num_devices).max()) if cu.size else 0
  bounds = {lanes: max(base, -(-busiest // lanes)) * (lanes + _STEP_COST) for lanes in candidates}
  best, best_cost, best_placement = 1, np.inf, None
  one_device = num_devices == 1 and after is None
  for lanes in sorted(candidates, key=lambda w: (bounds[w], w)):
    if bounds[lanes] > best_cost or (bounds[lanes] == best_cost and lanes > best):
      continue
    if one_device:
      placement = _Placement(lanes, cu.size)
      if not placement.extend(cu, ready, best_cost):
        continue
      steps = placement.known
    else:
      placed = _assign_steps(cu, ready, device, num_devices, lanes, after, best_cost)
      if placed is None:
        continue
      placement, steps = placed if whole else None, len(placed[1])
    cost = (steps if num_updates else 0) * (lanes + _STEP_COST)
    if cost < best_cost or (cost == best_cost and lanes < best):
      best, best_cost, best_placement = lanes, cost, placement
  return best, best_placement


def plan_steps(schedule: Schedule, num_workers: int, num_devices: int = 1,
               lanes: int | None = None, local_steps: np.ndarray | None = None,
               not_before: np.ndarray | None = None, group_versions: np.ndarray | None = None,
               sequential_workers: bool = False) -> StepPlan:
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
  """
  num_updates = schedule.num_updates
  per_device = num_workers // num_devices
  # Sorted by update, then worker; the sparse record, so that no [updates, workers] array is built.
  contributions = schedule.contributions
  cu, cm = contributions.update, contributions.worker
  if group_versions is None:
    cvg = contributions.read_version[:, None]
  else:
    cvg = np.asarray(group_versions, np.int64).reshape(cu.size, -1)
  # A gradient can be computed once its last group has been read.
  cv = cvg.max(axis=1) if cu.size else np.zeros(0, np.int64)
  cnb = contributions.num_batches
  n = cu.size
  per_update = np.bincount(cu, minlength=num_updates)
  first = np.concatenate([[0], np.cumsum(per_update)])
  order, m_sorted, rank, draw, starts = _worker_order(cu, cm, cv, cnb, num_workers, per_update, first, local_steps)
  device = cm // per_device
  ready = cv if not_before is None else np.maximum(cv, np.asarray(not_before, np.int64)[cu])
  after, placement = None, None
  if sequential_workers:
    after = np.full(n, -1, np.int64)
    previous = order[:-1][m_sorted[1:] == m_sorted[:-1]] if n else order[:0]
    after[order[1:][m_sorted[1:] == m_sorted[:-1]] if n else order[:0]] = previous
  if lanes is None:
    lanes, placement = _choose_lanes(cu, ready, device, num_devices, per_device, per_update, after)
  compute_step, lane_of, compute_version, apply_step, versions, last_step = _schedule_steps(
      cu, ready, device, num_devices, lanes, num_updates, after, placement)
  read_c, read_g, read_s, read_after = _reads(cvg, compute_step, versions, last_step)
  num_slots = _num_slots(read_c, read_s, compute_step, rank, order)
  slot = rank % num_slots
  num_steps = int(apply_step.max()) + 1 if num_updates else 1
  width = lanes * num_devices
  lane = device * lanes + lane_of

  # Each step writes its gradients to a block of `width` rows of the buffer:
  # the lowest block none of whose gradients still waits for its update.
  block_of_step, num_blocks = _buffer_blocks(compute_step, cu, apply_step, num_steps)
  buffer_offset = (block_of_step * width).astype(np.int32)
  pos = buffer_offset[compute_step] + lane if n else np.zeros(0, np.int64)
  tables = _lane_tables(compute_step * width + lane, (num_steps, width), lanes, per_device, cm, slot,
                        cvg == compute_version[:, None], cu, draw, cnb, compute_step, lane)
  upd = _update_tables(apply_step, num_steps, num_updates, per_update, first, cu, cvg, pos, cm, cnb)
  reads = _read_tables(read_s, read_after, apply_step, upd.pop("step_first"), upd.pop("at_update"), num_steps,
                       num_updates, upd["upd_index"].shape[1])
  return StepPlan(
      num_workers=num_workers, num_devices=num_devices, lanes=lanes, num_slots=num_slots,
      buffer_size=num_blocks * width, starts=starts, buffer_offset=buffer_offset, **tables, **upd, **reads,
      read_worker=cm[read_c].astype(np.int32), read_slot=slot[read_c].astype(np.int32),
      read_group=np.zeros(read_c.size, np.int32) if read_g is None else read_g.astype(np.int32))


def _worker_order(cu: np.ndarray, cm: np.ndarray, cv: np.ndarray, cnb: np.ndarray, num_workers: int,
                  per_update: np.ndarray, first: np.ndarray, local_steps: np.ndarray | None) -> tuple[np.ndarray, ...]:
  """Each worker's contributions in order: the sort by worker, each one's rank among its worker's, the
  minibatches its worker drew before it, and the wave starts."""
  n = cu.size
  # Per-worker order: rank k, minibatches drawn before, slot k mod S.
  # Contributions are sorted by update: a stable sort by worker orders each worker's by update (16-bit
  # keys sort in linear time).
  order = np.argsort(cm.astype(np.uint16) if num_workers < 2**16 else cm, kind="stable")
  m_sorted = cm[order]
  counts = np.bincount(cm, minlength=num_workers)
  group_start = (np.cumsum(counts) - counts)[m_sorted]  # in worker order: where the worker's run begins
  rank_sorted = np.arange(n) - group_start
  rank = np.empty(n, np.int64)
  rank[order] = rank_sorted
  starts = _wave_starts(cu, cv, order, rank_sorted == 0, per_update, first)
  if local_steps is None and bool(np.all(cnb == 1)):
    draw = rank  # one minibatch per contribution
  else:
    draws = cnb if local_steps is None else cnb * np.asarray(local_steps, np.int64)[cm]
    draws_sorted = draws[order]
    drawn = np.cumsum(draws_sorted) - draws_sorted
    draw = np.empty(n, np.int64)
    draw[order] = drawn - drawn[group_start] if n else drawn
  return order, m_sorted, rank, draw, starts


def _lane_tables(at_lane: np.ndarray, shape: tuple[int, int], lanes: int, per_device: int, cm: np.ndarray,
                 slot: np.ndarray, fresh: np.ndarray, cu: np.ndarray, draw: np.ndarray, cnb: np.ndarray,
                 compute_step: np.ndarray, lane: np.ndarray) -> dict[str, np.ndarray]:
  """The ``lane_*`` tables ``[steps, width]``: each lane's contribution (``at_lane``: flat positions).

  ``fresh`` ``[n, G]``: whether each group is read at the compute version.
  """
  size = shape[0] * shape[1]

  # Tables are filled through flat indices (one index array for the fields of a table shape).
  def lane_table(values, fill, dtype):
    table = np.full(size, fill, dtype)
    table[at_lane] = values
    return table.reshape(shape)

  lane_worker = np.empty(shape, np.int32)
  lane_worker[...] = (np.arange(shape[1]) // lanes) * per_device
  lane_worker.reshape(-1)[at_lane] = cm
  if fresh.shape[1] == 1:
    lane_fresh = lane_table(fresh[:, 0], False, bool).reshape(shape + (1,))
  else:
    lane_fresh = np.zeros(shape + (fresh.shape[1],), bool)
    lane_fresh[compute_step, lane] = fresh
  return dict(lane_active=lane_table(True, False, bool), lane_worker=lane_worker,
              lane_slot=lane_table(slot, 0, np.int32), lane_fresh=lane_fresh,
              lane_update=lane_table(cu, 0, np.int32), lane_draw=lane_table(draw, 0, np.int32),
              lane_batches=lane_table(cnb, 1, np.int32))


def _update_tables(apply_step: np.ndarray, num_steps: int, num_updates: int, per_update: np.ndarray,
                   first: np.ndarray, cu: np.ndarray, cvg: np.ndarray, pos: np.ndarray, cm: np.ndarray,
                   cnb: np.ndarray) -> dict[str, np.ndarray]:
  """The ``upd_*`` tables: updates, in order, each in the step that computes its last gradient (or later,
  behind an earlier update still waiting), with their contributions; and ``step_first``/``at_update``
  (where each step's updates begin, each update's flat ``[T, L]`` index) for the read tables."""
  n = cu.size
  upd_count = np.bincount(apply_step, minlength=num_steps).astype(np.int32)
  max_len = max(int(upd_count.max()) if num_updates else 1, 1)
  step_first = np.concatenate([[0], np.cumsum(upd_count)])
  position = np.arange(num_updates) - step_first[apply_step]
  at_update = apply_step * max_len + position  # flat index in [T, L]
  upd_index = np.zeros(num_steps * max_len, np.int32)
  upd_index[at_update] = np.arange(num_updates)
  upd_index = upd_index.reshape(num_steps, max_len)
  max_contrib = max(int(per_update.max()) if num_updates else 1, 1)
  kshape = (num_steps, max_len, max_contrib)
  staleness = cu[:, None] - cvg  # [n, G]
  # Stalest first (by its stalest group), ties by lowest worker: the first kept entry supplies the
  # update's staleness, stale parameters and worker.
  if max_contrib == 1:
    by_update = None
    at_contrib = at_update if n == num_updates else at_update[cu]  # cu is 0 .. n - 1 when n == num_updates
  else:
    # Contributions are sorted by update, then worker: a stable sort on (update, stalest first) keeps
    # the worker order within ties.
    stalest = staleness.max(axis=1, initial=0)
    top = int(stalest.max()) + 1
    by_update = np.argsort(cu * top + (top - 1 - stalest), kind="stable")
    at_contrib = at_update[cu] * max_contrib + (np.arange(n) - first[cu])

  def update_table(values, groups=None):
    table = np.zeros(kshape[0] * kshape[1] * kshape[2] * (groups or 1), np.int32)
    if groups is None:
      table[at_contrib] = values if by_update is None else values[by_update]
      return table.reshape(kshape)
    table = table.reshape(-1, groups)
    table[at_contrib] = values if by_update is None else values[by_update]
    return table.reshape(kshape + (groups,))

  return dict(upd_count=upd_count, upd_index=upd_index, upd_pos=update_table(pos), upd_worker=update_table(cm),
              upd_batches=update_table(cnb), upd_staleness=update_table(staleness, cvg.shape[1]),
              step_first=step_first, at_update=at_update)


def _read_tables(read_s: np.ndarray, read_after: np.ndarray, apply_step: np.ndarray, step_first: np.ndarray,
                 at_update: np.ndarray, num_steps: int, num_updates: int, max_len: int) -> dict[str, np.ndarray]:
  """Reads through a slot, per step: first those of the step's own version (after its gradients, before
  its updates), then those of version u + 1 right after update u."""
  reads_per_step = np.bincount(read_s, minlength=num_steps)
  read_start = np.concatenate([[0], np.cumsum(reads_per_step)])
  own = read_after < 0
  read_first = np.bincount(read_s[own], minlength=num_steps).astype(np.int32)
  # Update u's reads follow the step's own reads and those after its earlier updates.
  after_update = np.concatenate([[0], np.cumsum(np.bincount(read_after[~own], minlength=num_updates))])
  begin = read_first[apply_step] + after_update[:-1] - after_update[step_first[apply_step]]
  read_begin = np.zeros(num_steps * max_len, np.int32)
  read_end = np.zeros(num_steps * max_len, np.int32)
  read_begin[at_update] = begin
  read_end[at_update] = begin + np.diff(after_update)
  return dict(read_begin=read_begin.reshape(num_steps, max_len), read_end=read_end.reshape(num_steps, max_len),
              read_first=read_first, read_start=read_start,
              read_width=max(int(reads_per_step.max()) if num_steps else 1, 1))
