"""ElasticBSP and the predictive cutoff against independent NumPy references, invariants and baselines."""

import itertools
import os
import sys

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def elastic_reference(times, num_updates, lookahead):
  """ElasticBSP period by period: each worker's k_p pushes back to back, merged by (time, worker).

  The iterations per period come from a brute-force search over every choice of one predicted end
  time per worker (the narrowest spread, then the earliest end).
  """
  num, n = times.shape
  used = [0] * num
  k = [1] * num
  spent, count = np.zeros(num), np.zeros(num)
  t0, version, period = 0.0, 0, 0
  out = []   # (time, worker, read version, period)
  while len(out) < num_updates:
    pushes = []
    for m in range(num):
      t = t0
      for i in range(k[m]):
        read, t = t, t + times[m, used[m] % n]
        used[m] += 1
        pushes.append((t, m, i, read))
    pushes.sort(key=lambda p: (p[0], p[1]))
    previous = {}
    for t, m, i, read in pushes:
      if len(out) == num_updates:
        return out
      v = version if i == 0 else previous[m] + 1
      previous[m] = len(out)
      out.append((t, m, v, period))
      spent[m] += t - read
      count[m] += 1
    t0, version, period = pushes[-1][0], len(out), period + 1
    mean = spent / count
    best = min(itertools.product(range(1, lookahead + 1), repeat=num),
               key=lambda ks: (max(t0 + kk * mean[p] for p, kk in enumerate(ks))
                               - min(t0 + kk * mean[p] for p, kk in enumerate(ks)),
                               max(t0 + kk * mean[p] for p, kk in enumerate(ks))))
    end = max(t0 + kk * mean[p] for p, kk in enumerate(best))
    k = [max(kk for kk in range(1, lookahead + 1) if t0 + kk * mean[p] <= end) for p in range(num)]
  return out


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_elastic_bsp_matches_the_reference(lookahead):
  rng = np.random.default_rng(lookahead)
  times = rng.choice([0.5, 1.0, 1.5, 2.5, 4.0], size=(3, 7))
  sched = C.simulate(C.elastic_bsp(lookahead), C.workers(3, compute=C.replay(times)), 60)
  ref = elastic_reference(times, 60, lookahead)
  np.testing.assert_array_equal(sched.time, [r[0] for r in ref])
  c = sched.contributions
  np.testing.assert_array_equal(c.worker, [r[1] for r in ref])
  np.testing.assert_array_equal(c.read_version, [r[2] for r in ref])
  np.testing.assert_array_equal(sched.extras["period"], [r[3] for r in ref])
  if lookahead > 1:
    # The rule was exercised: some period gave a worker more than one iteration, and not all the same.
    per = np.zeros((sched.extras["period"].max() + 1, 3), int)
    np.add.at(per, (sched.extras["period"], c.worker), 1)
    assert per.max() > 1 and np.any(per.min(axis=1) < per.max(axis=1))


@pytest.mark.parametrize("lookahead", [1, 4])
def test_elastic_bsp_invariants(lookahead):
  num = 6
  w = C.workers(num, compute="lognormal", speed=[1, 1, 1, 1, 0.5, 0.3])
  sched = C.simulate(C.elastic_bsp(lookahead), w, 1500, seed=3)
  x, period, c = sched.extras, sched.extras["period"], sched.contributions
  # Every gradient is applied at most once: one event per update, and each update's event is its push.
  applied = x["event_update"] >= 0
  np.testing.assert_array_equal(np.sort(x["event_update"][applied]), np.arange(sched.num_updates))
  # At most R iterations per worker and period; staleness below the period's number of pushes.
  per = np.zeros((period.max() + 1, num), int)
  np.add.at(per, (period, c.worker), 1)
  assert per.max() <= lookahead
  assert np.all(c.staleness < per.sum(axis=1)[period])
  assert sched.max_staleness.max() <= num * lookahead - 1
  # Every gradient was read in its own period: at or after the version that opened it.
  opened = np.searchsorted(period, period)
  assert np.all(c.read_version >= opened)
  # Each worker is computing or blocked at every moment.
  np.testing.assert_allclose(sched.busy + sched.wait, sched.total_time, rtol=1e-9)
  if lookahead == 1:
    assert np.all(per[:-1] == 1)   # a BSP round per period
  else:
    assert sched.updates_per_second > C.simulate(C.elastic_bsp(1), w, 1500, seed=3).updates_per_second


