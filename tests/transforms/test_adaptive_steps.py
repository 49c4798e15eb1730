"""Delay-adaptive step sizes (Wu, Magnusson, Feyzmahdavian, Johansson)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, assert_same_updates_as,
                           params_tree, random_like)


@pytest.mark.parametrize("policy", ["adaptive1", "adaptive2"])
def test_zero_staleness_is_sgd_bit_for_bit(policy):
  assert_same_updates_as(dj.delay_adaptive_sgd(0.3, 0.9, policy=policy), optax.sgd(0.3), {"staleness": 0})


def _numpy_steps(policy, gamma, alpha, window, taus):
  steps = []
  for k, tau in enumerate(taus):
    if tau > window:
      steps.append(0.0)
      continue
    s = sum(steps[max(0, k - tau):k])
    if policy == "adaptive1":
      steps.append(gamma if s <= alpha - gamma else 0.0)
    else:
      steps.append(max(0.0, min(gamma, alpha - s)))
  return np.array(steps)


@pytest.mark.parametrize("policy", ["adaptive1", "adaptive2"])
def test_numpy_reference_per_leaf(policy):
  gamma, alpha, window = 0.25, 0.7, 6
  rng = np.random.default_rng(3)
  taus_w = rng.integers(0, 8, size=30)  # some exceed the window
  taus_b = rng.integers(0, 3, size=30)
  params = params_tree()
  tx = dj.delay_adaptive_sgd(gamma, alpha, policy=policy, max_delay=window)
  state = tx.init(params)
  got_w, got_b = [], []
  for i in range(30):
    g = random_like(params, 200 + i)
    u, state = tx.update(g, state, params, staleness={"w": jnp.int32(taus_w[i]), "b": jnp.int32(taus_b[i])})
    got_w.append(float(-np.asarray(u["w"])[0, 0] / np.asarray(g["w"])[0, 0]))
    got_b.append(float(-np.asarray(u["b"])[0] / np.asarray(g["b"])[0]))
  np.testing.assert_allclose(got_w, _numpy_steps(policy, gamma, alpha, window, taus_w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_b, _numpy_steps(policy, gamma, alpha, window, taus_b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["adaptive1", "adaptive2"])
def test_no_nonzero_step_takes_its_delay_window_over_the_budget(policy):
  gamma, alpha, window = 0.3, 1.0, 16
  taus = np.random.default_rng(9).geometric(0.3, size=200) - 1
  tx = dj.delay_adaptive_sgd(gamma, alpha, policy=policy, max_delay=window)
  x = jnp.zeros(1)
  state = tx.init(x)
  update = jax.jit(tx.update)
  steps = []
  for tau in taus:
    u, state = update(jnp.ones(1), state, x, staleness=jnp.int32(tau))
    steps.append(-float(u[0]))
  steps = np.array(steps)
  for k, tau in enumerate(taus):
    # The principle gamma_k <= max(0, alpha - S_k): zero, or the window including it fits the budget.
    assert steps[k] == 0.0 or steps[max(0, k - tau):k + 1].sum() <= alpha + 1e-6
    if tau == 0:
      assert steps[k] == pytest.approx(gamma)
  assert steps.sum() > 0.25 * gamma * len(taus)  # the rule does not just stop


def test_state_jit_and_chain():
  params = params_tree()
  tx = dj.delay_adaptive_sgd(0.1, 0.5, max_delay=8)
  state = tx.init(params)
  assert state.steps["w"].shape == (8,) and state.steps["w"].dtype == jnp.float32
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i)})
  assert_chain_and_unknown_extra_args(tx, params, {"staleness": 2, "worker": 0})
  with pytest.raises(ValueError, match="staleness="):
    tx.update(params, state, params)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"max_step": 0.0}, ValueError, "max_step must be > 0.0"),
    ({"max_step": 0.6}, ValueError, "step_budget must be >= max_step"),
    ({"policy": "adaptive3"}, ValueError, "policy must be one of 'adaptive1', 'adaptive2'"),
    ({"max_delay": 0}, ValueError, "max_delay must be an integer >= 1, got 0"),
    ({"step_budget": -1.0}, ValueError, "step_budget must be > 0.0"),
])
def test_bad_arguments(kwargs, err, match):
  args = {"max_step": 0.1, "step_budget": 0.5, **kwargs}
  with pytest.raises(err, match=match):
    dj.delay_adaptive_sgd(**args)
