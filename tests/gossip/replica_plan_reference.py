"""The replica planner of ``dj.simulate_gossip`` as it was written first, one event at a time in Python.

``delayjax/runtime/_replica_plan.py`` computes the same plan with array
operations; ``test_replica_plan_vectorized.py`` asserts that both give
identical plans, and ``experiments/bench_planning.py`` times one against the
other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from delayjax.cluster._gossip import GRAD, GRADS, MIX, READ
from delayjax.runtime._replica_plan import (_LANE_FRACTIONS, _PHASE_CANDIDATES, _SLOT_COST, _SLOTS, SLOT_GRAD,
                                            SLOT_MIX, SLOT_READ, ReplicaPlan, mixing_forms)


def needed_reads(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray, mixes: np.ndarray,
                 num_workers: int) -> np.ndarray:
  """bool ``[E]``: which ``READ`` events' gradients something uses (their ``GRAD``, or a mix of gradients)."""
  needed = np.zeros(kind.shape[0], bool)
  wanted = np.zeros(num_workers, bool)
  for e in range(kind.shape[0] - 1, -1, -1):
    if kind[e] == GRAD:
      wanted[worker[e]] = True
    elif kind[e] == READ:
      needed[e], wanted[worker[e]] = wanted[worker[e]], False
    elif mixes[mix[e]] == GRADS:
      group = members[mix[e]]
      wanted[group[group >= 0]] = True
  return needed


def place_events(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray,
                 mixes: np.ndarray, needed: np.ndarray, num_workers: int, phases: int, lanes: int,
                 num_devices: int) -> tuple[np.ndarray, np.ndarray]:
  """Each event's global slot ``(step * phases + phase) * 3 + slot`` (int64 ``[E]``), and for each needed
  ``READ`` the step whose lanes compute its gradient (``-1`` elsewhere).

  A gradient is computed in the first step after its read with a free lane among the ``lanes`` of its
  replica's device (replicas ``d * M / D .. (d + 1) * M / D - 1`` are device ``d``'s); its ``GRAD`` (and a
  mix of it) comes in that step or later.
  """
  block = _SLOTS * phases
  per_device = num_workers // num_devices
  last = [-1] * num_workers
  ready = [0] * num_workers  # the first step at which the replica's pending gradient is computed
  busy: dict[tuple[int, int], int] = {}
  out = np.empty(kind.shape[0], np.int64)
  lane_step = np.full(kind.shape[0], -1, np.int64)
  member_lists = [row[row >= 0].tolist() for row in members]
  for e in range(kind.shape[0]):
    k = kind[e]
    if k == MIX:
      group = member_lists[mix[e]]
      after = max(last[q] for q in group)
      if mixes[mix[e]] == GRADS:
        after = max(after, max(ready[q] * block - 1 for q in group))
      slot = after + 1 + (SLOT_MIX - after - 1) % _SLOTS
      for q in group:
        last[q] = slot
    else:
      r = int(worker[e])
      after = last[r]
      if k == GRAD:
        after = max(after, ready[r] * block - 1)
        slot = after + 1 + (SLOT_GRAD - after - 1) % _SLOTS
      else:
        slot = after + 1 + (SLOT_READ - after - 1) % _SLOTS
        if needed[e]:
          step, device = slot // block + 1, r // per_device
          while busy.get((step, device), 0) >= lanes:
            step += 1
          busy[(step, device)] = busy.get((step, device), 0) + 1
          lane_step[e] = ready[r] = step
      last[r] = slot
    out[e] = slot
  return out, lane_step


def _slot_passes(used: np.ndarray) -> int:
  """Slot passes per step: every phase runs each slot kind that any phase uses."""
  return int(used.shape[0] * used.any(axis=0).sum())


def _used_slots(slots: np.ndarray, phases: int) -> np.ndarray:
  """bool ``[phases, 3]``: which (phase, slot) any step uses."""
  used = np.zeros((phases, _SLOTS), bool)
  within = slots % (_SLOTS * phases)
  used.reshape(-1)[np.unique(within)] = True
  return used


