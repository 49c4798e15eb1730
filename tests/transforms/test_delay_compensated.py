"""dj.delay_compensated: DC-ASGD with the inner optimizer's second moment, against NumPy and Optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

pytestmark = pytest.mark.standard_promotion  # optax.adam's bias correction mixes float and int32

DIM = 5
A = np.diag(np.linspace(0.5, 3.0, DIM)).astype(np.float32)
B = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
LR, B1, B2, EPS = 0.05, 0.9, 0.99, 1e-8


def numpy_delayed_adam(tau, lam, steps):
  """Hand loop: the gradient of call t, computed at w_t, is applied at call t + tau, corrected by
  lam * nu * (w - w_t) with Adam's second moment nu as it stands before this gradient enters it."""
  w, m, nu, count, pending = np.zeros(DIM), np.zeros(DIM), np.zeros(DIM), 0, []
  for t in range(steps):
    pending.append((A @ w - B, w.copy()))
    if t < tau:
      continue
    g, w_bak = pending.pop(0)
    g = g + lam * nu * (w - w_bak)
    count += 1
    m = B1 * m + (1 - B1) * g
    nu = B2 * nu + (1 - B2) * g * g
    w = w - LR * (m / (1 - B1**count)) / (np.sqrt(nu / (1 - B2**count)) + EPS)
  return w


def run_delayed(tx, tau, steps):
  tx = dj.delayed(tx, dj.delays.constant(tau))
  params = {"w": jnp.zeros(DIM)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(steps):
    u, state = update({"w": jnp.asarray(A) @ params["w"] - jnp.asarray(B)}, state, params)
    params = optax.apply_updates(params, u)
  return np.asarray(params["w"])


@pytest.mark.parametrize("tau", [2, 4])
def test_delayed_adam_with_its_own_curvature_matches_numpy(tau):
  lam, steps = 20.0, 40
  got = run_delayed(dj.delay_compensated(optax.adam(LR, B1, B2, EPS), lam), tau, steps)
  np.testing.assert_allclose(got, numpy_delayed_adam(tau, lam, steps), rtol=2e-5, atol=1e-6)
  # The correction changed the run (a bound met by an uncorrected one would say nothing).
  assert not np.allclose(numpy_delayed_adam(tau, 0.0, steps), numpy_delayed_adam(tau, lam, steps), atol=1e-3)


def test_zero_staleness_is_the_inner_optimizer_bit_for_bit():
  tx, plain = dj.delay_compensated(optax.adam(LR), 5.0), optax.adam(LR)
  p, q = {"w": jnp.ones(DIM)}, {"w": jnp.ones(DIM)}
  s, r = tx.init(p), plain.init(q)
  for _ in range(5):
    u, s = tx.update(jax.grad(lambda x: jnp.sum(x["w"] ** 3))(p), s, p, stale_params=p)
    v, r = plain.update(jax.grad(lambda x: jnp.sum(x["w"] ** 3))(q), r, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  np.testing.assert_array_equal(p["w"], q["w"])


def test_muon_matrices_have_no_second_moment_and_pass_uncorrected():
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.ones(3)}
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
  stale = jax.tree.map(lambda x: x - 0.5, params)
  muon = optax.contrib.muon(0.02)
  tx = dj.delay_compensated(muon, 50.0)
  s, r = tx.init(params), muon.init(params)
  for _ in range(3):  # Adam's nu is zero at the first step; later ones correct the bias
    u, s = tx.update(grads, s, params, stale_params=stale)
    v, r = muon.update(grads, r, params)
  np.testing.assert_array_equal(u["w"], v["w"])
  assert not np.allclose(u["b"], v["b"])


def test_a_moment_given_by_hand_is_used_and_optimizers_without_one_are_refused():
  params = {"w": jnp.ones(2)}
  tx = dj.delay_compensated(optax.sgd(1.0), 0.5, moment=lambda state: {"w": jnp.full(2, 4.0)})
  u, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params, stale_params={"w": jnp.zeros(2)})
  np.testing.assert_allclose(u["w"], -(1.0 + 0.5 * 4.0 * 1.0))
  with pytest.raises(ValueError, match="found no second moment"):
    dj.delay_compensated(optax.sgd(0.1)).init(params)
  with pytest.raises(ValueError, match="found 2 second moments"):
    dj.delay_compensated(optax.chain(optax.scale_by_adam(), optax.scale_by_rms())).init(params)
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    dj.delay_compensated("adam")
  with pytest.raises(ValueError, match="stale_params"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params)
