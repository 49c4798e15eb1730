"""Properties every schedule, and each paradigm's own rule, must satisfy, over seeds and worker mixes."""

import dataclasses

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster
SEEDS = range(4)


def mixes(num_workers: int, seed: int) -> dict:
  rng = np.random.default_rng(100 + seed)
  return {
      "exponential": C.workers(num_workers),
      "heterogeneous": C.workers(num_workers, compute="gamma", speed=np.linspace(0.3, 1.5, num_workers)),
      "stragglers": C.workers(num_workers, compute=C.lognormal(1.0, 0.8), comm=C.uniform(0.0, 0.2),
                              stragglers=[C.random_stragglers(0.1, 5.0),
                                          C.straggler_window(5.0, 15.0, 4.0, workers=[0])]),
      "constant": C.workers(num_workers, compute="constant"),
      "replay": C.workers(num_workers, compute=rng.integers(1, 4, size=(num_workers, 5)).astype(float)),
  }


def paradigms(num_workers: int) -> dict:
  return {
      "bsp": C.bsp(), "asp": C.asp(), "ssp": C.ssp(2), "dssp": C.dssp(1, 5), "psp": C.psp(2, 1),
      "k_sync": C.k_sync(max(1, num_workers // 2)), "k_async": C.k_async(max(1, num_workers // 2)),
      "k_batch_sync": C.k_batch_sync(num_workers + 1), "k_batch_async": C.k_batch_async(3),
      "softsync": C.softsync(2), "backup": C.backup_workers(1), "adasync": C.adasync(2),
  }


def clocks(sched: C.Schedule) -> np.ndarray:
  """int64 [U + 1, M]: pushes applied per worker after each number of updates."""
  return np.vstack([np.zeros(sched.num_workers, np.int64), np.cumsum(sched.contributes, axis=0)])


def per_worker_events(sched: C.Schedule):
  x = sched.extras
  for m in range(sched.num_workers):
    sel = x["event_worker"] == m
    yield m, {k[len("event_"):]: v[sel] for k, v in x.items() if k.startswith("event_")}


@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers", "constant", "replay"])
@pytest.mark.parametrize("name", list(paradigms(4)))
@pytest.mark.parametrize("seed", SEEDS)
def test_every_schedule_is_consistent(name, mix, seed):
  num_workers = 3 + seed
  sched = C.simulate(paradigms(num_workers)[name], mixes(num_workers, seed)[mix], 150, seed=seed)
  assert np.all(np.diff(sched.time) >= 0)
  x = sched.extras
  applied = x["event_update"] >= 0
  # Every gradient is applied at most once: the applied events are exactly the recorded minibatches.
  counts = np.zeros(sched.contributes.shape, np.int64)
  np.add.at(counts, (x["event_update"][applied], x["event_worker"][applied]), 1)
  np.testing.assert_array_equal(counts, sched.num_batches)
  np.testing.assert_array_equal(
      x["event_read_version"][applied], sched.read_version[x["event_update"][applied], x["event_worker"][applied]])
  # A gradient is pushed before (or when) the update that uses it is applied, after its read.
  assert np.all(x["event_end_time"][applied] <= sched.time[x["event_update"][applied]])
  assert np.all(x["event_end_time"] >= x["event_read_time"])
  # At most one gradient in flight per worker: a worker's computations do not overlap.
  for _, ev in per_worker_events(sched):
    assert np.all(ev["read_time"][1:] >= np.minimum(ev["end_time"][:-1], sched.total_time))
    assert np.all(np.diff(ev["read_version"]) >= 0)
  np.testing.assert_array_equal(sched.dropped, np.bincount(x["event_worker"][x["event_update"] == -1],
                                                           minlength=sched.num_workers))
  # A worker is always either computing or blocked.
  np.testing.assert_allclose(sched.busy + sched.wait, sched.total_time, rtol=1e-9)


@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers"])
@pytest.mark.parametrize("seed", SEEDS)
def test_bsp_is_synchronous(mix, seed):
  sched = C.simulate(C.bsp(), mixes(5, seed)[mix], 200, seed=seed)
  assert np.all(sched.contributes)
  assert np.all(sched.staleness == 0)
  assert sched.num_dropped == 0


def test_bsp_with_constant_times_takes_one_second_per_update():
  sched = C.simulate(C.bsp(), C.workers(4, compute=C.constant(1.0)), 10)
  np.testing.assert_array_equal(sched.time, np.arange(1.0, 11.0))
  np.testing.assert_array_equal(sched.wait, 0.0)


@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers", "replay"])
@pytest.mark.parametrize("seed", SEEDS)
def test_ssp_never_starts_more_than_s_ahead_of_the_slowest(staleness, mix, seed):
  sched = C.simulate(C.ssp(staleness), mixes(6, seed)[mix], 400, seed=seed)
  slowest = clocks(sched).min(axis=1)
  gaps = []
  for _, ev in per_worker_events(sched):
    own_clock = np.arange(ev["read_version"].shape[0])   # the j-th read follows j pushes
    gaps.append(own_clock - slowest[ev["read_version"]])
  gaps = np.concatenate(gaps)
  assert gaps.max() <= staleness
  # So while one gradient is computed each other worker pushes at most 2s + 1 times.
  assert sched.staleness.max() <= (sched.num_workers - 1) * (2 * staleness + 1)
  if mix != "replay":
    assert gaps.max() == staleness   # the bound is reached, so the check is not vacuous


@pytest.mark.parametrize("num_workers", [2, 5, 8])
def test_asp_with_equal_speeds_has_staleness_m_minus_1(num_workers):
  sched = C.simulate(C.asp(), C.workers(num_workers, compute="constant"), 20 * num_workers)
  tau = sched.staleness[sched.contributes]
  np.testing.assert_array_equal(tau[:num_workers], np.arange(num_workers))
  np.testing.assert_array_equal(tau[num_workers:], num_workers - 1)


@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers"])
@pytest.mark.parametrize("seed", SEEDS)
def test_asp_mean_staleness_is_m_minus_1(mix, seed):
  num_workers = 8
  sched = C.simulate(C.asp(), mixes(num_workers, seed)[mix], 8000, seed=seed)
  tau = sched.staleness[sched.contributes][1000:]
  assert abs(tau.mean() - (num_workers - 1)) < 0.05 * (num_workers - 1)
  assert sched.wait.sum() == 0


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", SEEDS)
def test_softsync_mean_staleness_is_about_n(n, seed):
  num_workers = 16
  sched = C.simulate(C.softsync(n), mixes(num_workers, seed)["heterogeneous"], 4000, seed=seed)
  np.testing.assert_array_equal(sched.num_batches.sum(axis=1), num_workers // n)
  assert abs(sched.mean_staleness() - n) <= 0.15 * n


def test_softsync_with_n_equal_m_is_asp():
  w = C.workers(6, compute="lognormal")
  a = C.simulate(C.softsync(6), w, 500, seed=3)
  b = C.simulate(C.asp(), w, 500, seed=3)
  assert a == dataclasses.replace(b, paradigm=a.paradigm)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("seed", SEEDS)
def test_k_sync_uses_k_fresh_gradients_and_drops_the_rest(k, seed):
  num_workers = 6
  sched = C.simulate(C.k_sync(k), mixes(num_workers, seed)["heterogeneous"], 300, seed=seed)
  np.testing.assert_array_equal(sched.contributes.sum(axis=1), k)
  assert np.all(sched.staleness[sched.contributes] == 0)
  assert sched.num_dropped == (num_workers - k) * sched.num_updates
  x = sched.extras
  dropped_per_update = np.bincount(x["event_read_version"][x["event_update"] == -1], minlength=sched.num_updates)
  np.testing.assert_array_equal(dropped_per_update, num_workers - k)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "replay"])
@pytest.mark.parametrize("seed", SEEDS)
def test_k_async_updates_have_exactly_k_contributions(k, mix, seed):
  sched = C.simulate(C.k_async(k), mixes(5, seed)[mix], 300, seed=seed)
  np.testing.assert_array_equal(sched.contributes.sum(axis=1), k)
  np.testing.assert_array_equal(sched.num_batches.max(), 1)
  if k < 5:
    assert sched.staleness.max() > 0   # others keep computing: stale gradients do occur
  else:
    assert np.all(sched.staleness[sched.contributes] == 0)   # K = M is BSP


@pytest.mark.parametrize("seed", SEEDS)
def test_k_batch_forms_count_minibatches(seed):
  w = mixes(4, seed)["heterogeneous"]
  sync = C.simulate(C.k_batch_sync(10), w, 200, seed=seed)
  np.testing.assert_array_equal(sync.num_batches.sum(axis=1), 10)
  assert np.all(sync.staleness[sync.contributes] == 0)
  assert sync.num_batches.max() > 1
  batch_async = C.simulate(C.k_batch_async(3), w, 200, seed=seed)
  np.testing.assert_array_equal(batch_async.num_batches.sum(axis=1), 3)


@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers", "replay"])
@pytest.mark.parametrize("seed", SEEDS)
def test_dssp_threshold_stays_in_bounds_and_bounds_every_read(mix, seed):
  s_lower, s_upper = 1, 5
  sched = C.simulate(C.dssp(s_lower, s_upper), mixes(6, seed)[mix], 600, seed=seed)
  threshold = sched.extras["threshold"]
  assert threshold.shape == (sched.num_updates,)
  assert threshold.min() >= s_lower and threshold.max() <= s_upper
  slowest = clocks(sched).min(axis=1)
  for _, ev in per_worker_events(sched):
    gaps = np.arange(ev["read_version"].shape[0]) - slowest[ev["read_version"]]
    assert gaps[0] == 0
    # The j-th read (j >= 1) follows the push of gradient j - 1; its threshold bounds the gap.
    assert np.all(gaps[1:] <= threshold[ev["update"][:-1]])
    assert gaps.max() <= s_upper


@pytest.mark.parametrize("seed", SEEDS)
def test_dssp_waits_less_than_ssp_at_its_lower_threshold(seed):
  w = C.workers(8, compute="exponential", speed=[1, 1, 1, 1, 1, 1, 0.5, 0.25])
  dssp = C.simulate(C.dssp(3, 15), w, 5000, seed=seed)
  ssp = C.simulate(C.ssp(3), w, 5000, seed=seed)
  assert np.any(dssp.extras["threshold"] > 3)
  assert dssp.wait.sum() < ssp.wait.sum()


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers"])
@pytest.mark.parametrize("seed", SEEDS)
def test_backup_workers_apply_the_first_n_fresh_gradients(b, mix, seed):
  num_workers = 5
  sched = C.simulate(C.backup_workers(b), mixes(num_workers, seed)[mix], 300, seed=seed)
  np.testing.assert_array_equal(sched.contributes.sum(axis=1), num_workers - b)
  assert np.all(sched.staleness[sched.contributes] == 0)
  x = sched.extras
  read_at = x["event_read_version"]
  finished = np.bincount(read_at[x["event_update"] >= -1], minlength=sched.num_updates)
  unfinished = np.bincount(read_at[x["event_update"] == -2], minlength=sched.num_updates)
  dropped = np.bincount(read_at[x["event_update"] == -1], minlength=sched.num_updates)
  done = unfinished == 0
  # Of the gradients read at a version, all but the first N are dropped: never more than b.
  np.testing.assert_array_equal(dropped[done], finished[done] - (num_workers - b))
  assert dropped.max() <= b
  assert sched.num_dropped > 0


@pytest.mark.parametrize("b", [1, 3])
def test_backup_workers_drop_exactly_b_per_update_with_equal_speeds(b):
  num_workers, num_updates = 6, 50
  sched = C.simulate(C.backup_workers(b), C.workers(num_workers, compute="constant"), num_updates)
  x = sched.extras
  dropped = np.bincount(x["event_read_version"][x["event_update"] == -1], minlength=num_updates)
  # The last update's b slow pushes arrive at the same instant, after the simulation ends.
  np.testing.assert_array_equal(dropped[:-1], b)
  assert sched.num_dropped == b * (num_updates - 1)
  # The b highest-index workers lose the ties every round.
  np.testing.assert_array_equal(sched.dropped, [0] * (num_workers - b) + [num_updates - 1] * b)


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize("mix", ["exponential", "heterogeneous", "stragglers", "replay"])
@pytest.mark.parametrize("seed", SEEDS)
def test_psp_with_everyone_sampled_is_ssp(staleness, mix, seed):
  num_workers = 5
  w = mixes(num_workers, seed)[mix]
  psp = C.simulate(C.psp(num_workers, staleness), w, 400, seed=seed)
  ssp = C.simulate(C.ssp(staleness), w, 400, seed=seed)
  assert psp == dataclasses.replace(ssp, paradigm=psp.paradigm)


@pytest.mark.parametrize("seed", SEEDS)
def test_psp_with_a_small_sample_relaxes_the_barrier(seed):
  w = mixes(8, seed)["heterogeneous"]
  psp = C.simulate(C.psp(2, 1), w, 3000, seed=seed)
  ssp = C.simulate(C.ssp(1), w, 3000, seed=seed)
  assert psp.wait.sum() < ssp.wait.sum()
  assert psp.staleness.max() > ssp.staleness.max()


@pytest.mark.parametrize("name", list(paradigms(4)))
def test_same_seed_same_schedule_and_different_seeds_differ(name):
  w = mixes(4, 0)["stragglers"]
  p = paradigms(4)[name]
  a = C.simulate(p, w, 200, seed=7)
  assert a == C.simulate(p, w, 200, seed=7)
  assert a != C.simulate(p, w, 200, seed=8)
  np.testing.assert_array_equal(a.time, C.simulate(p, w, 200, seed=7).time)


def test_workers_seed_is_mixed_into_the_simulation_seed():
  a = C.simulate(C.asp(), C.workers(4, seed=1), 100, seed=0)
  b = C.simulate(C.asp(), C.workers(4, seed=2), 100, seed=0)
  assert a != b
  assert a == C.simulate(C.asp(), C.workers(4, seed=1), 100, seed=0)


@pytest.mark.parametrize("name", ["asp", "ssp", "k_async", "backup", "bsp"])
def test_a_longer_run_extends_a_shorter_one(name):
  # Durations are drawn per gradient index, so the first updates do not depend on num_updates.
  w = mixes(5, 1)["stragglers"]
  short = C.simulate(paradigms(5)[name], w, 100, seed=2)
  long = C.simulate(paradigms(5)[name], w, 300, seed=2)
  np.testing.assert_array_equal(short.time, long.time[:100])
  np.testing.assert_array_equal(short.read_version, long.read_version[:100])


def assert_same_up_to_rounding(a: C.Schedule, b: C.Schedule) -> None:
  for field in ("time", "contributes", "read_version", "num_batches", "dropped"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  for k in ("event_worker", "event_read_time", "event_end_time", "event_update", "event_read_version"):
    np.testing.assert_array_equal(a.extras[k], b.extras[k], err_msg=k)
  np.testing.assert_allclose(a.wait, b.wait, rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(a.busy, b.busy, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mix", ["exponential", "stragglers", "replay"])
@pytest.mark.parametrize("seed", SEEDS)
def test_paradigms_that_coincide_give_the_same_schedule(mix, seed):
  num_workers = 6
  w = mixes(num_workers, seed)[mix]
  run = lambda p: C.simulate(p, w, 300, seed=seed)
  asp = run(C.asp())
  assert_same_up_to_rounding(run(C.k_async(1)), asp)
  assert_same_up_to_rounding(run(C.k_batch_async(1)), asp)
  assert_same_up_to_rounding(run(C.softsync(num_workers)), asp)
  assert_same_up_to_rounding(run(C.ssp(10_000)), asp)
  assert_same_up_to_rounding(run(C.softsync(2)), run(C.k_batch_async(num_workers // 2)))
  bsp = run(C.bsp())
  assert_same_up_to_rounding(run(C.k_sync(num_workers)), bsp)
  assert_same_up_to_rounding(run(C.backup_workers(0)), bsp)
  assert_same_up_to_rounding(run(C.k_async(num_workers)), bsp)
