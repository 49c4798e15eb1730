"""Time models, speeds, stragglers, communication latency and replay: the durations the simulator sees."""

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def durations(sched: C.Schedule) -> dict[int, np.ndarray]:
  """Seconds of each applied gradient, per worker, in order."""
  x = sched.extras
  out = {}
  for m in range(sched.num_workers):
    sel = (x["event_worker"] == m) & (x["event_update"] >= 0)
    out[m] = x["event_end_time"][sel] - x["event_read_time"][sel]
  return out


@pytest.mark.parametrize("model,mean,var", [
    (C.constant(2.0), 2.0, 0.0),
    (C.uniform(1.0, 3.0), 2.0, 4.0 / 12),
    (C.exponential(2.0), 2.0, 4.0),
    (C.gamma(shape=4.0, mean=2.0), 2.0, 1.0),
    (C.lognormal(mean=2.0, sigma=0.5), 2.0, 4.0 * (np.exp(0.25) - 1)),
])
def test_time_models_have_the_stated_moments(model, mean, var):
  assert model.mean == pytest.approx(mean)
  x = model.sample(np.random.default_rng(0), 200_000)
  assert x.dtype == np.float64 and np.all(x >= 0)
  assert x.mean() == pytest.approx(mean, rel=0.02)
  assert x.var() == pytest.approx(var, rel=0.05, abs=1e-12)


@pytest.mark.parametrize("name", ["constant", "uniform", "exponential", "gamma", "lognormal"])
def test_names_give_mean_one_models(name):
  w = C.workers(3, compute=name)
  np.testing.assert_allclose(w.mean_time(), 1.0)


def test_default_is_exponential_with_mean_one():
  w = C.workers(2)
  assert w.compute == (C.exponential(1.0),) * 2
  sched = C.simulate(C.asp(), C.workers(1), 20_000, seed=0)
  d = durations(sched)[0]
  assert d.mean() == pytest.approx(1.0, rel=0.03)
  assert d.std() == pytest.approx(1.0, rel=0.05)   # exponential: std == mean


def test_speed_divides_compute_time():
  w = C.workers(3, compute=C.constant(3.0), speed=[1.0, 2.0, 3.0])
  d = durations(C.simulate(C.asp(), w, 60))
  for m, speed in enumerate([1.0, 2.0, 3.0]):
    np.testing.assert_allclose(d[m], 3.0 / speed)
  np.testing.assert_allclose(w.mean_time(), [3.0, 1.5, 1.0])


def test_comm_latency_is_added_to_every_push_and_not_scaled_by_speed():
  w = C.workers(2, compute=C.constant(1.0), comm=0.25, speed=2.0)
  d = durations(C.simulate(C.asp(), w, 40))
  np.testing.assert_allclose(np.concatenate(list(d.values())), 0.5 + 0.25)


def test_random_stragglers_slow_the_chosen_fraction_of_gradients():
  w = C.workers(4, compute=C.constant(1.0), stragglers=C.random_stragglers(0.2, slowdown=5.0, workers=[1, 2]))
  d = durations(C.simulate(C.asp(), w, 20_000, seed=1))
  np.testing.assert_array_equal(d[0], 1.0)
  np.testing.assert_array_equal(d[3], 1.0)
  for m in (1, 2):
    assert set(np.unique(d[m])) == {1.0, 5.0}
    assert np.mean(d[m] == 5.0) == pytest.approx(0.2, abs=0.03)


def test_straggler_window_slows_gradients_read_inside_it():
  w = C.workers(2, compute=C.constant(1.0), stragglers=C.straggler_window(3.0, 6.0, slowdown=4.0, workers=0))
  sched = C.simulate(C.asp(), w, 30)
  x = sched.extras
  seconds = x["event_end_time"] - x["event_read_time"]
  inside = (x["event_read_time"] >= 3.0) & (x["event_read_time"] < 6.0) & (x["event_worker"] == 0)
  np.testing.assert_array_equal(seconds[inside], 4.0)
  np.testing.assert_array_equal(seconds[~inside], 1.0)
  assert inside.sum() == 1   # worker 0 reads at 3, then is busy until 7


