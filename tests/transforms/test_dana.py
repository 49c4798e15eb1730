"""DANA (Hakimi et al.): per-worker momentum, look-ahead read through read_params."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, assert_same_updates_as,
                           params_tree, random_like)


@pytest.mark.parametrize("dana, nesterov", [(dj.dana, False), (dj.dana_slim, True)])
def test_one_worker_is_sgd_momentum_bit_for_bit(dana, nesterov):
  """DANA-Zero's update is heavy-ball SGD's (its look-ahead is the read); DANA-Slim's is Nesterov SGD's."""
  assert_same_updates_as(dana(0.05, momentum=0.9, num_workers=1), optax.sgd(0.05, momentum=0.9, nesterov=nesterov),
                         {"worker": 0, "staleness": 0}, steps=5)


def test_one_worker_schedule_is_sgd_momentum_bit_for_bit():
  params = params_tree()
  lr = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
  tx, ref = dj.dana(lr, momentum=0.5), optax.sgd(lr, momentum=0.5)
  s, r = tx.init(params), ref.init(params)
  for i in range(4):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, worker=0)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)
    # The look-ahead uses the learning rate of the next update.
    np.testing.assert_allclose(s.lookahead, 0.1 * 0.5 ** (i + 1) * 0.5, rtol=1e-6)


@pytest.mark.parametrize("variant", ["zero", "slim"])
def test_numpy_reference_with_worker_reads(variant):
  """A server and M workers on a quadratic, each gradient computed at what its worker read.

  DANA-Zero: the server keeps every v_i, steps by v_i and sends the look-ahead x - eta gamma sum_j v_j.
  DANA-Slim: worker i keeps v_i and pushes g + gamma v_i; the server applies it and sends x itself.
  """
  eta, gamma, m_workers = 0.05, 0.8, 3
  a = np.diag([1.0, 3.0, 0.5])
  tx = (dj.dana if variant == "zero" else dj.dana_slim)(eta, momentum=gamma, num_workers=m_workers)
  x = jnp.array([1.0, -2.0, 0.5], jnp.float32)
  state = tx.init(x)
  # NumPy server and workers.
  xn = np.asarray(x, np.float64)
  v = np.zeros((m_workers, 3))
  read_np = {i: xn.copy() for i in range(m_workers)}
  read_dj = {i: x for i in range(m_workers)}
  rng = np.random.default_rng(0)
  for _ in range(12):
    i = int(rng.integers(m_workers))
    g = a @ read_np[i]
    v[i] = gamma * v[i] + g
    if variant == "zero":
      xn = xn - eta * v[i]
      read_np[i] = xn - eta * gamma * v.sum(axis=0)
    else:
      xn = xn - eta * (g + gamma * v[i])
      read_np[i] = xn.copy()

    u, state = tx.update(jnp.asarray(a @ np.asarray(read_dj[i]), jnp.float32), state, x, worker=jnp.int32(i))
    x = optax.apply_updates(x, u)
    read_dj[i] = dj.read_params(state, x, worker=jnp.int32(i))
    np.testing.assert_allclose(x, xn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read_dj[i], read_np[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.momentum[i], v[i], rtol=1e-5, atol=1e-6)


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
  chex.assert_trees_all_equal(u, v)
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
    ({"dc_lambda": -1.0}, ValueError, "dc_lambda must be >= 0.0"),
])
def test_bad_arguments(kwargs, err, match):
  args = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(err, match=match):
    dj.dana(**args)


def test_slim_parameters_are_dana_zero_lookahead():
  """Same gradients and workers: DANA-Slim's parameters are DANA-Zero's look-ahead after every update."""
  params = params_tree()
  zero, slim = dj.dana(0.1, 0.7, num_workers=3), dj.dana_slim(0.1, 0.7, num_workers=3)
  sz, ss = zero.init(params), slim.init(params)
  xz, xs = params, params
  for k, w in enumerate([0, 2, 2, 1, 0, 1, 2, 0]):
    g = random_like(params, 50 + k)
    uz, sz = zero.update(g, sz, xz, worker=w)
    us, ss = slim.update(g, ss, xs, worker=w)
    xz, xs = optax.apply_updates(xz, uz), optax.apply_updates(xs, us)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 dj.read_params(sz, xz, worker=w), xs)
    chex.assert_trees_all_equal(sz.momentum, ss.momentum)


def test_slim_state_jit_chain_and_dc():
  params = params_tree()
  tx = dj.dana_slim(0.1, 0.9, num_workers=4)
  state = tx.init(params)
  assert state.momentum["w"].shape == (4, 2, 2) and state.count.dtype == jnp.int32
  assert not hasattr(state, "read_params")  # workers read the parameters as they are
  assert_jit_traces_once(tx, params, lambda i: {"worker": jnp.int32(i % 4)})
  assert_chain_and_unknown_extra_args(tx, params, {"worker": 3, "staleness": 2})
  stale = random_like(params, 3, scale=0.1)
  g = random_like(params, 4)
  with_dc, plain = dj.dana_slim(0.1, 0.9, 2, dc_lambda=0.5), dj.dana_slim(0.1, 0.9, 2)
  u, _ = with_dc.update(g, with_dc.init(params), params, worker=1, stale_params=stale)
  corrected = jax.tree.map(lambda gg, w, wb: gg + 0.5 * gg * gg * (w - wb), g, params, stale)
  v, _ = plain.update(corrected, plain.init(params), params, worker=1)
  chex.assert_trees_all_equal(u, v)
  with pytest.raises(ValueError, match="dana_slim needs the extra argument worker="):
    tx.update(params, state, params)
  with pytest.raises(ValueError, match=r"worker must be in \[0, 4\), got 4"):
    tx.update(params, state, params, worker=4)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"learning_rate": -0.1}, ValueError, "learning_rate must be > 0.0"),
    ({"momentum": 1.0}, ValueError, "momentum must be < 1"),
    ({"num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
    ({"num_workers": 2.0}, TypeError, "num_workers must be an integer"),
    ({"dc_adaptive": True}, ValueError, "dc_adaptive=True needs dc_lambda"),
])
def test_slim_bad_arguments(kwargs, err, match):
  args = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(err, match=match):
    dj.dana_slim(**args)
