"""Delayed Nesterov (Liu et al. 2024)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)


@pytest.mark.parametrize("lr", [0.3, optax.linear_schedule(0.5, 0.1, 4)])
def test_buffer_one_is_optax_nesterov_bit_for_bit(lr):
  params = params_tree()
  tx, ref = dj.delayed_nesterov(lr, 0.9, buffer_size=1), optax.sgd(lr, momentum=0.9, nesterov=True)
  s, r = tx.init(params), ref.init(params)
  for i in range(5):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, staleness=0, stale_params=params, worker=0)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)


def test_each_cycle_sums_to_one_synchronous_nesterov_step_on_the_mean():
  params, n, eps, beta = params_tree(), 4, 0.7, 0.9
  tx, ref = dj.delayed_nesterov(eps, beta, buffer_size=n), optax.sgd(eps, momentum=beta, nesterov=True)
  s, r = tx.init(params), ref.init(params)
  for cycle in range(3):
    grads = [random_like(params, 10 * cycle + j) for j in range(n)]
    total = jax.tree.map(jnp.zeros_like, params)
    for g in grads:
      u, s = tx.update(g, s, params)
      total = jax.tree.map(jnp.add, total, u)
    mean = jax.tree.map(lambda *gs: sum(gs) / n, *grads)
    v, r = ref.update(mean, r, params)
    chex.assert_trees_all_close(total, v, rtol=2e-5, atol=1e-6)


def test_numpy_reference():
  params, n, eps, beta = params_tree(), 3, 0.5, 0.8
  tx = dj.delayed_nesterov(eps, beta, buffer_size=n)
  state = tx.init(params)
  m = {k: np.zeros(p.shape) for k, p in params.items()}
  b = {k: np.zeros(p.shape) for k, p in params.items()}
  for i in range(8):
    g = random_like(params, 40 + i)
    u, state = tx.update(g, state, params)
    for k in params:
      gk = np.asarray(g[k], np.float64)
      b[k] = b[k] + gk
      if (i + 1) % n == 0:
        m[k] = beta * m[k] + b[k] / n
        b[k] = np.zeros_like(b[k])
        expected = -eps * (gk / n + beta * m[k])
      else:
        expected = -eps * gk / n
      np.testing.assert_allclose(u[k], expected, rtol=1e-5, atol=1e-7)


def test_pseudo_gradient_of_one_local_step_is_the_gradient():
  # The outer-optimizer use: theta_read - theta_local after one local SGD step of rate 1 is the gradient.
  params = params_tree()
  g = random_like(params, 3)
  local = jax.tree.map(lambda p, gg: p - 1.0 * gg, params, g)
  pseudo = jax.tree.map(lambda p, l: p - l, params, local)
  tx = dj.delayed_nesterov(0.7, 0.9, buffer_size=1)
  u, _ = tx.update(pseudo, tx.init(params), params)
  v, _ = tx.update(g, tx.init(params), params)
  chex.assert_trees_all_close(u, v, rtol=1e-6)


def test_state_jit_and_chain():
  params = params_tree()
  tx = dj.delayed_nesterov(0.1, 0.9, buffer_size=3)
  state = tx.init(params)
  assert state.pending.dtype == jnp.int32 and state.count.dtype == jnp.int32
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i)})
  assert_chain_and_unknown_extra_args(tx, params, {"worker": 1})


@pytest.mark.parametrize("kwargs, err, match", [
    ({"buffer_size": 0}, ValueError, "buffer_size must be an integer >= 1, got 0"),
    ({"buffer_size": -3}, ValueError, "buffer_size must be an integer >= 1"),
    ({"momentum": 1.2}, ValueError, "momentum must be < 1.0"),
    ({"momentum": 1.0}, ValueError, "momentum must be < 1"),
    ({"learning_rate": -0.1}, ValueError, "learning_rate must be > 0.0"),
])
def test_bad_arguments(kwargs, err, match):
  args = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(err, match=match):
    dj.delayed_nesterov(**args)