def _placement_cost(slots: np.ndarray, lane_step: np.ndarray, phases: int, lanes: int, num_devices: int,
                    num_workers: int) -> tuple[float, int]:
  steps = max(int(slots.max()) // (_SLOTS * phases), int(lane_step.max())) + 1 if slots.size else 1
  return steps * (lanes * num_devices / num_workers + _SLOT_COST * _slot_passes(_used_slots(slots, phases))), steps


def choose_placement(kind, worker, mix, members, mixes, needed, num_workers, num_devices, phases=None):
  """The phases per step and lanes per device that minimize ``steps * (lanes / M + slot cost * slot
  passes)`` (first the phases with a lane for every replica, then fewer lanes), and the placement."""
  per_device = num_workers // num_devices
  args = (kind, worker, mix, members, mixes, needed, num_workers)
  best = None
  for p in _PHASE_CANDIDATES if phases is None else (phases,):
    slots, lane_step = place_events(*args, p, per_device, num_devices)
    cost, _ = _placement_cost(slots, lane_step, p, per_device, num_devices, num_workers)
    if best is None or cost < best[0] - 1e-9:
      best = (cost, p, per_device, slots, lane_step)
  p = best[1]
  for fraction in _LANE_FRACTIONS:
    lanes = max(1, -(-per_device * fraction // 100))
    if lanes >= per_device:
      continue
    slots, lane_step = place_events(*args, p, lanes, num_devices)
    cost, _ = _placement_cost(slots, lane_step, p, lanes, num_devices, num_workers)
    if cost < best[0] - 1e-9:
      best = (cost, p, lanes, slots, lane_step)
  return best[1:]


def make_plan(schedule: Any, *, phases: int | None = None, num_devices: int = 1) -> ReplicaPlan:
  """Packs ``schedule`` (a ``GossipSchedule``) into steps for ``num_devices`` (see the module docstring)."""
  kind = np.asarray(schedule.kind)
  worker = np.asarray(schedule.worker)
  mix = np.asarray(schedule.mix)
  members = np.asarray(schedule.members)
  mixes = np.asarray(schedule.mixes)
  time = np.asarray(schedule.time)
  m = schedule.num_workers
  needed = needed_reads(kind, worker, mix, members, mixes, m)
  phases, lanes, slots, lane_step = choose_placement(kind, worker, mix, members, mixes, needed, m, num_devices,
                                                     phases)
  block = _SLOTS * phases
  num_steps = max(int(slots.max()) // block, int(lane_step.max())) + 1 if slots.size else 1
  used = _used_slots(slots, phases)
  step_of = slots // block
  phase_of = (slots % block) // _SLOTS

  is_mix = kind == MIX
  event_mixes = np.where(is_mix, mixes[np.maximum(mix, 0)] if mixes.size else -1, -1)
  pmix = is_mix & (event_mixes != GRADS)
  gmix = is_mix & (event_mixes == GRADS)
  forms = mixing_forms(schedule)
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
    if forms[prefix].name == "gather":
      t[f"{prefix}_src"] = np.tile(np.arange(m, dtype=np.int32)[:, None], (num_steps, phases, 1, forms[prefix].width))
    t[f"{prefix}_weight"] = np.zeros((num_steps, phases, m, forms[prefix].width), np.float32)
    t[f"{prefix}_recv"] = np.zeros((num_steps, phases, m), bool)
    if prefix == "mix":
      t["mix_self"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_member"] = np.zeros((num_steps, phases, m), bool)
      t["mix_dt"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_hist"] = np.zeros((num_steps, phases, m), np.int32)

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
        # A lane computes it at the start of its lane step.
        q = lane_step[e]
        t["lane_active"][q, r] = True
        t["lane_index"][q, r] = reads_done[r]
        t["lane_draw"][q, r] = draws[e]
        t["lane_batches"][q, r] = batches[e]
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
      form = forms[prefix]
      before = version[group_e].copy()
      for a, dst in enumerate(group_e):
        if not recv[a]:
          continue
        t[f"{prefix}_recv"][s, p, dst] = True
        if form.name == "dense":
          # Sources with a lag are not supported densely (checked by the runtime).
          t[f"{prefix}_weight"][s, p, dst, group_e] = w[a]
        elif form.name == "shift":
          for b, src in enumerate(group_e):
            if w[a, b] != 0:
              t[f"{prefix}_weight"][s, p, dst, form.shifts.index((src - dst) % m)] = w[a, b]
        else:
          # The sources of nonzero weight, in group order, one column each.
          column = 0
          for b, src in enumerate(group_e):
            if w[a, b] == 0:
              continue
            lag = int(lags[k_mix, b]) if pmix[e] else 0
            if lag == 0:
              t[f"{prefix}_src"][s, p, dst, column] = src
            else:
              t[f"{prefix}_src"][s, p, dst, column] = m + src * history + (before[b] - lag) % history
            t[f"{prefix}_weight"][s, p, dst, column] = w[a, b]
            column += 1
          t[f"{prefix}_weight"][s, p, dst, column:] = 0.0
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
  return ReplicaPlan(num_steps, phases, lanes, used, forms, history, bool(pmix.any()), bool(gmix.any()), max_batches,
                     t, float(t["lane_active"].sum()) / (num_steps * lanes * num_devices))
