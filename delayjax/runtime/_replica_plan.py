"""Host planning of the replica runtime: a gossip schedule's events packed into steps of parallel slots.

A *step* first computes one gradient per replica (a *lane*): the gradients of
the ``READ`` events of the previous step, at the parameters those reads
stored. It then runs ``P`` *phases*, each a fixed sequence of three *slots*:

- ``MIX``: mixing events on disjoint sets of replicas, as one table of rows
  (each receiving replica: its sources, weights and message lags);
- ``GRAD``: gradient events of distinct replicas (their gradients were
  computed at the start of this step or an earlier one);
- ``READ``: reads of distinct replicas (their gradients are computed at the
  start of the next step).

The compiled step scans one phase over the ``P`` phases, so it compiles one
phase whatever ``P`` is; a slot kind that no phase of any step uses is left
out of it.

Events are placed one by one in the schedule's order, each in the earliest
slot of its kind after the last slot of every replica it touches (and, for a
``GRAD`` or a ``GRADS`` mix, in a step after its read). Events of disjoint
replicas commute, and every replica sees its own events in the schedule's
order, so executing the slots in order is executing the schedule: the plan
only decides which events run side by side.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from delayjax.cluster._gossip import GRAD, GRADS, MIX, READ

SLOT_MIX, SLOT_GRAD, SLOT_READ = 0, 1, 2
_SLOTS = 3
# Rough cost of one slot pass over all replicas, relative to computing one gradient per replica (about
# a tenth for an MLP on a CPU): the planner trades more phases per step (more slot passes, most of them
# masked) against more steps.
_SLOT_COST = 0.1
_PHASE_CANDIDATES = (1, 2, 3, 4, 6)
# Mixing rows wider than this are applied as a dense [M, M] matrix product instead of a gather.
DENSE_WIDTH = 8
# Mixes whose sources sit at no more than this many fixed offsets (b - a) mod M move by whole-axis rolls.
MAX_SHIFTS = 4


def mixing_form(schedule: Any) -> tuple[str, tuple[int, ...]]:
  """How the runtime combines messages: ``("shift", offsets)`` when every nonzero weight of every mix
  sits at one of at most ``MAX_SHIFTS`` offsets ``(b - a) mod M`` and no message is late (rolls, or
  ``lax.ppermute`` on a mesh); else ``("gather", ())`` for groups of at most ``DENSE_WIDTH`` and
  ``("dense", ())`` (an ``[M, M]`` matrix per slot) for wider ones."""
  m = schedule.num_workers
  members = np.asarray(schedule.members)
  weights = np.asarray(schedule.weights)
  if members.shape[0] == 0:
    return "shift", (0,)
  valid = members >= 0
  used = (weights != 0) & valid[:, :, None] & valid[:, None, :] & np.asarray(schedule.receives)[:, :, None]
  offsets = (members[:, None, :] - members[:, :, None]) % m
  found = set(np.unique(offsets[used]).tolist()) | {0}
  lags = np.asarray(schedule.lag)
  if len(found) <= MAX_SHIFTS and not np.any(lags[np.asarray(schedule.mixes) != GRADS] > 0):
    return "shift", tuple(sorted(found))
  return ("dense" if members.shape[1] > DENSE_WIDTH else "gather"), ()


def place_events(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray,
                 mixes: np.ndarray, num_workers: int, phases: int) -> np.ndarray:
  """int64 ``[E]``: each event's global slot ``(step * phases + phase) * 3 + slot``."""
  block = _SLOTS * phases
  last = [-1] * num_workers
  read_step = [-1] * num_workers
  out = np.empty(kind.shape[0], np.int64)
  member_lists = [row[row >= 0].tolist() for row in members]
  for e in range(kind.shape[0]):
    k = kind[e]
    if k == MIX:
      group = member_lists[mix[e]]
      after = max(last[q] for q in group)
      if mixes[mix[e]] == GRADS:
        # Pending gradients are computed at the start of the step after their read.
        after = max(after, max((read_step[q] + 1) * block - 1 for q in group))
      slot = after + 1 + (SLOT_MIX - after - 1) % _SLOTS
      for q in group:
        last[q] = slot
    else:
      r = int(worker[e])
      after = last[r]
      if k == GRAD:
        after = max(after, (read_step[r] + 1) * block - 1)
        slot = after + 1 + (SLOT_GRAD - after - 1) % _SLOTS
      else:
        slot = after + 1 + (SLOT_READ - after - 1) % _SLOTS
        read_step[r] = slot // block
      last[r] = slot
    out[e] = slot
  return out


def _slot_passes(used: np.ndarray) -> int:
  """Slot passes per step: every phase runs each slot kind that any phase uses."""
  return int(used.shape[0] * used.any(axis=0).sum())


