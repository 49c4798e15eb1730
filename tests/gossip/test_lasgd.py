"""LASGD: its schedule against an independent NumPy timing model, its rule against a float64 NumPy loop, and the
lockstep identity with D-PSGD on the complete graph and DC-S3GD without compensation."""

from __future__ import annotations

import os
import sys

import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GRAD, MIX, PARAMS, READ
from delayjax.cluster._simulate import _BLOCK
from delayjax.runtime import minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from method_reference import flat, grad, random_schedule, regression  # noqa: E402

LR, BETA, BATCH = 0.05, 0.5, 4


# ---- the schedule: an independent timing model ----------------------------------------------------------------


def _stream(workers, seq, m: int, count: int) -> tuple[np.ndarray, np.ndarray]:
  """Worker ``m``'s first ``count`` (compute, comm) draws from its stream, child ``m`` of ``seq`` (drawn in the
  library's blocks, as ``dj.cluster.simulate`` draws them)."""
  rng = np.random.default_rng(np.random.SeedSequence(seq.entropy, spawn_key=seq.spawn_key + (m,)))
  blocks = [workers.draw(rng, m, start, _BLOCK) for start in range(0, count, _BLOCK)]
  return np.concatenate([b[0] for b in blocks])[:count], np.concatenate([b[1] for b in blocks])[:count]


def reference_events(workers, num_steps: int, seed: int):
  """LASGD's events from the rule in closed form: a replica that never waits finishes its gradients at the running
  sums of its compute times; all-reduce ``r`` completes at ``S_{r+1} = S_r + max_m comm_{m,r}`` (a second stream);
  the run keeps the first ``num_steps * M`` gradients (ties: gradient, then merge, then read; then worker)."""
  num = workers.num_workers
  total = num_steps * num
  time_seq, allreduce_seq = np.random.SeedSequence(seed).spawn(2)
  ends, reads = [], []
  for m in range(num):
    compute, _ = _stream(workers, time_seq, m, total + 1)
    end = np.cumsum(compute)
    ends.append(end)
    reads.append(np.r_[0.0, end[:-1]])
  grads = sorted((float(ends[m][j]), m, j) for m in range(num) for j in range(total + 1))[:total]
  t_end, last_worker, _ = grads[-1]
  count = np.bincount([m for _, m, _ in grads], minlength=num)
  comm = np.stack([_stream(workers, allreduce_seq, m, 10 * _BLOCK)[1] for m in range(num)])
  merges = [0.0]
  while merges[-1] + comm[:, len(merges) - 1].max() < t_end:
    merges.append(merges[-1] + comm[:, len(merges) - 1].max())
  rows = [(t, 0, m, GRAD) for t, m, _ in grads]
  rows += [(float(reads[m][j]), 2, m, READ) for m in range(num) for j in range(count[m] + 1)
           if not (m == last_worker and j == count[m])]
  rows += [(t, 1, -1, MIX) for t in merges[1:]]
  rows.sort()
  local = np.array([[np.sum((ends[m][:count[m]] > merges[r]) & (ends[m][:count[m]] <= merges[r + 1]))
                     for m in range(num)] for r in range(len(merges) - 1)], np.int64).reshape(-1, num)
  return rows, np.asarray(merges[:-1]), local


