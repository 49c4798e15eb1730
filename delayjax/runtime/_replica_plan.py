"""Host planning of the replica runtime: a gossip schedule's events packed into steps of parallel slots.

A *step* first computes, in ``K`` *lanes* per device, gradients of earlier
``READ`` events at the parameters those reads stored (each in the first
step after its read with a free lane on its replica's device). It then runs
``P`` *phases*, each a fixed sequence of three *slots*:

- ``MIX``: mixing events on disjoint sets of replicas, as one table of rows
  (each receiving replica: its sources, weights and message lags);
- ``GRAD``: gradient events of distinct replicas (their gradients were
  computed at the start of this step or an earlier one);
- ``READ``: reads of distinct replicas (their gradients are computed at the
  start of a later step).

The compiled step scans one phase over the ``P`` phases, so it compiles one
phase whatever ``P`` is; a slot kind that no phase of any step uses is left
out of it.

Events are placed one by one in the schedule's order, each in the earliest
slot of its kind after the last slot of every replica it touches (and, for a
``GRAD`` or a ``GRADS`` mix, no earlier than the step that computes its
gradient). ``P`` and ``K`` are chosen to minimize the steps times their
cost (lanes, plus a tenth of a lane set per slot pass). Events of disjoint
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
_PHASE_CANDIDATES = (1, 2, 4)
# Lanes per device tried, in percent of its replicas.
_LANE_FRACTIONS = (50, 25)
# Mixes in which a receiver takes more nonzero weights than this are applied as a dense [M, M] matrix product
# instead of a gather.
DENSE_WIDTH = 8
# Mixes whose sources sit at no more than this many fixed offsets (b - a) mod M move by whole-axis rolls.
MAX_SHIFTS = 4


class MixForm(NamedTuple):
  """How the compiled step combines one kind of mix (of parameters, or of gradients): ``name`` ``"shift"``
  (a row per offset: whole-axis rolls), ``"gather"`` (a row per source) or ``"dense"`` (a row per replica);
  ``shifts``, the offsets of ``"shift"``; ``width``, the entries of a receiver's row."""

  name: str
  shifts: tuple[int, ...]
  width: int


def mixing_forms(schedule: Any, *like: Any) -> dict[str, MixForm]:
  """How the runtime combines the messages of the schedule's mixes, by table prefix: ``"mix"``, its mixes of
  parameters; ``"gmix"``, its mixes of gradients. Each kind is ``"shift"`` when every nonzero weight of every
  such mix sits at one of at most ``MAX_SHIFTS`` offsets ``(b - a) mod M`` and no message is late (rolls, or
  ``lax.ppermute`` on a mesh); else ``"gather"`` when no receiver takes more than ``DENSE_WIDTH`` nonzero
  weights (its row lists those sources, in their order in the mix's group), and ``"dense"`` (an ``[M, M]``
  matrix per slot) when one does. With ``like`` (more schedules of the same replicas), the forms that fit
  every one of them.

  The two kinds are planned apart: a program shared by an all-reduce of gradients (16 sources per receiver:
  dense) and gossip of parameters (a ring's 3: gathered) combines each kind as narrowly as it can. A row
  counts a receiver's nonzero weights, not its group's members: a ring's mix of all 16 replicas gives each
  receiver 3 sources."""
  m = schedule.num_workers
  found = {"mix": {0}, "gmix": {0}}
  widest = {"mix": 0, "gmix": 0}
  late = False
  for s in (schedule, *like):
    members = np.asarray(s.members)
    if members.shape[0] == 0:
      continue
    gradients = np.asarray(s.mixes) == GRADS
    valid = members >= 0
    used = (np.asarray(s.weights) != 0) & valid[:, :, None] & valid[:, None, :] & np.asarray(s.receives)[:, :, None]
    offsets = (members[:, None, :] - members[:, :, None]) % m
    sources = used.sum(axis=2).max(axis=1, initial=0)
    for prefix, of_kind in (("mix", ~gradients), ("gmix", gradients)):
      found[prefix] |= set(np.unique(offsets[used & of_kind[:, None, None]]).tolist())
      widest[prefix] = max(widest[prefix], int(sources[of_kind].max(initial=0)))
    late |= bool(np.any(np.asarray(s.lag)[~gradients] > 0))
  forms = {}
  for prefix in ("mix", "gmix"):
    if len(found[prefix]) <= MAX_SHIFTS and not (late and prefix == "mix"):
      forms[prefix] = MixForm("shift", tuple(sorted(found[prefix])), len(found[prefix]))
    elif widest[prefix] > DENSE_WIDTH:
      forms[prefix] = MixForm("dense", (), m)
    else:
      forms[prefix] = MixForm("gather", (), max(widest[prefix], 1))
  return forms


