"""``dj.Execution(like=...)`` in ``dj.simulate``: one compiled program for a sweep over schedules, same numbers.

A sweep over delay bounds or paradigms of the same workers plans programs of different sizes (a larger
bound keeps more gradients in flight); with ``like`` every run is sized for all of them, so the sweep
compiles once, and the padding changes nothing: each run equals the run without ``like`` bit for bit.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine as engine

BATCH = 4
BOUNDS = (0, 2, 5)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  return {"x": x, "y": np.tanh(x @ np.array([1.0, -2.0, 0.5], np.float32))}


def _loss(params, batch):
  return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"]) ** 2)


def _run(data, source, like=None, seed=1, tx=None, **kwargs):
  return dj.simulate(_loss, tx or optax.sgd(0.05, momentum=0.9), {"w": jnp.zeros(3, jnp.float32)}, data, source, seed=seed,
                     sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(lanes=2, like=like), **kwargs)


def _assert_same(a, b):
  np.testing.assert_array_equal(np.asarray(a.params["w"]), np.asarray(b.params["w"]))
  np.testing.assert_array_equal(a.history.loss, b.history.loss)
  np.testing.assert_array_equal(a.history.staleness, b.history.staleness)


def _bounds(num_updates=60, seed=3):
  return {s: dj.runtime.schedule_from_delays(dj.delays.uniform(s), num_updates, seed, num_workers=max(BOUNDS) + 1)
          for s in BOUNDS}


def test_a_sweep_over_delay_bounds_compiles_once_and_each_run_is_unchanged(data):
  schedules = _bounds()
  alone = {}
  engine.clear_cache()
  misses = engine.cache_info()["misses"]
  for s, schedule in schedules.items():
    alone[s] = _run(data, schedule)
  # Without like the bounds need programs of their own (the gradients in flight differ).
  assert engine.cache_info()["misses"] - misses > 1
  engine.clear_cache()
  misses = engine.cache_info()["misses"]
  for s, schedule in schedules.items():
    shared = _run(data, schedule, like=[other for t, other in schedules.items() if t != s])
    _assert_same(shared, alone[s])
  assert engine.cache_info()["misses"] - misses == 1


def test_paradigms_of_one_cluster_share_a_program(data):
  workers = dj.cluster.workers(4, compute="gamma")
  schedules = [dj.cluster.simulate(paradigm, workers, 40, seed=2)
               for paradigm in (dj.cluster.asp(), dj.cluster.ssp(1), dj.cluster.k_async(1))]
  engine.clear_cache()
  misses = engine.cache_info()["misses"]
  shared = [_run(data, schedule, like=schedules[:i] + schedules[i + 1:], tx=optax.sgd(0.1))
            for i, schedule in enumerate(schedules)]
  assert engine.cache_info()["misses"] - misses == 1
  for schedule, result in zip(schedules, shared, strict=True):
    _assert_same(result, _run(data, schedule, tx=optax.sgd(0.1)))


def test_schedule_from_delays_is_what_a_delay_model_runs(data):
  model = dj.delays.uniform(3)
  schedule = dj.runtime.schedule_from_delays(model, 50, 7)
  assert schedule.num_workers == 4
  _assert_same(_run(data, schedule, seed=7), _run(data, model, seed=7, num_updates=50))
  # More workers: the same reads, round robin over all of them.
  wide = dj.runtime.schedule_from_delays(model, 50, 7, num_workers=9)
  np.testing.assert_array_equal(wide.max_staleness, schedule.max_staleness)
  t = np.arange(50)
  assert np.array_equal(wide.contributes[t, t % 9], np.ones(50, bool))


def test_like_refuses_schedules_one_program_cannot_serve(data):
  schedules = _bounds()
  with pytest.raises(TypeError, match=r"Execution.like\[0\] must be a dj.cluster.Schedule, got Uniform"):
    _run(data, schedules[0], like=[dj.delays.uniform(2)])
  narrow = dj.runtime.schedule_from_delays(dj.delays.uniform(2), 60, 3)
  with pytest.raises(ValueError, match=r"Execution.like\[0\] has 3 workers, but source has 6"):
    _run(data, schedules[0], like=[narrow])
  workers = dj.cluster.workers(6)
  pairs = dj.cluster.simulate(dj.cluster.k_sync(2), workers, 30, seed=0)
  with pytest.raises(ValueError, match=r"Execution.like\[0\] has up to 2 contributions per update, but source up "
                                       r"to 1"):
    _run(data, schedules[0], like=[pairs])
  with pytest.raises(ValueError, match="Execution.like is defined for a schedule or a delay model read whole"):
    _run_leaves(data, schedules[2])
  with pytest.raises(ValueError, match=r"num_workers must be None or at least max_delay \+ 1 = 6"):
    dj.runtime.schedule_from_delays(dj.delays.uniform(5), 10, 0, num_workers=4)


def _run_leaves(data, like):
  model = dj.delays.per_leaf({"w": dj.delays.uniform(5), "b": dj.delays.constant(1)})
  return dj.simulate(lambda p, b: _loss({"w": p["w"] + p["b"]}, b), optax.sgd(0.1),
                     {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros(3, jnp.float32)}, data, model, num_updates=60,
                     seed=3, sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(lanes=2, like=[like]))
