"""dj.analysis.elastic_consistency: the measured gap ||x_t - v_t|| and the constant B, against closed forms and NumPy.

With a constant gradient c (a linear loss) SGD's true parameters are x_t = x_0 - t eta c, so a read d updates old
is eta min(t, d) c away: the gap is known in closed form for stale reads (eta min(t, tau) ||c||) and for torn
reads (eta sqrt(sum_i c_i^2 min(t, d_{t,b(i)})^2)). The reads come from the runtime itself: a transformation keeps
the stale_params it is given (the update's read) in its state, and the evaluation returns them with the version.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax import analysis

LR = 0.05
C = np.array([0.3, -0.4, 1.2, 0.5, -0.7], np.float32)


class _KeptRead(NamedTuple):
  read: Any  # like params: the stale_params of the last update


def _keep_read():
  def init_fn(params):
    return _KeptRead(jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None, *, stale_params, **extra):
    del params, extra
    return updates, _KeptRead(stale_params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _linear(w, batch):
  del batch
  return jnp.dot(w, jnp.asarray(C))


def _true_and_read(source, num_updates, seed=0):
  """x_0..x_{U-1} and v_0..v_{U-1} of SGD (LR) on the linear loss, from the runtime."""
  tx = optax.chain(_keep_read(), optax.sgd(LR))
  result = dj.simulate(_linear, tx, jnp.zeros(5), {"x": np.zeros((4, 1), np.float32)}, source,
                       num_updates=num_updates, seed=seed, sampling=dj.Sampling(batch_size=1),
                       record=dj.Record(every=1, eval_fn=lambda p, s: (p, s[0].read), eval_state=True))
  versions, reads = (np.asarray(x, np.float64) for x in result.history.eval_metrics)
  # Evaluation k is made after update k - 1: its read is that update's.
  return versions[:-1], reads[1:], result


def test_stale_reads_gap_is_the_closed_form():
  tau, num_updates = 3, 20
  x, v, _ = _true_and_read(dj.delays.constant(tau), num_updates)
  m = analysis.elastic_consistency(x, v, LR)
  t = np.arange(num_updates)
  expected = LR * np.minimum(t, tau) * np.linalg.norm(C.astype(np.float64))
  np.testing.assert_allclose(m.gap, expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m.b_max, tau * np.linalg.norm(C.astype(np.float64)), rtol=1e-5)
  np.testing.assert_allclose(m.b_rms, np.sqrt(np.mean(expected ** 2)) / LR, rtol=1e-5)


def test_torn_reads_gap_is_the_closed_form():
  tau, num_updates, seed = 4, 30, 7
  params = jnp.zeros(5)
  model = dj.delays.torn(params, dj.delays.uniform(tau), block_size=2)
  x, v, result = _true_and_read(model, num_updates, seed)
  # Each coordinate's delay, drawn as dj.delays.torn's docstring says (blocks {0, 1}, {2, 3}, {4}).
  key = jax.random.fold_in(jax.random.key(seed), 0)
  t = np.arange(num_updates)
  delays = np.array([[int(dj.delays.uniform(tau).sample(jax.random.fold_in(jax.random.fold_in(key, u), b), u))
                      for b in (0, 0, 1, 1, 2)] for u in t])
  expected = LR * np.sqrt(np.sum((C.astype(np.float64) * np.minimum(t[:, None], delays)) ** 2, axis=1))
  m = analysis.elastic_consistency(x, v, LR)
  np.testing.assert_allclose(m.gap, expected, rtol=1e-5, atol=1e-7)
  # The reads tear, and B stays within the delay bound tau * M (M = ||c||, every gradient's norm).
  assert np.any(delays.min(axis=1) != delays.max(axis=1))
  assert m.b_max <= tau * np.linalg.norm(C) * (1 + 1e-5)


def test_the_measurement_equals_a_numpy_computation_on_trees():
  rng = np.random.default_rng(3)
  true = {"a": rng.normal(size=(12, 2, 3)), "b": rng.normal(size=(12,))}
  read = {"a": rng.normal(size=(12, 2, 3)), "b": rng.normal(size=(12,))}
  m = analysis.elastic_consistency(true, read, 0.2)
  gap = np.array([np.sqrt(np.sum((true["a"][t] - read["a"][t]) ** 2) + (true["b"][t] - read["b"][t]) ** 2)
                  for t in range(12)])
  np.testing.assert_allclose(m.gap, gap, rtol=1e-12)
  np.testing.assert_allclose(m.b_max, gap.max() / 0.2, rtol=1e-12)
  np.testing.assert_allclose(m.b_rms, np.sqrt(np.mean(gap ** 2)) / 0.2, rtol=1e-12)
  # Equal parameters: no gap.
  assert analysis.elastic_consistency(true, true, 0.2).b_max == 0.0


@pytest.mark.parametrize("true,read,lr,error,match", [
    (np.zeros((4, 2)), np.zeros((4, 3)), 0.1, ValueError, "shapes of true_params"),
    (np.zeros((4, 2)), np.zeros((5, 2)), 0.1, ValueError, "shapes of true_params"),
    ({"a": np.zeros((4, 2))}, np.zeros((4, 2)), 0.1, ValueError, "tree of true_params"),
    (np.zeros((4, 2)), np.zeros((4, 2)), 0.0, ValueError, "learning_rate"),
    (np.zeros((4, 2)), np.zeros((4, 2)), "0.1", TypeError, "learning_rate"),
    (np.float64(1.0), np.float64(1.0), 0.1, TypeError, "leading"),
    ({"a": np.zeros((4, 2)), "b": np.zeros(3)}, {"a": np.zeros((4, 2)), "b": np.zeros(3)}, 0.1, ValueError,
     "share their leading"),
    (np.zeros((0, 2)), np.zeros((0, 2)), 0.1, ValueError, "at least one update"),
    ({}, {}, 0.1, ValueError, "at least one array"),
])
def test_bad_inputs_are_refused_by_name(true, read, lr, error, match):
  with pytest.raises(error, match=match):
    analysis.elastic_consistency(true, read, lr)
