"""SpecTrain, PipeMare and Diversely Stale Parameters' compensation against NumPy re-implementations of their
rules, alone and through ``dj.simulate_pipeline``; with zero staleness each is its synchronous optimizer."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "transforms"))
from pipeline_reference import assert_trees_close, mlp_problem, reference  # noqa: E402
from remedy_checks import (  # noqa: E402
    assert_chain_and_unknown_extra_args, assert_jit_traces_once, assert_same_updates_as, params_tree, random_like)


def test_spectrain_matches_numpy():
  lr, gamma = 0.2, 0.7
  tx = dj.spectrain(lr, smoothing=gamma)
  params = params_tree()
  state = tx.init(params)
  v = jax.tree.map(lambda p: np.zeros(p.shape), params)
  for i in range(4):
    g = random_like(params, i)
    updates, state = jax.jit(tx.update)(g, state, params)
    v = jax.tree.map(lambda vv, gg: gamma * vv + (1 - gamma) * np.asarray(gg, np.float64), v, g)
    jax.tree.map(lambda u, vv: np.testing.assert_allclose(u, -lr * vv, rtol=1e-6), updates, v)
    jax.tree.map(lambda d, vv: np.testing.assert_allclose(d, lr * vv, rtol=1e-6), state.read_direction(), v)
  assert state.read_steps(10, 7, 9) == (3, 1)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_pipemare_matches_numpy(momentum):
  lr, T, D = 0.1, 3, 0.2
  tx = dj.pipemare(lr, warmup_steps=T, momentum=momentum, discrepancy_decay=D)
  params = params_tree()
  state = tx.init(params)
  v = jax.tree.map(lambda p: np.zeros(p.shape), params)
  delta = jax.tree.map(lambda p: np.zeros(p.shape), params)
  for t, (tau_f, tau_b) in enumerate([(4, 1), (4, 0), (0, 0), (3, 1), (5, 2), (2, 2)]):
    g = random_like(params, t)
    updates, state = jax.jit(tx.update)(g, state, params, staleness=jnp.int32(tau_f),
                                        backward_staleness=jnp.int32(tau_b))
    p = 1 - min(t / T, 1)
    step = lr * max(tau_f, 1) ** (-p)
    gamma = D ** (1 / max(tau_f - tau_b, 1))
    v = jax.tree.map(lambda vv, gg: momentum * vv + np.asarray(gg, np.float64), v, g)
    want = jax.tree.map(lambda vv: -step * vv, v)
    delta = jax.tree.map(lambda d, w: gamma * d + (1 - gamma) * w, delta, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), updates, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), state.read_direction(), delta)
  np.testing.assert_array_equal(state.read_steps(jnp.int32(9), jnp.int32(5), jnp.int32(8)), (0, 3))


@pytest.mark.parametrize("decay", [None, 0.1])
def test_zero_staleness_is_the_synchronous_optimizer(decay):
  zero = dict(staleness=jnp.int32(0), backward_staleness=jnp.int32(0))
  assert_same_updates_as(dj.pipemare(0.1, warmup_steps=5, momentum=0.9, discrepancy_decay=decay),
                         optax.sgd(0.1, momentum=0.9), zero)
  assert_same_updates_as(dj.spectrain(0.1, smoothing=0.9),
                         optax.chain(optax.ema(0.9, debias=False), optax.scale(-0.1)), zero)


def test_optax_contract():
  params = params_tree()
  extra = lambda i: dict(staleness=jnp.int32(i), backward_staleness=jnp.int32(0))  # noqa: E731
  for tx in (dj.spectrain(0.1), dj.pipemare(optax.linear_schedule(0.1, 0.01, 10), warmup_steps=4,
                                            discrepancy_decay=0.1)):
    assert_jit_traces_once(tx, params, extra)
    assert_chain_and_unknown_extra_args(tx, params, extra(2))


def test_bad_arguments_and_two_readers():
  with pytest.raises(ValueError, match="smoothing"):
    dj.spectrain(0.1, smoothing=1.0)
  with pytest.raises(ValueError, match="warmup_steps"):
    dj.pipemare(0.1, warmup_steps=0)
  with pytest.raises(ValueError, match="discrepancy_decay"):
    dj.pipemare(0.1, warmup_steps=3, discrepancy_decay=1.5)
  tx = optax.chain(dj.spectrain(0.1), dj.pipemare(0.1, warmup_steps=2, discrepancy_decay=0.5))
  with pytest.raises(ValueError, match="at most one"):
    dj.transforms.stage_read(tx.init(params_tree()))
  assert dj.transforms.stage_read(dj.pipemare(0.1, warmup_steps=2).init(params_tree())) is None


def _predicted(rule):
  """A reference read: SpecTrain's w_v - (u - v) * eta * v_v, or PipeMare's backward w_b - (b - f) * delta_b."""

  def read(k, u, fv, bv, which, versions, states):
    version = fv if which == "forward" else bv
    w = versions[version]
    if rule == "spectrain":
      s, d = u - version, jax.tree.map(lambda v: 0.3 * v, states[version].smoothed)
    else:
      s, d = (0 if which == "forward" else bv - fv), states[version].delta
    return jax.tree.map(lambda x, dd: x - s * dd, w, d)

  return read


@pytest.mark.fast_compile
@pytest.mark.parametrize("rule", ["spectrain", "pipemare"])
def test_reads_through_the_runtime_match_the_rule(rule):
  stages, loss_fn, params, data = mlp_problem(2, seed=3)
  sched = dj.cluster.pipeline("1f1b", 2, 5, num_microbatches=1, weights="latest")
  tx = (dj.spectrain(0.3, smoothing=0.8) if rule == "spectrain"
        else dj.pipemare(0.3, warmup_steps=3, momentum=0.5, discrepancy_decay=0.1))
  result = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, sampling=dj.Sampling(batch_size=8),
                                seed=2)
  want, _, _ = reference(stages, loss_fn, tx, params, data, sched, batch_size=8, seed=2, read=_predicted(rule))
  assert_trees_close(result.params, want)


def test_diversely_stale_compensation_uses_the_forward_weights():
  """DSP's compensation is DC-ASGD's first-order term with the stage's forward weights as the stale weights."""
  stages, loss_fn, params, data = mlp_problem(2, seed=5)
  sched = dj.cluster.pipeline("1f1b", 2, 4, weights="latest")
  lam, lr = 0.5, 0.3
  tx = optax.chain(dj.delay_compensation(lam=lam), optax.sgd(lr))
  result = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, sampling=dj.Sampling(batch_size=8),
                                seed=0)

  def compensated(g, state, p, *, stale_params, **extra):
    """The rule written out: -lr (g + lam g * g * (w - w_forward))."""
    return jax.tree.map(lambda gg, w, ws: -lr * (gg + lam * gg * gg * (w - ws)), g, p, stale_params), state

  rule = optax.GradientTransformationExtraArgs(lambda p: (), compensated)
  want, _, _ = reference(stages, loss_fn, rule, params, data, sched, batch_size=8, seed=0)
  assert_trees_close(result.params, want, rtol=1e-5, atol=1e-6)
