"""Zeno++ (Xie, Koyejo, Gupta): descent test on a validation gradient."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_always_passing_test_without_rescaling_is_inner_bit_for_bit():
  params = params_tree()
  tx = dj.zeno_plus_plus(0.1, eps=1e6, normalize=False, inner=optax.sgd(0.1, momentum=0.9))
  ref = optax.sgd(0.1, momentum=0.9)
  s, r = tx.init(params), ref.init(params)
  for i in range(4):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, zeno_grad=random_like(params, 50 + i), staleness=3)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)
  assert int(s.accepted) == 4 and int(s.count) == 4


def test_numpy_reference_of_the_score_with_byzantine_candidates():
  gamma, rho, eps, beta = 0.1, 0.05, 0.2, 0.5
  params = params_tree()
  tx = dj.zeno_plus_plus(gamma, rho, eps, inner=optax.sgd(gamma, momentum=beta))
  state = tx.init(params)
  trace = np.zeros_like(_flat(params))
  rng = np.random.default_rng(0)
  accepted = 0
  decisions = []
  for i in range(12):
    v = random_like(params, 100 + i)
    honest = jax.tree.map(lambda x: x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), x.dtype), v)
    g = jax.tree.map(lambda x: -4.0 * x, honest) if i % 3 == 0 else honest  # sign-flip attack
    u, state = tx.update(g, state, params, zeno_grad=v)
    gn, vn = _flat(g), _flat(v)
    g_tilde = np.linalg.norm(vn) / np.linalg.norm(gn) * gn
    score = gamma * vn @ g_tilde - rho * gn @ gn + gamma * eps
    if score >= 0:
      accepted += 1
      trace = g_tilde + beta * trace
      expected = -gamma * trace
    else:
      expected = np.zeros_like(gn)
    decisions.append(score >= 0)
    np.testing.assert_allclose(_flat(u), expected, rtol=1e-5, atol=1e-6)
  assert int(state.accepted) == accepted and int(state.count) == 12
  # The test is not vacuous: attacks were rejected and honest gradients accepted.
  assert not any(decisions[::3]) and all(d for i, d in enumerate(decisions) if i % 3)


def test_rejection_leaves_inner_state_unchanged():
  params = params_tree()
  tx = dj.zeno_plus_plus(0.1, inner=optax.sgd(0.1, momentum=0.9))
  s0 = tx.init(params)
  v = random_like(params, 1)
  _, s1 = tx.update(v, s0, params, zeno_grad=v)
  u, s2 = tx.update(jax.tree.map(lambda x: -x, v), s1, params, zeno_grad=v)
  jax.tree.map(lambda a: np.testing.assert_array_equal(a, 0.0), u)
  chex.assert_trees_all_equal(s2.inner_state, s1.inner_state)
  assert (int(s2.count), int(s2.accepted)) == (2, 1)


def test_zero_candidate_does_not_produce_nan():
  params = params_tree()
  tx = dj.zeno_plus_plus(0.1)
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params, zeno_grad=random_like(params, 2))
  jax.tree.map(lambda a: np.testing.assert_array_equal(a, 0.0), u)


def test_state_jit_chain_and_missing_argument():
  params = params_tree()
  tx = dj.zeno_plus_plus(0.1, rho=0.01)
  state = tx.init(params)
  assert state.count.dtype == jnp.int32 and state.accepted.dtype == jnp.int32
  assert_jit_traces_once(tx, params, lambda i: {"zeno_grad": random_like(params, 60 + i)})
  assert_chain_and_unknown_extra_args(tx, params, {"zeno_grad": random_like(params, 3), "staleness": 1})
  with pytest.raises(ValueError, match="needs the extra argument zeno_grad="):
    tx.update(params, state, params)
  with pytest.raises(ValueError, match="zeno_grad must have the structure"):
    tx.update(params, state, params, zeno_grad={"w": params["w"]})


@pytest.mark.parametrize("kwargs, err, match", [
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be > 0.0"),
    ({"rho": -0.1}, ValueError, "rho must be >= 0.0"),
    ({"eps": -1.0}, ValueError, "eps must be >= 0.0"),
    ({"normalize": 1}, TypeError, "normalize must be a bool"),
])
def test_bad_arguments(kwargs, err, match):
  args = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(err, match=match):
    dj.zeno_plus_plus(**args)
