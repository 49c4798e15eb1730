"""Decentralized SGD over unreliable links in model space, NumPy float64 (tests only).

Written from the rule, not from the schedule builder: each receiver keeps a
*stored copy* of every neighbour's model, overwritten by each message that
arrives; a failed link's term uses that stored copy (the common initial
model before anything arrived), and the weights stay those of the full
topology (Jeong, Zecchin, Kountouris, ICC 2022, "reuse of outdated
information", as ``dj.cluster.failures(on_failure="reuse")`` builds it).

Which messages arrive is read from the same seed's ``on_failure="drop"``
schedule, which records the failure process openly: in a D-PSGD round a lost
link ``j -> i`` is a neighbour weight set to 0, a node that is down is
missing from the round's mix; in an AD-PSGD averaging, a direction that
arrived is a receiving member, and an averaging whose two messages were both
lost leaves no mix (found here as the reuse schedule's averaging with no
counterpart at the same second).

Besides the models, each simulation returns the terms every receiver mixed:
``{receiver: {sender: (weight, version of the sender's value)}}`` per mixing
point, versions counting each replica's changes (its gradients and the mixes
it receives), the quantity a schedule's ``lag`` encodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import delayjax as dj

C = dj.cluster


def _sgd(x, v, g, lr, momentum):
  v = momentum * v + g
  return x - lr * v, v


def d_psgd_reuse(drop_schedule: C.GossipSchedule, w: np.ndarray, grad_fn: Callable, x0: np.ndarray, *, lr: float,
                 momentum: float = 0.0) -> dict:
  """D-PSGD rounds with reuse: read at the round start, mix ``W_ii x_i + sum_j W_ij copy_ij``, apply."""
  num = drop_schedule.num_workers
  x = np.tile(np.asarray(x0, np.float64), (num, 1))
  v = np.zeros_like(x)
  copy = {(i, j): x[j].copy() for i in range(num) for j in range(num) if i != j and w[i, j] > 0}
  copy_version = {key: 0 for key in copy}
  version = np.zeros(num, np.int64)
  pending: dict[int, np.ndarray] = {}
  batches = [0] * num
  terms, lost_count, link_count = [], 0, 0
  for e in range(drop_schedule.num_events):
    kind, i = int(drop_schedule.kind[e]), int(drop_schedule.worker[e])
    if kind == C.READ:
      pending[i] = np.asarray(grad_fn(x[i], i, batches[i]), np.float64)
      batches[i] += 1
    elif kind == C.GRAD:
      x[i], v[i] = _sgd(x[i], v[i], pending.pop(i), lr, momentum)
      version[i] += 1
    else:
      k = int(drop_schedule.mix[e])
      live = [int(m) for m in drop_schedule.members[k] if m >= 0]
      w_drop = drop_schedule.weights[k]
      new, round_terms = {}, {}
      for a, i in enumerate(live):
        row = {i: (w[i, i], int(version[i]))}
        total = w[i, i] * x[i]
        for j in np.flatnonzero(w[i]).tolist():
          if j == i:
            continue
          link_count += j in live
          if j in live and w_drop[a, live.index(j)] > 0:
            copy[i, j], copy_version[i, j] = x[j].copy(), int(version[j])
          else:
            lost_count += j in live
          total = total + w[i, j] * copy[i, j]
          row[j] = (w[i, j], copy_version[i, j])
        new[i], round_terms[i] = total, row
      for i, xi in new.items():
        x[i] = xi
        version[i] += 1
      terms.append(round_terms)
  return {"x": x, "terms": terms, "lost": lost_count, "links": link_count}


def _averagings(schedule: C.GossipSchedule) -> list[tuple[float, tuple[int, ...], list[int]]]:
  """The mixes of ``schedule`` grouped by (second, member set): ``(time, members, mix indices)``, in order."""
  out: list[tuple[float, tuple[int, ...], list[int]]] = []
  for e in np.flatnonzero(schedule.kind == C.MIX):
    k = int(schedule.mix[e])
    key = (float(schedule.time[e]), tuple(sorted(int(m) for m in schedule.members[k] if m >= 0)))
    if out and out[-1][:2] == key:
      out[-1][2].append(k)
    else:
      out.append((key[0], key[1], [k]))
  return out


def ad_psgd_reuse(reuse_schedule: C.GossipSchedule, drop_schedule: C.GossipSchedule, grad_fn: Callable,
                  x0: np.ndarray, *, lr: float, momentum: float = 0.0) -> dict:
  """AD-PSGD with reuse (no node outages): each averaging ``i <-> j`` sets ``x_i <- (x_i + s_ij) / 2`` and
  ``x_j <- (x_j + s_ji) / 2`` with ``s`` the arrived message or the stored copy.

  The reads, applies and averagings (times and pairs) are walked from ``reuse_schedule``; which directions
  arrived from ``drop_schedule`` (the same seed)."""
  num = reuse_schedule.num_workers
  arrivals = {}
  for t, members, ks in _averagings(drop_schedule):
    (k,) = ks
    arrivals[t, members] = {int(m): bool(r) for m, r in zip(drop_schedule.members[k], drop_schedule.receives[k])
                            if m >= 0}
  x = np.tile(np.asarray(x0, np.float64), (num, 1))
  v = np.zeros_like(x)
  copy = {(i, j): x[j].copy() for i in range(num) for j in range(num) if i != j}
  copy_version = {key: 0 for key in copy}
  version = np.zeros(num, np.int64)
  pending: dict[int, np.ndarray] = {}
  batches = [0] * num
  averagings = {(t, members): ks for t, members, ks in _averagings(reuse_schedule)}
  done = set()
  terms, both_lost = [], 0
  for e in range(reuse_schedule.num_events):
    kind, i = int(reuse_schedule.kind[e]), int(reuse_schedule.worker[e])
    if kind == C.READ:
      pending[i] = np.asarray(grad_fn(x[i], i, batches[i]), np.float64)
      batches[i] += 1
    elif kind == C.GRAD:
      x[i], v[i] = _sgd(x[i], v[i], pending.pop(i), lr, momentum)
      version[i] += 1
    else:
      k = int(reuse_schedule.mix[e])
      key = (float(reuse_schedule.time[e]), tuple(sorted(int(m) for m in reuse_schedule.members[k] if m >= 0)))
      if key in done:
        continue
      done.add(key)
      assert key in averagings
      a, b = key[1]
      arrived = arrivals.get(key, {a: False, b: False})
      both_lost += key not in arrivals
      new, avg_terms = {}, {}
      for i, j in ((a, b), (b, a)):
        if arrived[i]:
          copy[i, j], copy_version[i, j] = x[j].copy(), int(version[j])
        new[i] = 0.5 * x[i] + 0.5 * copy[i, j]
        avg_terms[i] = {i: (0.5, int(version[i])), j: (0.5, copy_version[i, j])}
      for i, xi in new.items():
        x[i] = xi
        version[i] += 1
      terms.append(avg_terms)
  return {"x": x, "terms": terms, "both_lost": both_lost}


def schedule_terms(schedule: C.GossipSchedule) -> list[dict[int, dict[int, tuple[float, int]]]]:
  """What each receiver mixed, read from a schedule: per mixing point (the mixes at one second), ``{receiver:
  {sender: (weight, sender's version - lag)}}`` (non-zero weights), versions counted along the events."""
  version = np.zeros(schedule.num_workers, np.int64)
  out: list[dict[int, dict[int, tuple[float, int]]]] = []
  last_time = None
  for e in range(schedule.num_events):
    kind = int(schedule.kind[e])
    if kind == C.GRAD:
      version[int(schedule.worker[e])] += 1
      continue
    if kind != C.MIX:
      continue
    k = int(schedule.mix[e])
    members = [int(m) for m in schedule.members[k] if m >= 0]
    if last_time != float(schedule.time[e]):
      out.append({})
      last_time = float(schedule.time[e])
    sent = [int(version[m] - schedule.lag[k, b]) for b, m in enumerate(members)]
    for a, i in enumerate(members):
      if schedule.receives[k, a]:
        assert i not in out[-1], "a replica receives twice at one mixing point"
        out[-1][i] = {m: (float(schedule.weights[k, a, b]), sent[b]) for b, m in enumerate(members)
                      if schedule.weights[k, a, b] != 0}
    for a, i in enumerate(members):
      if schedule.receives[k, a]:
        version[i] += 1
  return out