def _program_choices(schedule: Any) -> tuple[bool, bool, int, int]:
  """What a schedule asks of the compiled step beyond its mixing form: whether it has mixes of parameters
  and of gradients, the messages each replica keeps (the largest lag of a mix of parameters, plus one) and
  the most minibatches of one gradient."""
  kind, mix, mixes = np.asarray(schedule.kind), np.asarray(schedule.mix), np.asarray(schedule.mixes)
  event_mixes = mixes[mix[kind == MIX]] if mixes.size else np.zeros(0, np.int64)
  has_pmix, has_gmix = bool(np.any(event_mixes != GRADS)), bool(np.any(event_mixes == GRADS))
  lags = np.asarray(schedule.lag)
  history = int(lags[mixes != GRADS].max()) + 1 if has_pmix and lags.size else 1
  reads = kind == READ
  max_batches = int(np.asarray(schedule.num_batches)[reads].max()) if np.any(reads) else 1
  return has_pmix, has_gmix, history, max_batches


def needed_reads(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray, mixes: np.ndarray,
                 num_workers: int) -> np.ndarray:
  """bool ``[E]``: which ``READ`` events' gradients something uses (their ``GRAD``, or a mix of gradients).

  A read is needed when the replica's next ``READ``, ``GRAD`` or mix of
  gradients after it is not a ``READ``.
  """
  touch_event, touch_replica, _ = _touches(kind, worker, mix, members, mixes, (READ, GRAD), (GRADS,))
  # Touches are in event order: a stable sort by replica keeps it within each replica.
  by_replica = np.argsort(touch_replica, kind="stable")
  events, replicas = touch_event[by_replica], touch_replica[by_replica]
  is_read = kind[events] == READ
  follows = np.zeros(events.size, bool)  # the replica's next touch exists and is no READ
  follows[:-1] = (replicas[1:] == replicas[:-1]) & ~is_read[1:]
  needed = np.zeros(kind.shape[0], bool)
  needed[events[is_read]] = follows[is_read]
  return needed