CLUSTERS = [
    dict(num=1, compute="exponential", comm=0.3, speed=None),
    dict(num=2, compute="exponential", comm="exponential", speed=[1.0, 0.3]),
    dict(num=3, compute="gamma", comm=dj.cluster.uniform(0.2, 0.9), speed=[1.0, 2.0, 0.5]),
    dict(num=5, compute="lognormal", comm="exponential", speed=[1.0, 1.0, 1.0, 1.0, 0.25]),
    dict(num=4, compute=dj.cluster.uniform(0.5, 1.5), comm=0.05, speed=None),
]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=[f"M{c['num']}-{i}" for i, c in enumerate(CLUSTERS)])
@pytest.mark.parametrize("seed", [0, 7])
def test_schedule_matches_the_timing_model_event_by_event(cluster, seed):
  workers = dj.cluster.workers(cluster["num"], compute=cluster["compute"], comm=cluster["comm"],
                               speed=cluster["speed"])
  s = dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, num_steps=30, seed=seed)
  rows, starts, local = reference_events(workers, 30, seed)
  assert s.num_events == len(rows)
  np.testing.assert_array_equal(s.kind, [r[3] for r in rows])
  np.testing.assert_array_equal(s.worker, [r[2] for r in rows])
  np.testing.assert_allclose(s.time, [r[0] for r in rows], rtol=1e-12)
  num = cluster["num"]
  assert s.num_mixes == len(starts) and s.num_mixes > 0
  np.testing.assert_array_equal(s.members, np.tile(np.arange(num), (s.num_mixes, 1)))
  np.testing.assert_allclose(s.weights, np.full((s.num_mixes, num, num), 1.0 / num))
  assert not s.lag.any() and s.receives.all() and np.all(s.mixes == PARAMS)
  np.testing.assert_allclose(s.extras["allreduce_start"], starts, rtol=1e-12)
  np.testing.assert_array_equal(s.extras["local_steps"], local)
  # Nobody waits; the schedule is its paradigm's (it runs dj.gossip.lasgd and plain averaging alike).
  np.testing.assert_allclose(s.wait, 0.0, atol=1e-9 * s.total_time)
  assert s.paradigm == "lasgd()"
  dj.gossip.check_method_schedule(dj.gossip.lasgd(), s)
  assert dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, num_steps=30, seed=seed) == s


def test_fast_replicas_take_more_local_steps_per_allreduce():
  workers = dj.cluster.workers(4, compute="exponential", comm=2.0, speed=[4.0, 1.0, 1.0, 1.0])
  s = dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, num_steps=200, seed=1)
  per_allreduce = s.extras["local_steps"].mean(axis=0)
  np.testing.assert_allclose(per_allreduce, [8.0, 2.0, 2.0, 2.0], rtol=0.15)


# ---- the rule: a float64 NumPy loop ---------------------------------------------------------------------------


def lasgd_reference(schedule, params, data, *, lr: float, beta: float, batch_size: int, seed: int = 0):
  """Every replica's model and snapshot after ``schedule`` (float64 ``[M, d + 1]``): a ``GRAD`` is SGD with
  momentum at the replica's model; a mix replaces ``x_i`` by ``sum_j W_ij a_j + x_i - a_i`` and sets
  ``a_i = x_i``, the snapshots ``a`` all taken before any member changes. Also returns the largest progress
  ``|x_i - a_i|`` a merge kept."""
  m = schedule.num_workers
  n = np.asarray(data["x"]).shape[0]
  x = np.tile(flat(params), (m, 1))
  anchor, mom = x.copy(), np.zeros_like(x)
  pending = [None] * m
  draws = np.zeros(m, np.int64)
  kept = 0.0
  for e in range(schedule.num_events):
    i = int(schedule.worker[e])
    if schedule.kind[e] == READ:
      nb = int(schedule.num_batches[e])
      pending[i] = np.mean([grad(x[i], data, np.asarray(minibatch_indices(seed, 0, i, int(draws[i]) + j,
                                                                          num_examples=n, batch_size=batch_size)))
                            for j in range(nb)], axis=0)
      draws[i] += nb
    elif schedule.kind[e] == GRAD:
      mom[i] = beta * mom[i] + pending[i]
      x[i] = x[i] - lr * mom[i]
    else:
      q = schedule.mix[e]
      group = schedule.members[q][schedule.members[q] >= 0]
      w = schedule.weights[q][:len(group), :len(group)]
      sent = anchor[group].copy()
      for a, r in enumerate(group):
        if schedule.receives[q][a]:
          kept = max(kept, float(np.abs(x[r] - anchor[r]).max()))
          x[r] = w[a] @ sent + x[r] - anchor[r]
          anchor[r] = x[r]
  return x, anchor, kept


def _stacked(tree) -> np.ndarray:
  return np.concatenate([np.asarray(tree["w"], np.float64), np.asarray(tree["b"], np.float64)[:, None]], axis=1)


def _run(method, schedule, tx=None):
  data, loss_fn, params = regression()
  tx = optax.sgd(LR, momentum=BETA) if tx is None else tx
  return dj.simulate_gossip(loss_fn, tx, method, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))


def _lasgd_schedule(num: int, speeds, steps: int, seed: int):
  workers = dj.cluster.workers(num, compute="exponential", comm=0.6, speed=speeds)
  return dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, num_steps=steps, seed=seed)