def _used_slots(slots: np.ndarray, phases: int) -> np.ndarray:
  """bool ``[phases, 3]``: which (phase, slot) any step uses."""
  used = np.zeros((phases, _SLOTS), bool)
  within = slots % (_SLOTS * phases)
  used.reshape(-1)[np.unique(within)] = True
  return used


def choose_phases(kind, worker, mix, members, mixes, num_workers) -> tuple[int, np.ndarray]:
  """The phases per step that minimize ``steps * (1 + slot cost * slot passes)``, and its placement."""
  best = None
  for phases in _PHASE_CANDIDATES:
    slots = place_events(kind, worker, mix, members, mixes, num_workers, phases)
    steps = int(slots.max()) // (_SLOTS * phases) + 1 if slots.size else 1
    cost = steps * (1.0 + _SLOT_COST * _slot_passes(_used_slots(slots, phases)))
    if best is None or cost < best[0] - 1e-9:
      best = (cost, phases, slots)
  return best[1], best[2]


class ReplicaPlan(NamedTuple):
  """Everything the compiled step needs, as per-step NumPy tables (leading axis: steps).

  ``lane_*`` ``[S, M]``: the gradient each replica computes at the start of a step: ``lane_active``,
  ``lane_index`` (the replica's gradient count), ``lane_draw`` (the replica's number of its first
  minibatch), ``lane_batches`` (minibatches, 0 when inactive). ``grad_*`` ``[S, P, M]``: ``grad_mask``,
  ``grad_dt`` (time since the replica's previous GRAD or MIX), ``grad_hist`` (history slot written).
  ``read_mask`` ``[S, P, M]``. Mixes ``[S, P, M, K]``: ``mix_weight`` (per offset for ``"shift"``, per
  source for ``"gather"`` with its ``mix_src``, per replica for ``"dense"``); ``[S, P, M]``:
  ``mix_recv``, ``mix_self`` (own weight), ``mix_member`` (advanced to the event's time), ``mix_dt``,
  ``mix_hist``; ``gmix_*`` likewise for mixes of gradients.
  ``step_time``, ``step_events``, ``step_grads`` ``[S]``: simulated time reached, events and GRAD events
  done after each step.
  """

  num_steps: int
  phases: int
  used: np.ndarray  # bool [P, 3]
  mixing: str  # "shift", "gather" or "dense"
  shifts: tuple[int, ...]  # the offsets of "shift" mixing
  width: int  # K: entries of a mixing row
  history: int  # H: past messages kept per replica (1: none)
  has_pmix: bool
  has_gmix: bool
  max_batches: int
  tables: dict[str, np.ndarray]
  lane_utilization: float


