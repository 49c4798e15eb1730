"""Async-SGDI's growing minibatches: the schedule, and dj.simulate on it against a NumPy re-implementation."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import batch_growth, minibatch_indices


@pytest.mark.parametrize("initial,rate,power,maximum", [(1, 1.0, 1.0, None), (2, 0.3, 0.5, None), (1, 2.0, 2.0, 40),
                                                        (3, 0.0, 1.0, None)])
def test_batch_growth_is_the_formula(initial, rate, power, maximum):
  got = batch_growth(50, initial=initial, rate=rate, power=power, maximum=maximum)
  want = [min(maximum or math.inf, math.ceil(round(initial * (1 + rate * u) ** power, 9))) for u in range(50)]
  np.testing.assert_array_equal(got, want)


def test_growing_batches_keeps_the_schedule_and_multiplies_k_batch_counts():
  base = dj.cluster.Schedule(time=np.arange(4.0), contributes=np.array([[1, 0], [0, 1], [1, 1], [1, 0]], bool),
                             read_version=np.array([[0, -1], [-1, 0], [1, 2], [3, -1]]), wait=np.zeros(2),
                             num_batches=np.array([[2, 0], [0, 1], [1, 3], [1, 0]]))
  grown = dj.growing_batches(base, initial=1, rate=1.0)
  np.testing.assert_array_equal(grown.read_version, base.read_version)
  np.testing.assert_array_equal(grown.time, base.time)
  np.testing.assert_array_equal(grown.num_batches, [[2, 0], [0, 2], [3, 9], [4, 0]])
  assert grown[:2].num_updates == 2 and dj.growing_batches(base, 2).num_updates == 2


def test_simulate_averages_the_grown_minibatches_at_the_stale_read():
  rng = np.random.default_rng(0)
  x = rng.standard_normal(64).astype(np.float32)
  tau, lr, steps, seed = 2, 0.3, 30, 5
  schedule = dj.growing_batches(dj.delays.constant(tau), steps, initial=1, rate=0.25, maximum=6, seed=seed)
  result = dj.simulate(lambda w, batch: 0.5 * jnp.mean((w - batch["x"]) ** 2), optax.sgd(lr), jnp.float32(3.0),
                       {"x": jnp.asarray(x)}, schedule, sampling=dj.Sampling(batch_size=2), seed=seed)
  # NumPy: w_{u+1} = w_u - lr (w_read - mean of the b_u minibatches the worker draws, counted per worker).
  versions, draws = [3.0], np.zeros(tau + 1, int)
  for u in range(steps):
    m, b = u % (tau + 1), int(schedule.num_batches[u].max())
    idx = np.concatenate([np.asarray(minibatch_indices(seed, u, m, draws[m] + k, num_examples=64, batch_size=2))
                          for k in range(b)])
    draws[m] += b
    read = versions[max(0, u - tau)]
    versions.append(versions[u] - lr * (read - x[idx].astype(np.float64).mean()))
  np.testing.assert_allclose(float(result.params), versions[-1], rtol=1e-5)


def test_bad_inputs():
  with pytest.raises(ValueError, match="initial"):
    batch_growth(10, initial=0)
  with pytest.raises(ValueError, match="rate"):
    batch_growth(10, rate=-1.0)
  with pytest.raises(ValueError, match="maximum"):
    batch_growth(10, initial=4, maximum=2)
  with pytest.raises(ValueError, match="num_updates is required"):
    dj.growing_batches(dj.delays.constant(1))
  with pytest.raises(ValueError, match="per_leaf"):
    dj.growing_batches(dj.delays.per_leaf({"a": dj.delays.constant(1)}), 5)
  with pytest.raises(ValueError, match="num_updates must be <="):
    dj.growing_batches(dj.growing_batches(dj.delays.constant(1), 3), 5)