SCHEDULES = {
    "lasgd-heterogeneous": lambda: _lasgd_schedule(3, [1.0, 3.0, 0.5], 12, 2),
    "lasgd-one-replica": lambda: _lasgd_schedule(1, None, 10, 0),
    # Any row-stochastic mixes: random groups of 3 of 4 replicas, random weights, 2 minibatches at most.
    "random-groups": lambda: random_schedule(4, 60, seed=5, group=3, max_batches=2),
}


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_rule_matches_numpy_loop(name):
  schedule = SCHEDULES[name]()
  assert schedule.num_mixes > 0
  result = _run(dj.gossip.lasgd(), schedule)
  data, _, params = regression()
  x, anchor, kept = lasgd_reference(schedule, params, data, lr=LR, beta=BETA, batch_size=BATCH)
  np.testing.assert_allclose(_stacked(result.params), x, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(_stacked(result.extra.anchor), anchor, rtol=2e-5, atol=2e-6)
  # The merges kept local progress (they were not plain averages of the current models).
  assert kept > 1e-3


@pytest.mark.fast_compile
def test_lockstep_lasgd_is_dpsgd_on_the_complete_graph_and_dcs3gd_without_compensation():
  # Every gradient and every all-reduce lasts 1 s: rounds of READ x M, GRAD x M, MIX, and all-reduce k carries
  # the models of the round's start. LASGD: x^{k+1} = mean(x^k) + u(x^k); D-PSGD on the complete graph (READ,
  # MIX, GRAD rounds) and DC-S3GD(0) give the same recursion. The run ends at the last gradient, before LASGD's
  # last merge, so x_i - a_i + mean(a) is D-PSGD's final model.
  num, rounds = 4, 6
  workers = dj.cluster.workers(num, compute="constant", comm=1.0)
  lock = dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, num_steps=rounds, seed=0)
  round_kinds = [READ] * num + [GRAD] * num + [MIX]
  np.testing.assert_array_equal(lock.kind, (round_kinds * rounds)[:-1])
  complete = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.complete(num)), workers, num_steps=rounds)
  np.testing.assert_allclose(complete.weights, 1.0 / num)
  lasgd = _run(dj.gossip.lasgd(), lock)
  dpsgd = _run(dj.gossip.d_psgd(), complete)
  dcs3gd = _run(dj.gossip.dc_s3gd(0.0), complete)
  anchor = _stacked(lasgd.extra.anchor)
  merged = _stacked(lasgd.params) - anchor + anchor.mean(axis=0)
  np.testing.assert_allclose(merged, _stacked(dpsgd.params), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_stacked(dcs3gd.params), _stacked(dpsgd.params), rtol=1e-5, atol=1e-6)
  for a, b in zip(lasgd.average.values(), dpsgd.average.values()):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # Not trivially so: the replicas differ, and the merge is not a plain average (x_i - a_i is each one's step).
  assert np.abs(merged - merged.mean(axis=0)).max() > 1e-3


# ---- bad input --------------------------------------------------------------------------------------------------


def test_bad_inputs_name_themselves():
  w = dj.cluster.workers(3, compute="exponential", comm=0.5)
  with pytest.raises(TypeError, match="workers must be built"):
    dj.cluster.simulate_gossip(dj.cluster.lasgd(), [1.0, 1.0], num_steps=3)
  with pytest.raises(ValueError, match="num_steps"):
    dj.cluster.simulate_gossip(dj.cluster.lasgd(), w, num_steps=0)
  with pytest.raises(ValueError, match="seed"):
    dj.cluster.simulate_gossip(dj.cluster.lasgd(), w, num_steps=3, seed=-1)
  with pytest.raises(ValueError, match="workers has no comm model"):
    dj.cluster.simulate_gossip(dj.cluster.lasgd(), dj.cluster.workers(3), num_steps=3)
  with pytest.raises(ValueError, match="took no time"):
    dj.cluster.simulate_gossip(dj.cluster.lasgd(), dj.cluster.workers(3, comm=0.0), num_steps=3)


def test_late_messages_are_refused():
  schedule = random_schedule(4, 30, seed=1, group=2, lag=2)
  assert schedule.lag.max() > 0
  with pytest.raises(ValueError, match="'lasgd' is not defined for late messages"):
    _run(dj.gossip.lasgd(), schedule)