def make_plan(schedule: Any, *, phases: int | None = None) -> ReplicaPlan:
  """Packs ``schedule`` (a ``GossipSchedule``) into steps (see the module docstring)."""
  kind = np.asarray(schedule.kind)
  worker = np.asarray(schedule.worker)
  mix = np.asarray(schedule.mix)
  members = np.asarray(schedule.members)
  mixes = np.asarray(schedule.mixes)
  time = np.asarray(schedule.time)
  m = schedule.num_workers
  if phases is None:
    phases, slots = choose_phases(kind, worker, mix, members, mixes, m)
  else:
    slots = place_events(kind, worker, mix, members, mixes, m, phases)
  block = _SLOTS * phases
  num_steps = int(slots.max()) // block + 1 if slots.size else 1
  used = _used_slots(slots, phases)
  step_of = slots // block
  phase_of = (slots % block) // _SLOTS

  is_mix = kind == MIX
  event_mixes = np.where(is_mix, mixes[np.maximum(mix, 0)] if mixes.size else -1, -1)
  pmix = is_mix & (event_mixes != GRADS)
  gmix = is_mix & (event_mixes == GRADS)
  group = max(1, members.shape[1])
  mixing, shifts = mixing_form(schedule)
  dense = mixing == "dense"
  width = {"shift": len(shifts), "gather": group, "dense": m}[mixing]
  shift_index = {s_: j for j, s_ in enumerate(shifts)}
  lags = np.asarray(schedule.lag)
  history = int(lags[mixes != GRADS].max()) + 1 if pmix.any() and lags.size else 1
  batches = np.asarray(schedule.num_batches)
  max_batches = int(batches[kind == READ].max()) if np.any(kind == READ) else 1
  draws = np.asarray(schedule.batch_index())

  t = {
      "lane_active": np.zeros((num_steps, m), bool),
      "lane_index": np.zeros((num_steps, m), np.int32),
      "lane_draw": np.zeros((num_steps, m), np.int32),
      "lane_batches": np.zeros((num_steps, m), np.int32),
      "grad_mask": np.zeros((num_steps, phases, m), bool),
      "grad_dt": np.zeros((num_steps, phases, m), np.float32),
      "grad_hist": np.zeros((num_steps, phases, m), np.int32),
      "read_mask": np.zeros((num_steps, phases, m), bool),
  }
  for prefix, present in (("mix", pmix.any()), ("gmix", gmix.any())):
    if not present:
      continue
    if mixing == "gather":
      t[f"{prefix}_src"] = np.tile(np.arange(m, dtype=np.int32)[:, None], (num_steps, phases, 1, width))
    t[f"{prefix}_weight"] = np.zeros((num_steps, phases, m, width), np.float32)
    t[f"{prefix}_recv"] = np.zeros((num_steps, phases, m), bool)
    if prefix == "mix":
      t["mix_self"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_member"] = np.zeros((num_steps, phases, m), bool)
      t["mix_dt"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_hist"] = np.zeros((num_steps, phases, m), np.int32)

  # A read's gradient is computed only if something uses it: its GRAD, or a mix of pending gradients.
  needed = np.zeros(kind.shape[0], bool)
  wanted = np.zeros(m, bool)
  for e in range(kind.shape[0] - 1, -1, -1):
    if kind[e] == GRAD:
      wanted[worker[e]] = True
    elif kind[e] == READ:
      needed[e], wanted[worker[e]] = wanted[worker[e]], False
    elif gmix[e]:
      group_e = members[mix[e]]
      wanted[group_e[group_e >= 0]] = True
  version = np.zeros(m, np.int64)
  last_time = np.zeros(m, np.float64)
  reads_done = np.zeros(m, np.int64)
  weights = np.asarray(schedule.weights)
  receives = np.asarray(schedule.receives)
  for e in range(kind.shape[0]):
    s, p, k = int(step_of[e]), int(phase_of[e]), kind[e]
    if k == READ:
      r = int(worker[e])
      t["read_mask"][s, p, r] = True
      if needed[e]:
        # The replica's lane computes it at the start of the next step.
        t["lane_active"][s + 1, r] = True
        t["lane_index"][s + 1, r] = reads_done[r]
        t["lane_draw"][s + 1, r] = draws[e]
        t["lane_batches"][s + 1, r] = batches[e]
      reads_done[r] += 1
    elif k == GRAD:
      r = int(worker[e])
      t["grad_mask"][s, p, r] = True
      t["grad_dt"][s, p, r] = time[e] - last_time[r]
      last_time[r] = time[e]
      version[r] += 1
      t["grad_hist"][s, p, r] = version[r] % history
    else:
      k_mix = mix[e]
      row = members[k_mix]
      valid = row >= 0
      group_e = row[valid]
      w = weights[k_mix][np.ix_(valid, valid)]
      recv = receives[k_mix][valid]
      prefix = "mix" if pmix[e] else "gmix"
      before = version[group_e].copy()
      for a, dst in enumerate(group_e):
        if not recv[a]:
          continue
        t[f"{prefix}_recv"][s, p, dst] = True
        if mixing == "dense":
          # Sources with a lag are not supported densely (checked by the runtime).
          t[f"{prefix}_weight"][s, p, dst, group_e] = w[a]
        elif mixing == "shift":
          for b, src in enumerate(group_e):
            if w[a, b] != 0:
              t[f"{prefix}_weight"][s, p, dst, shift_index[(src - dst) % m]] = w[a, b]
        else:
          for b, src in enumerate(group_e):
            lag = int(lags[k_mix, b]) if pmix[e] else 0
            if lag == 0:
              t[f"{prefix}_src"][s, p, dst, b] = src
            else:
              t[f"{prefix}_src"][s, p, dst, b] = m + src * history + (before[b] - lag) % history
            t[f"{prefix}_weight"][s, p, dst, b] = w[a, b]
          t[f"{prefix}_weight"][s, p, dst, len(group_e):] = 0.0
      if pmix[e]:
        t["mix_self"][s, p, group_e] = np.diag(w)
        t["mix_member"][s, p, group_e] = True
        t["mix_dt"][s, p, group_e] = time[e] - last_time[group_e]
        last_time[group_e] = time[e]
        version[group_e[recv]] += 1
        t["mix_hist"][s, p, group_e] = version[group_e] % history

  step_time = np.zeros(num_steps)
  np.maximum.at(step_time, step_of, time)
  step_time = np.maximum.accumulate(step_time)
  step_events = np.cumsum(np.bincount(step_of, minlength=num_steps)).astype(np.int64)
  step_grads = np.cumsum(np.bincount(step_of[kind == GRAD], minlength=num_steps)).astype(np.int64)
  t["step_time"], t["step_events"], t["step_grads"] = step_time, step_events, step_grads
  active = t["lane_active"].sum()
  return ReplicaPlan(num_steps, phases, used, mixing, shifts, width, history, bool(pmix.any()), bool(gmix.any()),
                     max_batches, t, float(active) / max(1, num_steps * m))
