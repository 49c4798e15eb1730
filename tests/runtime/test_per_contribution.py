"""dj.per_contribution: per-gradient rules applied to each contribution of an update, through the runtimes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import numpy_per_contribution, regression_problem


def _two_gradient_schedule() -> dj.cluster.Schedule:
  """Updates 0..3: one fresh gradient each (worker 0); update 4: a fresh one and one read at version 0."""
  contributes = np.zeros((5, 2), bool)
  read_version = np.full((5, 2), -1, np.int64)
  contributes[:, 0] = True
  read_version[:, 0] = np.arange(5)
  contributes[4, 1], read_version[4, 1] = True, 0
  return dj.cluster.Schedule(time=np.arange(5.0), contributes=contributes, read_version=read_version,
                             wait=np.zeros(2), paradigm="two contributions")


def test_inverse_rate_per_gradient_moves_by_the_paper_amount():
  # Zhang et al.: alpha0 / tau per gradient, then averaged: update 4 moves by (1/1 + 1/4) / 2 = 0.625
  # (a fresh gradient counts as tau = 1); the per-update form moves by 1/4 of the mean, 0.25.
  def loss_fn(w, batch):
    return jnp.sum(w) + 0.0 * jnp.sum(batch["x"])  # g = 1 for every gradient

  data = {"x": np.zeros((4, 1), np.float32)}
  schedule = _two_gradient_schedule()
  per = dj.simulate(loss_fn, optax.chain(dj.per_contribution(dj.scale_by_staleness("inverse")), optax.sgd(1.0)),
                    jnp.zeros(1), data, schedule, sampling=dj.Sampling(batch_size=1))
  whole = dj.simulate(loss_fn, optax.chain(dj.scale_by_staleness("inverse"), optax.sgd(1.0)),
                      jnp.zeros(1), data, schedule, sampling=dj.Sampling(batch_size=1))
  np.testing.assert_allclose(np.asarray(per.params), [-(4 + 0.625)])
  np.testing.assert_allclose(np.asarray(whole.params), [-(4 + 0.25)])


def _dc_a(num_workers):
  return dj.delay_compensation(0.5, adaptive=True, num_workers=num_workers)


def test_one_contribution_per_update_is_the_plain_rule_bit_for_bit():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4, compute="exponential"), num_updates=40,
                                 seed=1)
  assert schedule.contributes.sum(axis=1).max() == 1
  per = dj.simulate(loss_fn, optax.chain(dj.per_contribution(optax.chain(_dc_a(4), dj.scale_by_staleness("inverse"))),
                                         optax.sgd(0.05)), params, data, schedule, sampling=dj.Sampling(batch_size=8),
                    seed=2)
  plain = dj.simulate(loss_fn, optax.chain(_dc_a(4), dj.scale_by_staleness("inverse"), optax.sgd(0.05)),
                      params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=2)
  for a, b in zip(jax.tree.leaves(per.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(per.opt_state[0].inner[0].mean_square["w"]),
                                np.asarray(plain.opt_state[0].mean_square["w"]))


def _numpy_dc_a_per_contribution(data, schedule, *, lr, lam, mu, eps, batch_size, seed):
  """DC-ASGD-a (Zheng et al. 2017) applied to each gradient with its worker's mean square, then averaged
  with the num_batches weights."""
  ms = np.zeros((schedule.num_workers, data["x"].shape[1] + 1))

  def push(m, g, w, w_bak):
    ms[m] = mu * ms[m] + (1 - mu) * g * g
    return g + lam / np.sqrt(ms[m] + eps) * g * g * (w - w_bak)

  return numpy_per_contribution(data, schedule, push, lr=lr, batch_size=batch_size, seed=seed)


@pytest.mark.fast_compile
def test_dc_asgd_a_per_worker_on_k_async_against_numpy():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.k_async(2), dj.cluster.workers(4, compute="exponential"),
                                 num_updates=30, seed=3)
  assert schedule.contributes.sum(axis=1).max() == 2
  tx = optax.chain(dj.per_contribution(_dc_a(4)), optax.sgd(0.05))
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=4)
  expected = _numpy_dc_a_per_contribution(data, schedule, lr=0.05, lam=0.5, mu=0.95, eps=1e-7, batch_size=8,
                                          seed=4)
  got = np.concatenate([np.asarray(result.params["w"]), np.asarray(result.params["b"])[None]])
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)


def test_with_delayed_one_gradient_per_call_equals_the_plain_rule():
  rule = optax.chain(dj.delay_compensation(0.5, adaptive=True), dj.scale_by_staleness("inverse"), optax.sgd(0.1))
  per = optax.chain(dj.per_contribution(optax.chain(dj.delay_compensation(0.5, adaptive=True),
                                                    dj.scale_by_staleness("inverse"))), optax.sgd(0.1))
  grads = jax.random.normal(jax.random.key(0), (6, 3))
  outs = []
  for tx in (dj.delayed(rule, dj.delays.constant(2)), dj.delayed(per, dj.delays.constant(2))):
    params, state = jnp.zeros(3), tx.init(jnp.zeros(3))
    update = jax.jit(tx.update)
    for g in grads:
      step, state = update(g, state, params)
      params = optax.apply_updates(params, step)
    outs.append(np.asarray(params))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_delayed_replaying_a_schedule_gives_each_contribution_its_own_staleness():
  # The same two-gradient update as through dj.simulate, replayed in a hand-written loop: 6 reads, g = 1 each.
  outs = []
  for stage in (dj.per_contribution(dj.scale_by_staleness("inverse")), dj.scale_by_staleness("inverse")):
    tx = dj.delayed(optax.chain(stage, optax.sgd(1.0)), _two_gradient_schedule())
    params, state = jnp.zeros(1), tx.init(jnp.zeros(1))
    for _ in range(6):
      step, state = tx.update(jnp.ones(1), state, params)
      params = optax.apply_updates(params, step)
    outs.append(float(params[0]))
  np.testing.assert_allclose(outs, [-(4 + 0.625), -(4 + 0.25)])


def test_an_extra_argument_that_is_not_an_array_reaches_each_contribution_under_jit():
  # An inner rule may take a setting that only makes sense as a Python value (a string here); under a trace the
  # contributions still go through it, each scaled by that setting's factor, as outside one.
  def scaled(factors):
    def update_fn(updates, state, params=None, *, mode="plain", **extra_args):
      del params, extra_args
      return jax.tree.map(lambda g: factors[mode] * g, updates), state
    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)

  tx = dj.per_contribution(scaled({"plain": 1.0, "half": 0.5}))
  grads = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}  # two contributions of a 2-vector
  given = dict(contribution_grads=grads, contribution_staleness=jnp.array([0, 2]),
               contribution_stale_params={"w": jnp.zeros((2, 2))}, contribution_workers=jnp.array([0, 1]),
               contribution_weights=jnp.array([0.5, 0.5]))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  eager, _ = tx.update({"w": jnp.zeros(2)}, state, params, mode="half", **given)
  traced, _ = jax.jit(lambda s, p, kw: tx.update({"w": jnp.zeros(2)}, s, p, mode="half", **kw))(state, params, given)
  # 0.5 * (0.5 * [1, 2]) + 0.5 * (0.5 * [3, 4])
  np.testing.assert_allclose(np.asarray(eager["w"]), [1.0, 1.5])
  np.testing.assert_allclose(np.asarray(traced["w"]), [1.0, 1.5])