def test_straggler_window_in_round_paradigms():
  w = C.workers(3, compute=C.constant(1.0), stragglers=C.straggler_window(2.0, 4.0, slowdown=3.0, workers=[2]))
  sched = C.simulate(C.bsp(), w, 5)
  # Rounds start at 0, 1, 2 (worker 2 slowed: ends 5), 5, 6.
  np.testing.assert_array_equal(sched.time, [1.0, 2.0, 5.0, 6.0, 7.0])
  k_sync = C.simulate(C.k_sync(2), w, 5)
  np.testing.assert_array_equal(k_sync.time, [1.0, 2.0, 3.0, 4.0, 5.0])
  assert k_sync.dropped.tolist() == [0, 0, 5]   # ties go to low indices: worker 2 is always cancelled


def test_replay_cycles_each_workers_measurements():
  times = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 4.0]])
  d = durations(C.simulate(C.asp(), C.workers(2, compute=C.replay(times)), 30))
  np.testing.assert_array_equal(d[0], np.resize(times[0], d[0].shape[0]))
  np.testing.assert_array_equal(d[1], np.resize(times[1], d[1].shape[0]))
  plain = C.workers(2, compute=times)   # a 2-D array is replayed too
  assert C.simulate(C.asp(), plain, 30) == C.simulate(C.asp(), C.workers(2, compute=C.replay(times)), 30)


def test_per_worker_models():
  w = C.workers(2, compute=[C.constant(1.0), C.constant(3.0)])
  d = durations(C.simulate(C.asp(), w, 20))
  np.testing.assert_array_equal(d[0], 1.0)
  np.testing.assert_array_equal(d[1], 3.0)


def test_durations_are_drawn_per_gradient_index():
  # The j-th gradient of a worker takes the same time whatever the paradigm does with it.
  w = C.workers(4, compute="lognormal", stragglers=C.random_stragglers(0.3, 3.0))
  a = durations(C.simulate(C.asp(), w, 400, seed=5))
  b = durations(C.simulate(C.ssp(1), w, 400, seed=5))
  for m in range(4):
    n = min(a[m].shape[0], b[m].shape[0])
    np.testing.assert_allclose(a[m][:n], b[m][:n], rtol=1e-12)


def test_workers_repr_is_short():
  text = repr(C.workers(64, compute="gamma", speed=np.linspace(0.5, 1.0, 64)))
  assert "num_workers=64" in text and "Gamma" in text and "0.5..1" in text
  assert len(text) < 300


def test_each_worker_draws_from_its_own_stream():
  # Adding workers does not change the times the first workers draw.
  small = C.simulate(C.bsp(), C.workers(3, compute="gamma"), 50, seed=9).extras
  big = C.simulate(C.bsp(), C.workers(5, compute="gamma"), 50, seed=9).extras
  for m in range(3):
    a, b = (x["event_end_time"][x["event_worker"] == m] - x["event_read_time"][x["event_worker"] == m]
            for x in (small, big))
    assert a.shape == b.shape == (50,)
    np.testing.assert_allclose(a, b, rtol=1e-9)


def test_compute_draws_are_strictly_positive():
  """A uniform of width 5e-324 draws 0 or the smallest float: the zeros become the smallest positive time, so no
  gradient takes no time (and the others are unchanged)."""
  tiny = float(np.finfo(np.float64).smallest_subnormal)
  w = C.workers(2, compute=C.uniform(0.0, tiny))
  raw = C.uniform(0.0, tiny).sample(np.random.default_rng(0), 4096)
  assert np.any(raw == 0)
  compute, _ = w.draw(np.random.default_rng(0), 0, 0, 4096)
  np.testing.assert_array_equal(compute, np.maximum(raw, tiny))
  sched = C.simulate(C.asp(), w, 50)
  assert np.all(np.diff(np.r_[0.0, sched.time]) >= 0) and sched.time[-1] > 0
  # Ordinary times are not touched.
  w = C.workers(3, compute="gamma", seed=1)
  np.testing.assert_array_equal(w.draw(np.random.default_rng(3), 1, 0, 100)[0],
                                C.gamma().sample(np.random.default_rng(3), 100))


def test_a_zero_compute_time_is_refused_rather_than_one_worker_taking_every_update():
  with pytest.raises(ValueError, match=r"compute must be a compute time > 0 seconds .*got the constant 0.0"):
    C.workers(4, compute=C.constant(0.0))
  # A latency may be 0, and then the compute time alone sets the order: every worker contributes.
  sched = C.simulate(C.asp(), C.workers(4, compute=C.constant(1.0), comm=0.0), 40)
  np.testing.assert_array_equal(np.bincount(sched.contributions.worker, minlength=4), [10] * 4)
