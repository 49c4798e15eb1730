"""APAM (asynchronous AMSGrad, Xu et al.) and staleness-aware asynchronous Adam."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)

# The references run optax.adam/amsgrad, whose bias correction mixes float and int32 (rejected by
# the strict promotion of tests/conftest.py); delayjax's own versions run under strict promotion.
standard = jax.numpy_dtype_promotion("standard")


def _compare(tx, ref, steps=5, rule_staleness=0):
  params = params_tree()
  s = tx.init(params)
  with standard:
    r = ref.init(params)
  for i in range(steps):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, staleness=rule_staleness, stale_params=params, worker=0)
    with standard:
      v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)


@pytest.mark.parametrize("rule", [None, "inverse", "polynomial"])
def test_async_adam_zero_staleness_is_optax_adam_bit_for_bit(rule):
  _compare(dj.async_adam(1e-2, 0.8, 0.99, 1e-6, staleness_rule=rule), optax.adam(1e-2, 0.8, 0.99, 1e-6))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_apam_zero_staleness_is_optax_amsgrad_bit_for_bit(bias_correction):
  ref = optax.amsgrad(1e-2, bias_correction_mu=bias_correction, bias_correction_nu=bias_correction)
  _compare(dj.apam(1e-2, bias_correction=bias_correction, staleness_rule="polynomial"), ref)


def test_apam_numpy_reference_on_stale_gradients():
  """A delayed-gradient run on a quadratic: the master's AMSGrad (Reddi form) on g(x_{k - tau_k})."""
  alpha, b1, b2, eps = 0.05, 0.9, 0.99, 1e-8
  a = np.array([1.0, 4.0, 0.25])
  x0 = np.array([1.0, -1.0, 2.0])
  taus = np.random.default_rng(1).integers(0, 4, size=15)
  # NumPy.
  hist = [x0.copy()]
  m, v, vhat = np.zeros(3), np.zeros(3), np.zeros(3)
  for k, tau in enumerate(taus):
    g = a * hist[max(0, k - tau)]
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    vhat = np.maximum(vhat, v)
    hist.append(hist[-1] - alpha * m / (np.sqrt(vhat) + eps))
  # delayjax, with the same stale reads.
  tx = dj.apam(alpha, b1, b2, eps, bias_correction=False)
  xs = [jnp.asarray(x0, jnp.float32)]
  state = tx.init(xs[0])
  for k, tau in enumerate(taus):
    read = xs[max(0, k - int(tau))]
    u, state = tx.update(jnp.asarray(a, jnp.float32) * read, state, xs[-1], staleness=int(tau))
    xs.append(optax.apply_updates(xs[-1], u))
  np.testing.assert_allclose(np.stack(xs), np.stack(hist), rtol=1e-4, atol=1e-5)


def test_async_adam_staleness_scaling_per_leaf():
  params = params_tree()
  g = random_like(params, 3)
  tx = dj.async_adam(0.1, staleness_rule="inverse")
  u, _ = tx.update(g, tx.init(params), params, staleness={"w": 4, "b": 0})
  ref = dj.async_adam(0.1)
  v, _ = ref.update(g, ref.init(params), params)
  np.testing.assert_allclose(u["w"], np.asarray(v["w"]) / 4, rtol=1e-6)
  np.testing.assert_array_equal(u["b"], v["b"])


def test_jit_and_chain():
  params = params_tree()
  for tx in (dj.async_adam(1e-2, staleness_rule="hinge"), dj.apam(1e-2, staleness_rule="inverse")):
    assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i)})
    assert_chain_and_unknown_extra_args(tx, params, {"staleness": 2})
  with pytest.raises(ValueError, match="staleness="):
    tx = dj.apam(1e-2, staleness_rule="inverse")
    tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"b1": 1.0}, ValueError, "b1 must be < 1.0"),
    ({"b2": 1.5}, ValueError, "b2 must be < 1.0"),
    ({"eps": -1e-8}, ValueError, "eps must be >= 0.0"),
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be > 0.0"),
    ({"staleness_rule": "bogus"}, ValueError, "rule must be one of"),
    ({"a": 0.5}, TypeError, "given without staleness_rule"),
])
@pytest.mark.parametrize("factory", [dj.async_adam, dj.apam])
def test_bad_arguments(factory, kwargs, err, match):
  args = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(err, match=match):
    factory(**args)


def test_apam_bias_correction_must_be_bool():
  with pytest.raises(TypeError, match="bias_correction must be a bool"):
    dj.apam(1e-3, bias_correction=1)
