"""Proximal operators (L1, elastic net, box) against their definition, and the proximal step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import optimize

import delayjax as dj

POINTS = np.array([-3.0, -0.7, -0.2, 0.0, 0.05, 0.4, 1.3, 5.0], np.float32)


def argmin_1d(objective, x):
  """The minimizer of a 1-d convex function, by bounded scalar minimization in float64."""
  res = optimize.minimize_scalar(objective, bounds=(x - 10.0, x + 10.0), method="bounded",
                                 options={"xatol": 1e-12})
  return res.x


@pytest.mark.parametrize("step", [0.1, 0.5, 2.0])
def test_l1_and_elastic_net_are_the_minimizers_of_their_definition(step):
  l1, l2 = 0.3, 0.8
  soft = np.asarray(dj.prox_l1(l1)(jnp.asarray(POINTS, jnp.float32), step))
  net = np.asarray(dj.prox_elastic_net(l1, l2)(jnp.asarray(POINTS, jnp.float32), step))
  for k, x in enumerate(POINTS):
    # prox_{step R}(x) = argmin_z (z - x)^2 / 2 + step R(z)
    want_soft = argmin_1d(lambda z: 0.5 * (z - x) ** 2 + step * l1 * abs(z), x)
    want_net = argmin_1d(lambda z: 0.5 * (z - x) ** 2 + step * (l1 * abs(z) + 0.5 * l2 * z * z), x)
    np.testing.assert_allclose(soft[k], want_soft, atol=1e-5)
    np.testing.assert_allclose(net[k], want_net, atol=1e-5)
  # Soft thresholding: exact zeros inside [-step l1, step l1], a shift by step l1 outside.
  inside = np.abs(POINTS) <= step * l1
  assert np.all(soft[inside] == 0.0)
  np.testing.assert_allclose(soft[~inside], POINTS[~inside] - np.sign(POINTS[~inside]) * step * l1, rtol=1e-6)
  # With l1 = 0 the elastic net is a pure shrinkage x / (1 + step l2).
  ridge = dj.prox_elastic_net(0.0, l2)(jnp.asarray(POINTS, jnp.float32), step)
  np.testing.assert_allclose(ridge, POINTS / (1.0 + step * l2), rtol=1e-6)


def test_box_is_the_projection_with_scalar_or_per_leaf_bounds():
  x = {"w": jnp.asarray(POINTS, jnp.float32), "b": jnp.array([-2.0, 2.0], jnp.float32)}
  out = dj.prox_box(-0.5, 1.0)(x, 123.0)
  np.testing.assert_array_equal(out["w"], np.clip(POINTS, -0.5, 1.0))
  np.testing.assert_array_equal(out["b"], [-0.5, 1.0])
  lower = {"w": jnp.zeros(8), "b": jnp.array([-jnp.inf, 0.0])}
  upper = {"w": jnp.full(8, jnp.inf), "b": jnp.array([-1.0, 1.0])}
  out = dj.prox_box(lower, upper)(x, 0.1)
  np.testing.assert_array_equal(out["w"], np.maximum(POINTS, np.float32(0.0)))
  np.testing.assert_array_equal(out["b"], [-2.0, 1.0])


def test_proximal_step_applies_the_prox_after_the_step_with_its_schedule():
  schedule = optax.linear_schedule(0.5, 0.1, 4)
  tx = optax.chain(optax.sgd(schedule), dj.proximal(dj.prox_elastic_net(0.2, 1.0), schedule))
  w = jnp.asarray(POINTS, jnp.float32)
  state = tx.init(w)
  update = jax.jit(tx.update)
  w_ref = POINTS.astype(np.float64)
  for t in range(4):
    g = jnp.sin(w)
    u, state = update(g, state, w)
    w = optax.apply_updates(w, u)
    gamma = float(schedule(t))
    z = w_ref - gamma * np.sin(w_ref)
    w_ref = np.sign(z) * np.maximum(np.abs(z) - gamma * 0.2, 0.0) / (1.0 + gamma * 1.0)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
  assert update._cache_size() == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(dtype):
  w = {"a": jnp.ones(3, dtype), "b": jnp.zeros(2, dtype)}
  for prox in (dj.prox_l1(0.1), dj.prox_elastic_net(0.1, 0.1), dj.prox_box(-1.0, 0.5)):
    tx = dj.proximal(prox, 0.1)
    u, _ = tx.update(w, tx.init(w), w, unknown_argument=1)
    assert all(x.dtype == dtype for x in jax.tree.leaves(u))


def test_bad_input():
  with pytest.raises(ValueError, match="strength must be >= 0"):
    dj.prox_l1(-1.0)
  with pytest.raises(ValueError, match="l2 must be >= 0"):
    dj.prox_elastic_net(0.1, -0.1)
  with pytest.raises(ValueError, match="lower must be <= upper"):
    dj.prox_box(1.0, 0.0)
  with pytest.raises(ValueError, match="lower must be a number"):
    dj.prox_box(float("nan"), 0.0)
  with pytest.raises(TypeError, match="prox must be a callable"):
    dj.proximal(0.1, 0.1)
  with pytest.raises(ValueError, match="learning_rate must be > 0"):
    dj.proximal(dj.prox_l1(0.1), 0.0)
  tx = dj.proximal(dj.prox_l1(0.1), 0.1)
  with pytest.raises(ValueError, match="proximal needs params"):
    tx.update(jnp.ones(2), tx.init(jnp.ones(2)))
