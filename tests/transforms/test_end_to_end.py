"""Each remedy under dj.simulate on a tiny least-squares problem: it trains, and at zero staleness it is
its synchronous counterpart."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((256, 4)).astype(np.float32)
DATA = {"x": jnp.asarray(_X), "y": jnp.asarray(_X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1)}
PARAMS = {"w": jnp.zeros(4), "b": jnp.zeros([])}
STEPS = 40


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def full_loss(params):
  return float(loss_fn(params, DATA))


def run(tx, delays, steps=STEPS):
  return dj.simulate(loss_fn, tx, PARAMS, DATA, delays, num_updates=steps, sampling=dj.Sampling(batch_size=16), seed=1)


@functools.lru_cache(maxsize=None)
def reference(name):
  """Synchronous Optax runs (zero staleness) that the remedies must reproduce."""
  txs = {"sgd": optax.sgd(0.05), "nesterov": optax.sgd(0.05, momentum=0.5, nesterov=True)}
  return run(txs[name], dj.delays.constant(0))


def assert_trains(result, factor=0.1):
  assert np.all(np.isfinite(result.history.loss))
  assert full_loss(result.params) < factor * full_loss(PARAMS)


def assert_same_params(a, b):
  chex.assert_trees_all_equal(a.params, b.params)


def test_accumulate_sum():
  assert_same_params(run(dj.accumulate_sum(optax.sgd(0.05), 1), dj.delays.constant(0)), reference("sgd"))
  assert_trains(run(dj.accumulate_sum(optax.sgd(0.02), 4), dj.delays.constant(3)))


def test_fed_async():
  # Each push is the delta of one local SGD step of rate 0.05, mixed in with staleness-damped weight.
  tx = optax.chain(optax.scale(-0.05), dj.fed_async(1.0, "polynomial", a=0.5))
  assert_trains(run(tx, dj.delays.uniform(3)))
  sync = run(optax.chain(optax.scale(-0.05), dj.fed_async(1.0)), dj.delays.constant(0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sync.params,
               reference("sgd").params)


def test_fed_buff():
  tx = optax.chain(optax.scale(-0.05), dj.fed_buff(optax.sgd(1.0, momentum=0.5), buffer_size=2))
  assert_trains(run(tx, dj.delays.uniform(3)))


def test_dana_reads_are_nesterov_iterates_with_one_worker():
  """With one worker DANA's look-ahead reads are exactly the iterates of optax's Nesterov SGD."""
  dana = run(dj.dana(0.05, 0.5, num_workers=1), dj.delays.constant(0))
  ref = reference("nesterov")
  np.testing.assert_allclose(dana.history.loss, ref.history.loss, rtol=1e-4, atol=1e-6)
  read = dj.read_params(dana.opt_state, dana.params, worker=0)
  chex.assert_trees_all_close(read, ref.params, rtol=1e-4, atol=1e-5)
  assert_trains(run(dj.dana(0.02, 0.5, num_workers=4), dj.delays.constant(3)))


def test_dana_slim_is_nesterov_with_one_worker_and_dana_zero_with_four():
  """DANA-Slim's workers read the parameters themselves; those are DANA-Zero's look-ahead reads."""
  assert_same_params(run(dj.dana_slim(0.05, 0.5, num_workers=1), dj.delays.constant(0)), reference("nesterov"))
  slim = run(dj.dana_slim(0.02, 0.5, num_workers=4), dj.delays.constant(3))
  assert_trains(slim)
  zero = run(dj.dana(0.02, 0.5, num_workers=4), dj.delays.constant(3))
  np.testing.assert_allclose(slim.history.loss, zero.history.loss, rtol=1e-4, atol=1e-6)
  lookahead = dj.read_params(zero.opt_state, zero.params, worker=0)
  chex.assert_trees_all_close(slim.params, lookahead, rtol=1e-4, atol=1e-5)


def test_delayed_nesterov():
  assert_same_params(run(dj.delayed_nesterov(0.05, 0.5, buffer_size=1), dj.delays.constant(0)),
                     reference("nesterov"))
  assert_trains(run(dj.delayed_nesterov(0.05, 0.5, buffer_size=4), dj.delays.constant(3)))


@pytest.mark.standard_promotion  # the optax.adam reference
def test_async_adam_and_apam():
  assert_same_params(run(dj.async_adam(0.05), dj.delays.constant(0)), run(optax.adam(0.05), dj.delays.constant(0)))
  assert_trains(run(dj.apam(0.3, staleness_rule="polynomial"), dj.delays.uniform(4)))


def test_zeno_plus_plus_with_a_validation_gradient():
  """Zeno++'s state requests zeno_grad, which dj.simulate computes at the current params for every update."""
  result = run(dj.zeno_plus_plus(0.05, rho=0.001), dj.delays.uniform(3))
  assert_trains(result)
  assert 0 < int(result.opt_state.accepted) <= STEPS
  # Accepting everything, unscaled, it is its inner SGD.
  assert_same_params(run(dj.zeno_plus_plus(0.05, eps=1e9, normalize=False), dj.delays.constant(0)),
                     reference("sgd"))


def test_delayed_nesterov_as_outer_optimizer_of_local_sgd_workers():
  """Asynchronous Local-SGD: four workers take DyLU's local steps and push pseudo-gradients."""
  steps = dj.dylu_local_steps([1.0, 0.5, 0.8, 0.3], max_steps=4)
  result = dj.simulate(loss_fn, dj.delayed_nesterov(0.7, 0.5, buffer_size=4), PARAMS, DATA,
                       dj.delays.constant(3), num_updates=STEPS, sampling=dj.Sampling(batch_size=16), seed=1,
                       worker=dj.workers.LocalSteps(steps, optax.sgd(0.02)))
  assert_trains(result)


def test_mindthestep():
  assert_same_params(run(dj.mindthestep(0.05, 1, target_momentum=0.0), dj.delays.constant(0)), reference("sgd"))
  # Four round-robin workers (constant(3)) damped from the modelled implicit momentum 0.75 to 0.5.
  assert_trains(run(dj.mindthestep(0.05, 4, target_momentum=0.5), dj.delays.constant(3)))


def test_delay_adaptive_sgd():
  assert_same_params(run(dj.delay_adaptive_sgd(0.05, 0.1), dj.delays.constant(0)), reference("sgd"))
  assert_trains(run(dj.delay_adaptive_sgd(0.05, 0.1), dj.delays.uniform(4)))
