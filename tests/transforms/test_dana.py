"""DANA (Hakimi et al.): per-worker momentum, look-ahead read through read_params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)


def test_one_worker_is_sgd_momentum_bit_for_bit():
  params = params_tree()
  tx, ref = dj.dana(0.05, momentum=0.9, num_workers=1), optax.sgd(0.05, momentum=0.9)
  s, r = tx.init(params), ref.init(params)
  for i in range(5):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, worker=0, staleness=0, stale_params=params)
    v, r = ref.update(g, r, params)
    jax.tree.map(np.testing.assert_array_equal, u, v)
    params = optax.apply_updates(params, u)


def test_one_worker_schedule_is_sgd_momentum_bit_for_bit():
  params = params_tree()
  lr = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
  tx, ref = dj.dana(lr, momentum=0.5), optax.sgd(lr, momentum=0.5)
  s, r = tx.init(params), ref.init(params)
  for i in range(4):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, worker=0)
    v, r = ref.update(g, r, params)
    jax.tree.map(np.testing.assert_array_equal, u, v)
    # The look-ahead uses the learning rate of the next update.
    np.testing.assert_allclose(s.lookahead, 0.1 * 0.5 ** (i + 1) * 0.5, rtol=1e-6)


def test_numpy_reference_with_lookahead_reads():
  """A server and M workers on a quadratic, each gradient computed at the look-ahead its worker read."""
  eta, gamma, m_workers = 0.05, 0.8, 3
  a = np.diag([1.0, 3.0, 0.5])

  def grad(x):
    return a @ x

  tx = dj.dana(eta, momentum=gamma, num_workers=m_workers)
  x = jnp.array([1.0, -2.0, 0.5], jnp.float32)
  state = tx.init(x)
  # NumPy server.
  xn = np.asarray(x, np.float64)
  v = np.zeros((m_workers, 3))
  read_np = {i: xn.copy() for i in range(m_workers)}
  read_dj = {i: x for i in range(m_workers)}
  rng = np.random.default_rng(0)
  for _ in range(12):
    i = int(rng.integers(m_workers))
    g = grad(read_np[i])
    v[i] = gamma * v[i] + g
    xn = xn - eta * v[i]
    read_np[i] = xn - eta * gamma * v.sum(axis=0)

    u, state = tx.update(jnp.asarray(grad(np.asarray(read_dj[i])), jnp.float32), state, x, worker=jnp.int32(i))
    x = optax.apply_updates(x, u)
    read_dj[i] = dj.read_params(state, x, worker=jnp.int32(i))
    np.testing.assert_allclose(x, xn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read_dj[i], read_np[i], rtol=1e-5, atol=1e-6)


def test_read_params_sums_all_workers_momenta():
  params = params_tree()
  tx = dj.dana(0.1, momentum=0.5, num_workers=3)
  state = tx.init(params)
  g0, g2 = random_like(params, 0), random_like(params, 2)
  _, state = tx.update(g0, state, params, worker=0)
  _, state = tx.update(g2, state, params, worker=2)
  look = dj.read_params(state, params, worker=1)
  for n in params:
    expected = np.asarray(params[n]) - 0.1 * 0.5 * (np.asarray(g0[n]) + np.asarray(g2[n]))
    np.testing.assert_allclose(look[n], expected, rtol=1e-6, atol=1e-7)
  # The momentum of a worker that never pushed stays zero.
  jax.tree.map(lambda v: np.testing.assert_array_equal(v[1], 0.0), state.momentum)


def test_dc_term_matches_delay_compensation_then_dana():
  params = params_tree()
  stale = random_like(params, 3, scale=0.1)
  g = random_like(params, 4)
  tx = dj.dana(0.1, 0.9, num_workers=2, dc_lambda=0.5)
  u, state = tx.update(g, tx.init(params), params, worker=1, stale_params=stale)
  corrected = jax.tree.map(lambda gg, w, wb: gg + 0.5 * gg * gg * (w - wb), g, params, stale)
  ref = dj.dana(0.1, 0.9, num_workers=2)
  v, _ = ref.update(corrected, ref.init(params), params, worker=1)
  jax.tree.map(np.testing.assert_array_equal, u, v)
  # The read hook is found inside the chain.
  look = dj.read_params(state, params, worker=0)
  jax.tree.map(lambda l, p, c: np.testing.assert_allclose(l, p - 0.1 * 0.9 * c, rtol=1e-6), look, params, corrected)


def test_state_shapes_jit_and_chain():
  params = params_tree()
  tx = dj.dana(0.1, 0.9, num_workers=4)
  state = tx.init(params)
  assert state.momentum["w"].shape == (4, 2, 2) and state.momentum["b"].shape == (4, 2)
  assert state.count.dtype == jnp.int32 and state.lookahead.dtype == jnp.float32
  assert_jit_traces_once(tx, params, lambda i: {"worker": jnp.int32(i % 4)})
  assert_chain_and_unknown_extra_args(tx, params, {"worker": 3, "staleness": 2})


def test_missing_or_bad_worker():
  params = params_tree()
  tx = dj.dana(0.1, 0.9, num_workers=2)
  with pytest.raises(ValueError, match="needs the extra argument worker="):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match=r"worker must be in \[0, 2\), got 2"):
    tx.update(params, tx.init(params), params, worker=2)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be > 0.0"),
    ({"momentum": 1.0}, ValueError, "momentum must be < 1"),
    ({"momentum": -0.1}, ValueError, "momentum must be >= 0.0"),
    ({"num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
    ({"dc_adaptive": True}, ValueError, "dc_adaptive=True needs dc_lambda"),
    ({"dc_lambda": -1.0}, ValueError, "lam must be >= 0.0"),
])
def test_bad_arguments(kwargs, err, match):
  args = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(err, match=match):
    dj.dana(**args)
