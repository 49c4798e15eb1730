"""The Optax contract every delayjax transformation keeps (after Optax's own optimizer tests).

Each entry builds a complete optimizer from a learning rate. The tests run it
under jit and lax.scan and check that it descends, that a second call does not
recompile, that unknown extra arguments are accepted, that inject_hyperparams
and MultiSteps can wrap it, and that dtypes are preserved.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 4), "b": jnp.ones(2)}


def loss(params):
  return jnp.sum(params["w"] ** 2) + jnp.sum((params["b"] - 2.0) ** 2)


def runtime_extras(params):
  # Everything any transformation may ask for; zeno_grad is the exact gradient, a perfect validation batch.
  return {"staleness": jnp.int32(1), "stale_params": jax.tree.map(lambda p: 0.9 * p, params),
          "worker": jnp.int32(1), "zeno_grad": jax.grad(loss)(params)}


def loop_extras(params):
  # dj.delayed computes staleness and stale_params (and, replaying a Schedule, worker) itself and
  # refuses them from outside; other extra arguments pass through to the inner optimizer.
  return {"zeno_grad": jax.grad(loss)(params)}


def as_delta(tx):
  # fed_async / fed_buff take client deltas: one local SGD step of rate 0.5 turns a gradient into one.
  return optax.chain(optax.scale(-0.5), tx)


# Complete optimizers, as functions of the learning rate (so inject_hyperparams can drive them).
OPTIMIZERS = {
    "scale_by_staleness": lambda learning_rate: optax.chain(dj.scale_by_staleness("hinge", a=2.0, b=0),
                                                            optax.sgd(learning_rate)),
    "delay_compensation": lambda learning_rate: optax.chain(dj.delay_compensation(0.5), optax.sgd(learning_rate)),
    "delay_compensation_a": lambda learning_rate: optax.chain(
        dj.delay_compensation(2.0, adaptive=True, num_workers=3), optax.sgd(learning_rate)),
    "delayed_uniform": lambda learning_rate: dj.delayed(optax.sgd(learning_rate, momentum=0.5),
                                                        dj.delays.uniform(2)),
    "delayed_schedule": lambda learning_rate: dj.delayed(
        optax.chain(dj.delay_compensation(0.5), optax.sgd(learning_rate)),
        dj.cluster.simulate(dj.cluster.softsync(2), dj.cluster.workers(4, seed=0), 40, seed=0)),
    "accumulate_sum": lambda learning_rate: dj.accumulate_sum(optax.sgd(learning_rate), 2),
    "fed_async": lambda learning_rate: optax.chain(optax.scale(learning_rate), as_delta(dj.fed_async(0.9))),
    "fed_buff": lambda learning_rate: as_delta(dj.fed_buff(optax.sgd(learning_rate, 0.5), 2)),
    "dana": lambda learning_rate: dj.dana(learning_rate, 0.5, num_workers=3),
    "dana_dc": lambda learning_rate: dj.dana(learning_rate, 0.5, num_workers=3, dc_lambda=0.1),
    "delayed_nesterov": lambda learning_rate: dj.delayed_nesterov(learning_rate, 0.5, buffer_size=2),
    "async_adam": lambda learning_rate: dj.async_adam(learning_rate, staleness_rule="inverse"),
    "apam": lambda learning_rate: dj.apam(learning_rate, bias_correction=False),
    "zeno_plus_plus": lambda learning_rate: dj.zeno_plus_plus(learning_rate, rho=0.01),
    "delay_adaptive_sgd": lambda learning_rate: dj.delay_adaptive_sgd(learning_rate, 3 * learning_rate),
    "dana_slim": lambda learning_rate: dj.dana_slim(learning_rate, 0.5, num_workers=3),
    "mindthestep": lambda learning_rate: dj.mindthestep(learning_rate, 4, target_momentum=0.5),
}


LOOP_LEVEL = {"delayed_uniform", "delayed_schedule"}


@pytest.fixture
def extras(request):
  return loop_extras if request.node.callspec.params["name"] in LOOP_LEVEL else runtime_extras


def run_scan(tx, params, steps=8, extras=runtime_extras):
  def body(carry, _):
    p, s = carry
    u, s = tx.update(jax.grad(loss)(p), s, p, **extras(p))
    return (optax.apply_updates(p, u), s), None
  return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_jit_scan_descends_without_recompilation(name, extras):
  tx = OPTIMIZERS[name](0.1)
  p_jit, _ = jax.jit(run_scan, static_argnums=(0, 2, 3))(tx, PARAMS, 8, extras)
  p_eager, _ = run_scan(tx, PARAMS, 8, extras)
  chex.assert_trees_all_close(p_jit, p_eager, rtol=1e-5, atol=1e-6)
  assert float(loss(p_jit)) < 0.9 * float(loss(PARAMS))
  update = jax.jit(tx.update)
  state = tx.init(PARAMS)
  for _ in range(2):
    _, state = update(PARAMS, state, PARAMS, **extras(PARAMS))
  assert update._cache_size() == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_unknown_extra_arguments_are_ignored(name, extras):
  tx = OPTIMIZERS[name](0.1)
  state = tx.init(PARAMS)
  a, _ = tx.update(PARAMS, state, PARAMS, **extras(PARAMS))
  b, _ = tx.update(PARAMS, state, PARAMS, **extras(PARAMS), some_other_argument=jnp.ones(3))
  chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(name, dtype, extras):
  tx = OPTIMIZERS[name](0.1)
  params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
  state = tx.init(params)
  for _ in range(2):
    u, state = tx.update(jax.tree.map(lambda p: p + 1, params), state, params, **extras(params))
    assert all(x.dtype == dtype for x in jax.tree.leaves(u))


def test_dana_read_params_keeps_the_dtype():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  tx = dj.dana(0.1, 0.9, num_workers=2)
  _, state = tx.update(params, tx.init(params), params, worker=0)
  read = dj.read_params(state, params, worker=1)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(read))


@pytest.mark.standard_promotion  # MultiSteps and inject_hyperparams mix int32 and floats
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_inject_hyperparams_and_multisteps_wrap_it(name, extras):
  injected = optax.inject_hyperparams(OPTIMIZERS[name])(learning_rate=0.1)
  plain = OPTIMIZERS[name](0.1)
  scan = jax.jit(run_scan, static_argnums=(0, 2, 3))
  a, _ = scan(injected, PARAMS, 8, extras)
  b, _ = scan(plain, PARAMS, 8, extras)
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)

  multi = optax.MultiSteps(plain, every_k_schedule=2)
  state = multi.init(PARAMS)
  g = jax.grad(loss)(PARAMS)
  u1, state = multi.update(g, state, PARAMS, **extras(PARAMS))
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, np.zeros_like(u)), u1)
  u2, _ = multi.update(g, state, PARAMS, **extras(PARAMS))
  direct, _ = plain.update(g, plain.init(PARAMS), PARAMS, **extras(PARAMS))
  chex.assert_trees_all_close(u2, direct, rtol=1e-6)
