"""The Optax contract every delayjax transformation keeps (after Optax's own optimizer tests).

Each entry builds a transformation and the extra arguments it needs. The test
runs it under jit and lax.scan, checks that a second call does not recompile,
that unknown extra arguments are accepted, that inject_hyperparams and
MultiSteps can wrap it, and that dtypes are preserved.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 4), "b": jnp.ones(2)}


def runtime_extras(params):
  return {"staleness": jnp.int32(2), "stale_params": jax.tree.map(lambda p: 0.9 * p, params),
          "worker": jnp.int32(1)}


# dj.delayed computes staleness and stale_params itself and refuses them from outside.
NO_RUNTIME_EXTRAS = {"delayed_uniform"}


def with_lr(factory):
  """Builds ``learning_rate -> transformation`` so inject_hyperparams can drive it."""
  return lambda learning_rate: optax.chain(factory(), optax.sgd(learning_rate))


TRANSFORMS = {
    "scale_by_staleness": lambda: dj.scale_by_staleness("hinge", a=2.0, b=1),
    "delay_compensation": lambda: dj.delay_compensation(0.5),
    "delay_compensation_a": lambda: dj.delay_compensation(2.0, adaptive=True, num_workers=3),
    # A gradient-to-gradient inner (momentum accumulation), so the sgd after it still descends.
    "delayed_uniform": lambda: dj.delayed(optax.trace(decay=0.5), dj.delays.uniform(2)),
}


def loss(params):
  return jnp.sum(params["w"] ** 2) + jnp.sum((params["b"] - 2.0) ** 2)


def run_scan(tx, params, steps=6, extras=runtime_extras):
  def body(carry, _):
    p, s = carry
    u, s = tx.update(jax.grad(loss)(p), s, p, **extras(p))
    return (optax.apply_updates(p, u), s), None
  return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[0]


@pytest.fixture
def extras(request):
  name = request.node.callspec.params["name"]
  if name in NO_RUNTIME_EXTRAS:
    return lambda p: {"worker": jnp.int32(1)}
  return runtime_extras


@pytest.mark.parametrize("name", TRANSFORMS)
def test_jit_scan_and_no_recompilation(name, extras):
  tx = optax.chain(TRANSFORMS[name](), optax.sgd(0.1))
  p_jit, _ = jax.jit(run_scan, static_argnums=(0, 2, 3))(tx, PARAMS, 6, extras)
  p_eager, _ = run_scan(tx, PARAMS, 6, extras)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p_jit, p_eager)
  assert float(loss(p_jit)) < float(loss(PARAMS))
  update = jax.jit(tx.update)
  state = tx.init(PARAMS)
  for _ in range(2):
    _, state = update(PARAMS, state, PARAMS, **extras(PARAMS))
  assert update._cache_size() == 1


@pytest.mark.parametrize("name", TRANSFORMS)
def test_unknown_extra_arguments_are_ignored(name, extras):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  a, _ = tx.update(PARAMS, state, PARAMS, **extras(PARAMS))
  b, _ = tx.update(PARAMS, state, PARAMS, **extras(PARAMS), some_other_argument=jnp.ones(3))
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", TRANSFORMS)
def test_inject_hyperparams_and_multisteps_wrap_it(name, extras):
  injected = optax.inject_hyperparams(with_lr(TRANSFORMS[name]))(learning_rate=0.1)
  plain = with_lr(TRANSFORMS[name])(0.1)
  a, _ = run_scan(injected, PARAMS, extras=extras)
  b, _ = run_scan(plain, PARAMS, extras=extras)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), a, b)

  multi = optax.MultiSteps(plain, every_k_schedule=2)
  state = multi.init(PARAMS)
  g = jax.grad(loss)(PARAMS)
  u1, state = multi.update(g, state, PARAMS, **extras(PARAMS))
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, np.zeros_like(u)), u1)
  u2, state = multi.update(g, state, PARAMS, **extras(PARAMS))
  direct, _ = plain.update(g, plain.init(PARAMS), PARAMS, **extras(PARAMS))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), u2, direct)


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(name, dtype, extras):
  tx = TRANSFORMS[name]()
  params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
  u, state = tx.update(params, tx.init(params), params, **extras(params))
  assert all(x.dtype == dtype for x in jax.tree.leaves(u))
  u, _ = tx.update(params, state, params, **extras(params))
  assert all(x.dtype == dtype for x in jax.tree.leaves(u))