def cutoff_reference(durations, window):
  """The predictive cutoff round by round, with plain Python lists."""
  num = durations.shape[1]
  history = []   # per round: (sorted durations seen, the cut)
  out = []       # (k, predicted cutoff, contributing workers, round length)
  for row in durations:
    if not history:
      k, c = num, np.inf
    else:
      recent = history[-window:]
      largest_cut = max(cut for _, cut in recent)
      predicted = []
      for j in range(num):
        seen = [s[j] for s, _ in recent if j < len(s)]
        predicted.append(sum(seen) / len(seen) if seen else largest_cut)
      speeds = [(j + 1) / p for j, p in enumerate(predicted)]
      k = speeds.index(max(speeds)) + 1
      c = predicted[k - 1]
    ranked = sorted(range(num), key=lambda m: (row[m], m))
    cut = row[ranked[k - 1]]
    history.append(([row[m] for m in ranked[:k]], cut))
    out.append((k, c, sorted(ranked[:k]), cut))
  return out


@pytest.mark.parametrize("window", [1, 3, 20])
def test_predictive_cutoff_matches_the_reference(window):
  rng = np.random.default_rng(window)
  times = rng.lognormal(0.0, 0.8, size=(5, 40))
  sched = C.simulate(C.predictive_cutoff(window), C.workers(5, compute=C.replay(times)), 40)
  ref = cutoff_reference(times.T, window)
  np.testing.assert_array_equal(sched.extras["k"], [r[0] for r in ref])
  np.testing.assert_allclose(sched.extras["cutoff"], [r[1] for r in ref], rtol=1e-12)   # sums in another order
  np.testing.assert_allclose(np.diff(sched.time, prepend=0.0), [r[3] for r in ref], rtol=1e-12)
  for u, r in enumerate(ref):
    np.testing.assert_array_equal(np.flatnonzero(sched.contributes[u]), r[2])
  assert np.all(sched.staleness[sched.contributes] == 0)
  assert len(set(sched.extras["k"].tolist())) > 1


def test_predictive_cutoff_beats_every_fixed_cutoff_when_stragglers_come_and_go():
  # 4 of 8 workers are 10x slower for the first 300 s: the best K changes from 4 to 8 during the run.
  w = C.workers(8, compute=C.gamma(shape=16, mean=1.0),
                stragglers=C.straggler_window(0.0, 300.0, 10.0, workers=[0, 1, 2, 3]))

  def gradients_per_second(paradigm):
    sched = C.simulate(paradigm, w, 300, seed=0)
    return sched.num_contributions / sched.total_time

  predictive = gradients_per_second(C.predictive_cutoff(20))
  fixed = [gradients_per_second(C.k_sync(k)) for k in range(1, 9)]
  backup = [gradients_per_second(C.backup_workers(b)) for b in range(8)]
  assert predictive > max(fixed) and predictive > max(backup)


@pytest.mark.parametrize("call, error, match", [
    (lambda: C.elastic_bsp(0), ValueError, "lookahead must be an integer >= 1, got 0"),
    (lambda: C.elastic_bsp(2.5), TypeError, "lookahead must be an integer, got 2.5"),
    (lambda: C.predictive_cutoff(0), ValueError, "window must be an integer >= 1, got 0"),
    (lambda: C.predictive_cutoff("5"), TypeError, "window must be an integer, got '5'"),
])
def test_bad_arguments_are_named(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_dj_simulate_trains_under_elastic_bsp_as_the_sequential_reference():
  # The runtime's sequential reference (one gradient at a time, each at the version it read). The
  # predictive cutoff's schedules are K-sync rounds, which the runtime's own tests cover.
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "runtime"))
  from simulate_reference import assert_trees_close, probe, reference, regression_problem  # noqa: PLC0415

  data, loss_fn, params = regression_problem()
  schedule = C.simulate(C.elastic_bsp(3), C.workers(3, compute="lognormal"), 16, seed=2)
  assert schedule.max_staleness.max() > 1
  tx = probe(0.05, schedule.num_workers)
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=4), seed=1)
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=4, seed=1)
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(result.opt_state.per_worker, ref_state.per_worker)
  np.testing.assert_array_equal(result.history.staleness, schedule.max_staleness)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)
