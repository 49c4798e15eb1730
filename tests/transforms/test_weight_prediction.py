"""dj.weight_prediction: workers read w + tau * (last update), for Adam and Muon, against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

pytestmark = pytest.mark.standard_promotion  # optax.adam's bias correction mixes float and int32

DIM = 4
A = np.diag(np.linspace(0.5, 2.0, DIM)).astype(np.float32)
B = np.linspace(-1.0, 1.0, DIM).astype(np.float32)


def test_adam_reads_the_weights_tau_of_its_own_steps_ahead():
  # Decays exact in binary: with 0.999 (0.99900001 in float32) Adam's 1 - b2**t is off by 5e-5 relative.
  lr, b1, b2, eps, tau = 0.1, 0.75, 0.875, 1e-8, 3.0
  tx = dj.weight_prediction(optax.adam(lr, b1, b2, eps), horizon=tau)
  params = {"w": jnp.ones(DIM)}
  state = tx.init(params)
  np.testing.assert_array_equal(dj.read_params(state, params)["w"], params["w"])  # no step taken yet
  w, m, v = np.ones(DIM), np.zeros(DIM), np.zeros(DIM)
  for t in range(1, 6):
    u, state = tx.update({"w": jnp.asarray(A) @ params["w"] - jnp.asarray(B)}, state, params)
    params = optax.apply_updates(params, u)
    g = A @ w - B
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    step = -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    w = w + step
  np.testing.assert_allclose(dj.read_params(state, params)["w"], w + tau * step, rtol=1e-5)


def test_muon_extrapolates_its_orthogonalized_step_not_the_gradient():
  rng = np.random.default_rng(0)
  # A gradient matrix with a wide spectrum: singular values 10, 1 and 0.1.
  q1, q2 = np.linalg.qr(rng.normal(size=(6, 3)))[0], np.linalg.qr(rng.normal(size=(3, 3)))[0]
  grad = (q1 * np.array([10.0, 1.0, 0.1])) @ q2.T
  params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}
  grads = {"w": jnp.asarray(grad, jnp.float32), "b": jnp.ones(3)}
  tx = dj.weight_prediction(optax.contrib.muon(0.02), horizon={"w": 2.0, "b": 5.0})
  u, state = tx.update(grads, tx.init(params), params)
  offset = jax.tree.map(jnp.subtract, dj.read_params(state, params), params)
  np.testing.assert_allclose(offset["w"], 2.0 * u["w"], rtol=1e-6)
  np.testing.assert_allclose(offset["b"], 5.0 * u["b"], rtol=1e-6)
  # Newton-Schulz flattens the spectrum: the step's singular values lie within a factor 2 of each other, the
  # gradient's span a factor 100.
  s = np.linalg.svd(np.asarray(offset["w"]), compute_uv=False)
  assert s.max() / s.min() < 2.0


def test_a_delayed_loop_computing_at_the_predicted_weights_matches_numpy():
  """SGD with delay tau and prediction horizon tau: the gradient of call t is taken at w_t + tau * u_last and
  applied at call t + tau (u_last is the last update applied; zero until the first release)."""
  lr, tau, steps = 0.3, 2, 20
  tx = dj.delayed(dj.weight_prediction(optax.sgd(lr), horizon=dj.delays.constant(tau)), dj.delays.constant(tau))
  params = {"w": jnp.zeros(DIM)}
  state = tx.init(params)
  for _ in range(steps):
    read = dj.read_params(state, params)
    u, state = tx.update({"w": jnp.asarray(A) @ read["w"] - jnp.asarray(B)}, state, params)
    params = optax.apply_updates(params, u)
  w, last, pending = np.zeros(DIM), np.zeros(DIM), []
  for t in range(steps):
    pending.append(A @ (w + tau * last) - B)
    if t >= tau:
      last = -lr * pending.pop(0)
      w = w + last
  np.testing.assert_allclose(params["w"], w, rtol=1e-5, atol=1e-6)
  plain = np.zeros(DIM)  # the same loop without prediction ends elsewhere
  pending = []
  for t in range(steps):
    pending.append(A @ plain - B)
    if t >= tau:
      plain = plain - lr * pending.pop(0)
  assert not np.allclose(plain, w, atol=1e-3)


def test_per_leaf_horizons_from_a_per_leaf_delay_model_and_bad_horizons():
  params = {"embed": jnp.zeros(2), "head": jnp.zeros(2)}
  model = dj.delays.per_leaf(dj.delays.by_path(params, {"^embed": dj.delays.uniform(4)}, default=1))
  state = dj.weight_prediction(optax.sgd(1.0), model).init(params)
  assert float(state.horizon["embed"]) == 2.0 and float(state.horizon["head"]) == 1.0
  for bad in (-1, "3", float("nan"), True):
    with pytest.raises(ValueError, match="horizon must be a number >= 0"):
      dj.weight_prediction(optax.sgd(1.0), bad)
  with pytest.raises(ValueError, match="not a prefix of the parameter tree"):
    dj.weight_prediction(optax.sgd(1.0), {"x": 1.0}).init(params)