def _touches(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray, mixes: np.ndarray,
             kinds: tuple[int, ...], mix_kinds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The (event, replica) pairs of the events of ``kinds`` (their replica) and of the mixes of
  ``mix_kinds`` (each valid member), in event order, members in row order; and each pair's position
  among its mix's valid members (0 for the others)."""
  single = np.flatnonzero(np.isin(kind, kinds))
  is_mix = (kind == MIX) & np.isin(mixes[np.maximum(mix, 0)] if mixes.size else np.zeros_like(mix), mix_kinds)
  mixed = np.flatnonzero(is_mix)
  rows = members[mix[mixed]] if mixed.size else np.zeros((0, 1), np.int64)
  valid = rows >= 0
  position = np.cumsum(valid, axis=1) - 1
  mix_event = np.broadcast_to(mixed[:, None], rows.shape)[valid]
  event = np.concatenate([single, mix_event])
  replica = np.concatenate([worker[single], rows[valid]]).astype(np.int64)
  pos = np.concatenate([np.zeros(single.size, np.int64), position[valid]])
  order = np.argsort(event, kind="stable")
  return event[order], replica[order], pos[order]


def _event_lists(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray,
                 mixes: np.ndarray) -> tuple[list[Any], list[Any], list[Any]]:
  """Per event, as Python lists for the placement loop: its kind, its replica (or its mix's valid members)
  and whether it is a mix of gradients."""
  member_lists = [[q for q in row if q >= 0] for row in members.tolist()]
  mix_l = mix.tolist()
  kind_l = kind.tolist()
  mixes_l = mixes.tolist()
  worker_l = worker.tolist()
  who = [member_lists[mix_l[e]] if k == MIX else worker_l[e] for e, k in enumerate(kind_l)]
  grads = [k == MIX and mixes_l[mix_l[e]] == GRADS for e, k in enumerate(kind_l)]
  return kind_l, who, grads


def place_events(kind: np.ndarray, worker: np.ndarray, mix: np.ndarray, members: np.ndarray,
                 mixes: np.ndarray, needed: np.ndarray, num_workers: int, phases: int, lanes: int,
                 num_devices: int, events: tuple[list[Any], list[Any], list[Any]] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Each event's global slot ``(step * phases + phase) * 3 + slot`` (int64 ``[E]``), and for each needed
  ``READ`` the step whose lanes compute its gradient (``-1`` elsewhere).

  A gradient is computed in the first step after its read with a free lane among the ``lanes`` of its
  replica's device (replicas ``d * M / D .. (d + 1) * M / D - 1`` are device ``d``'s); its ``GRAD`` (and a
  mix of it) comes in that step or later. ``events``: :func:`_event_lists`, when already built.
  """
  block = _SLOTS * phases
  per_device = num_workers // num_devices
  kind_l, who, grads = _event_lists(kind, worker, mix, members, mixes) if events is None else events
  needed_l = needed.tolist()
  last = [-1] * num_workers
  ready = [0] * num_workers  # the first step at which the replica's pending gradient is computed
  stride = (num_workers - 1) // per_device + 1  # devices, counting a remainder of replicas as more
  busy: dict[int, int] = {}  # (step * stride + device) -> lanes taken
  out = [0] * len(kind_l)
  lane_step = [-1] * len(kind_l)
  for e, k in enumerate(kind_l):
    if k == MIX:
      group = who[e]
      after = max([last[q] for q in group])
      if grads[e]:
        after = max(after, max([ready[q] for q in group]) * block - 1)
      slot = after + 1 + (SLOT_MIX - after - 1) % _SLOTS
      for q in group:
        last[q] = slot
    else:
      r = who[e]
      after = last[r]
      if k == GRAD:
        after = max(after, ready[r] * block - 1)
        slot = after + 1 + (SLOT_GRAD - after - 1) % _SLOTS
      else:
        slot = after + 1 + (SLOT_READ - after - 1) % _SLOTS
        if needed_l[e]:
          device = r // per_device
          key = (slot // block + 1) * stride + device
          while busy.get(key, 0) >= lanes:
            key += stride
          busy[key] = busy.get(key, 0) + 1
          lane_step[e] = ready[r] = key // stride
      last[r] = slot
    out[e] = slot
  return np.asarray(out, np.int64), np.asarray(lane_step, np.int64)


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


def choose_placement(kind, worker, mix, members, mixes, needed, num_workers, num_devices, phases=None,
                     every_lane=False):
  """The phases per step and lanes per device that minimize ``steps * (lanes / M + slot cost * slot
  passes)`` (first the phases with a lane for every replica, then fewer lanes; only the first with
  ``every_lane``), and the placement."""
  per_device = num_workers // num_devices
  args = (kind, worker, mix, members, mixes, needed, num_workers)
  events = _event_lists(kind, worker, mix, members, mixes)
  best = None
  for p in _PHASE_CANDIDATES if phases is None else (phases,):
    slots, lane_step = place_events(*args, p, per_device, num_devices, events)
    cost, _ = _placement_cost(slots, lane_step, p, per_device, num_devices, num_workers)
    if best is None or cost < best[0] - 1e-9:
      best = (cost, p, per_device, slots, lane_step)
  p = best[1]
  for fraction in () if every_lane else _LANE_FRACTIONS:
    lanes = max(1, -(-per_device * fraction // 100))
    if lanes >= per_device:
      continue
    slots, lane_step = place_events(*args, p, lanes, num_devices, events)
    cost, _ = _placement_cost(slots, lane_step, p, lanes, num_devices, num_workers)
    if cost < best[0] - 1e-9:
      best = (cost, p, lanes, slots, lane_step)
  return best[1:]


def _valid_column(members: np.ndarray, mix: np.ndarray, position: np.ndarray) -> np.ndarray:
  """The column of ``members[mix]`` holding its ``position``-th valid (non-negative) member."""
  if not mix.size:
    return np.zeros(0, np.int64)
  column = np.argsort(members[mix] < 0, axis=1, kind="stable")
  return column[np.arange(mix.size), position]


def pack_lanes(tables: dict[str, np.ndarray], num_devices: int, lanes: int) -> dict[str, np.ndarray]:
  """The ``[S, M]`` lane tables packed into ``[S, D * K]``: each device's ``K`` = ``lanes`` lanes compute
  the gradients of its own replicas that are due (the placement gives no device more in a step).

  Adds ``lane_replica`` (the replica's index on its device) and ``lane_worker`` (its global index); lanes
  beyond a device's due gradients are inactive.
  """
  active = tables["lane_active"]
  steps, m = active.shape
  block = m // num_devices
  per_device = active.reshape(steps, num_devices, block)
  # Due replicas first, in replica order.
  order = np.argsort(~per_device, axis=2, kind="stable")[:, :, :lanes]
  out = {"lane_replica": order.reshape(steps, -1).astype(np.int32),
         "lane_worker": (order + block * np.arange(num_devices)[None, :, None]).reshape(steps, -1).astype(np.int32)}
  for name in ("lane_active", "lane_index", "lane_draw", "lane_batches"):
    values = tables[name].reshape(steps, num_devices, block)
    out[name] = np.take_along_axis(values, order, axis=2).reshape(steps, -1)
  return out


class ReplicaPlan(NamedTuple):
  """Everything the compiled step needs, as per-step NumPy tables (leading axis: steps).

  ``lane_*`` ``[S, M]``: the gradient each replica computes at the start of a step (the runtime packs the
  active ones into fewer lanes, see :func:`pack_lanes`): ``lane_active``,
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
  lanes: int  # gradients computed per device per step
  used: np.ndarray  # bool [P, 3]
  forms: dict[str, MixForm]  # by table prefix: "mix" (mixes of parameters), "gmix" (of gradients)
  history: int  # H: past messages kept per replica (1: none)
  has_pmix: bool
  has_gmix: bool
  max_batches: int
  tables: dict[str, np.ndarray]
  lane_utilization: float


def make_plan(schedule: Any, *, phases: int | None = None, num_devices: int = 1, like: tuple[Any, ...] = ()
              ) -> ReplicaPlan:
  """Packs ``schedule`` (a ``GossipSchedule``) into steps for ``num_devices`` (see the module docstring).

  ``like``: more schedules of the same replicas whose plans are to compile to the same step. The choices
  that shape the step then fit all of them rather than ``schedule`` alone: the mixing forms and their widths,
  the mixes present, the messages kept, the minibatches per gradient; every slot kind is compiled and
  every replica has a lane (``phases`` is still chosen per schedule unless given).
  """
  kind = np.asarray(schedule.kind)
  worker = np.asarray(schedule.worker)
  mix = np.asarray(schedule.mix)
  members = np.asarray(schedule.members)
  mixes = np.asarray(schedule.mixes)
  time = np.asarray(schedule.time)
  m = schedule.num_workers
  needed = needed_reads(kind, worker, mix, members, mixes, m)
  phases, lanes, slots, lane_step = choose_placement(kind, worker, mix, members, mixes, needed, m, num_devices,
                                                     phases, every_lane=bool(like))
  block = _SLOTS * phases
  num_steps = max(int(slots.max()) // block, int(lane_step.max())) + 1 if slots.size else 1
  used = np.ones((phases, _SLOTS), bool) if like else _used_slots(slots, phases)
  step_of = slots // block
  phase_of = (slots % block) // _SLOTS

  is_mix = kind == MIX
  event_mixes = np.where(is_mix, mixes[np.maximum(mix, 0)] if mixes.size else -1, -1)
  pmix = is_mix & (event_mixes != GRADS)
  gmix = is_mix & (event_mixes == GRADS)
  forms = mixing_forms(schedule, *like)
  choices = [_program_choices(s) for s in (schedule, *like)]
  has_pmix, has_gmix = any(c[0] for c in choices), any(c[1] for c in choices)
  history = max(c[2] for c in choices)
  max_batches = max(c[3] for c in choices)

  t = _empty_tables(num_steps, phases, m, forms, has_pmix, has_gmix)
  _fill_reads(t, schedule, kind, worker, needed, lane_step, step_of, phase_of, m)
  before = _fill_updates(t, schedule, kind, worker, mix, members, mixes, step_of, phase_of, history,
                         gather=forms["mix"].name == "gather")
  for prefix, events in (("mix", np.flatnonzero(pmix)), ("gmix", np.flatnonzero(gmix))):
    if events.size:
      _fill_mix_rows(t, prefix, events, schedule, step_of, phase_of, forms[prefix], history, before)

  step_time = np.zeros(num_steps)
  np.maximum.at(step_time, step_of, time)
  step_time = np.maximum.accumulate(step_time)
  step_events = np.cumsum(np.bincount(step_of, minlength=num_steps)).astype(np.int64)
  step_grads = np.cumsum(np.bincount(step_of[kind == GRAD], minlength=num_steps)).astype(np.int64)
  t["step_time"], t["step_events"], t["step_grads"] = step_time, step_events, step_grads
  return ReplicaPlan(num_steps, phases, lanes, used, forms, history, has_pmix, has_gmix,
                     max_batches, t,
                     float(t["lane_active"].sum()) / (num_steps * lanes * num_devices))


def _empty_tables(num_steps: int, phases: int, m: int, forms: dict[str, MixForm], has_pmix: bool,
                  has_gmix: bool) -> dict[str, np.ndarray]:
  """The plan's tables (see :class:`ReplicaPlan`), every slot empty; mixing tables only for the mixes present."""
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
  for prefix, present in (("mix", has_pmix), ("gmix", has_gmix)):
    if not present:
      continue
    width = forms[prefix].width
    if forms[prefix].name == "gather":
      t[f"{prefix}_src"] = np.tile(np.arange(m, dtype=np.int32)[:, None], (num_steps, phases, 1, width))
    t[f"{prefix}_weight"] = np.zeros((num_steps, phases, m, width), np.float32)
    t[f"{prefix}_recv"] = np.zeros((num_steps, phases, m), bool)
    if prefix == "mix":
      t["mix_self"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_member"] = np.zeros((num_steps, phases, m), bool)
      t["mix_dt"] = np.zeros((num_steps, phases, m), np.float32)
      t["mix_hist"] = np.zeros((num_steps, phases, m), np.int32)
  return t


def _fill_reads(t: dict[str, np.ndarray], schedule: Any, kind: np.ndarray, worker: np.ndarray, needed: np.ndarray,
                lane_step: np.ndarray, step_of: np.ndarray, phase_of: np.ndarray, m: int) -> None:
  """The reads' slots, and each needed read's gradient in a lane of its lane step, as the replica's
  ``reads_done``-th gradient."""
  batches = np.asarray(schedule.num_batches)
  draws = np.asarray(schedule.batch_index())
  reads = np.flatnonzero(kind == READ)
  t["read_mask"][step_of[reads], phase_of[reads], worker[reads]] = True
  read_replica = worker[reads]
  by_replica = np.argsort(read_replica, kind="stable")
  counts = np.bincount(read_replica, minlength=m)
  reads_done = np.empty(reads.size, np.int64)
  reads_done[by_replica] = np.arange(reads.size) - np.repeat(np.cumsum(counts) - counts, counts)
  lanes_used = needed[reads]
  e, r = reads[lanes_used], read_replica[lanes_used]
  q = lane_step[e]
  t["lane_active"][q, r] = True
  t["lane_index"][q, r] = reads_done[lanes_used]
  t["lane_draw"][q, r] = draws[e]
  t["lane_batches"][q, r] = batches[e]


def _fill_updates(t: dict[str, np.ndarray], schedule: Any, kind: np.ndarray, worker: np.ndarray, mix: np.ndarray,
                  members: np.ndarray, mixes: np.ndarray, step_of: np.ndarray, phase_of: np.ndarray, history: int,
                  *, gather: bool) -> dict[tuple[int, int], int]:
  """The slots of the GRAD events and of the members of mixes of parameters: per replica in event order, the
  time since its previous one (or 0), and the replica's version (GRADs, and mixes it receives) after it.

  Returns, for ``gather`` mixing, the version of each (mix event, member position) before the mix, which
  messages sent with a lag are read at.
  """
  time = np.asarray(schedule.time)
  weights = np.asarray(schedule.weights)
  receives = np.asarray(schedule.receives)
  touch_event, touch_replica, touch_pos = _touches(kind, worker, mix, members, mixes, (GRAD,),
                                                   tuple(k for k in np.unique(mixes).tolist() if k != GRADS))
  is_grad = kind[touch_event] == GRAD
  touch_mix = np.where(is_grad, 0, mix[touch_event])
  received = is_grad | receives[touch_mix, _valid_column(members, touch_mix, touch_pos)]
  by_replica = np.argsort(touch_replica, kind="stable")
  events_r, replicas_r = touch_event[by_replica], touch_replica[by_replica]
  first_of_replica = np.ones(events_r.size, bool)
  first_of_replica[1:] = replicas_r[1:] != replicas_r[:-1]
  previous_time = np.zeros(events_r.size, np.float64)
  previous_time[~first_of_replica] = time[events_r[:-1][~first_of_replica[1:]]]
  increments = received[by_replica].astype(np.int64)
  after = np.cumsum(increments)
  starts = np.flatnonzero(first_of_replica)
  after -= np.repeat(after[starts] - increments[starts], np.diff(np.append(starts, events_r.size)))
  dt = np.empty(events_r.size, np.float64)
  dt[by_replica] = time[events_r] - previous_time
  version_after = np.empty(events_r.size, np.int64)
  version_after[by_replica] = after
  version_before = version_after - received
  cell = (step_of[touch_event], phase_of[touch_event], touch_replica)
  g = is_grad
  t["grad_mask"][tuple(x[g] for x in cell)] = True
  t["grad_dt"][tuple(x[g] for x in cell)] = dt[g]
  t["grad_hist"][tuple(x[g] for x in cell)] = version_after[g] % history
  pm = ~is_grad
  if np.any(pm):
    columns = _valid_column(members, touch_mix[pm], touch_pos[pm])
    t["mix_self"][tuple(x[pm] for x in cell)] = weights[touch_mix[pm], columns, columns]
    t["mix_member"][tuple(x[pm] for x in cell)] = True
    t["mix_dt"][tuple(x[pm] for x in cell)] = dt[pm]
    t["mix_hist"][tuple(x[pm] for x in cell)] = version_after[pm] % history
  if not (gather and np.any(pm)):
    return {}
  return {(a, b): v for a, b, v in zip(touch_event[pm].tolist(), touch_pos[pm].tolist(),
                                       version_before[pm].tolist())}


def _fill_mix_rows(t: dict[str, np.ndarray], prefix: str, events: np.ndarray, schedule: Any, step_of: np.ndarray,
                   phase_of: np.ndarray, form: MixForm, history: int, before: dict[tuple[int, int], int]) -> None:
  """The mixing rows of the mix ``events`` (``prefix`` ``"mix"`` or ``"gmix"``): for every receiving member
  ``a`` of a mix, its sources ``b`` and their weights (per offset, source or replica as ``form`` says; a
  gathered row lists the sources of nonzero weight, in their order in the group)."""
  m = schedule.num_workers
  mix = np.asarray(schedule.mix)
  members = np.asarray(schedule.members)
  weights = np.asarray(schedule.weights)
  receives = np.asarray(schedule.receives)
  lags = np.asarray(schedule.lag)
  shift_index = {s_: j for j, s_ in enumerate(form.shifts)}
  rows = members[mix[events]]
  valid = rows >= 0
  # Valid members in row order (their position a among the valid ones), and their columns in the row.
  column = np.argsort(~valid, axis=1, kind="stable")
  group = np.take_along_axis(rows, column, axis=1)
  count = valid.sum(axis=1)
  width_e = rows.shape[1]
  in_group = np.arange(width_e)[None, :] < count[:, None]
  recv = np.take_along_axis(receives[mix[events]], column, axis=1) & in_group
  ev, a = np.nonzero(recv)
  s_, p_, dst = step_of[events[ev]], phase_of[events[ev]], group[ev, a]
  t[f"{prefix}_recv"][s_, p_, dst] = True
  # Triples (receiver, source b): w[a, b] of the valid submatrix.
  pair, b = np.nonzero(in_group[ev])
  k = mix[events[ev[pair]]]
  w = weights[k, column[ev[pair], a[pair]], column[ev[pair], b]]
  src = group[ev[pair], b]
  s3, p3, d3 = s_[pair], p_[pair], dst[pair]
  if form.name == "dense":
    t[f"{prefix}_weight"][s3, p3, d3, src] = w
  elif form.name == "shift":
    nonzero = w != 0
    offset = np.asarray([shift_index[o] for o in ((src - d3) % m)[nonzero].tolist()], np.int64)
    t[f"{prefix}_weight"][s3[nonzero], p3[nonzero], d3[nonzero], offset] = w[nonzero]
  else:
    # Only the nonzero weights, each at its rank among its receiver's (the triples come receiver by receiver,
    # sources in group order): a zero weight's term adds an exact 0 to a finite sum, so leaving it out changes no
    # rounding, and a source the receiver does not take from no longer reaches it as 0 * inf = NaN.
    nonzero = np.flatnonzero(w != 0)
    pair, b, w, src, s3, p3, d3, k = (x[nonzero] for x in (pair, b, w, src, s3, p3, d3, k))
    starts = np.r_[0, np.flatnonzero(np.diff(pair)) + 1]
    rank = np.arange(pair.size) - np.repeat(starts, np.diff(np.r_[starts, pair.size]))
    value = src.astype(np.int64)
    if prefix == "mix":
      # The lag of the b-th valid member is read from the row's b-th column.
      lag = lags[k, b]
      late = np.flatnonzero(lag != 0)
      if late.size:
        event_of = events[ev[pair]][late]
        source_version = np.asarray([before[(x, y)] for x, y in zip(event_of.tolist(), b[late].tolist())],
                                    np.int64)
        value[late] = m + src[late] * history + (source_version - lag[late]) % history
    t[f"{prefix}_src"][s3, p3, d3, rank] = value
    t[f"{prefix}_weight"][s3, p3, d3, rank] = w
