"""Checks shared by the tests of the remedies (DANA, FedBuff, Zeno++, ...): jit without retracing,
composition in optax.chain, unknown extra arguments, data-independent state shapes."""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax


def params_tree() -> dict[str, jax.Array]:
  return {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.float32), "b": jnp.array([0.1, -0.3], jnp.float32)}


def random_like(tree: Any, seed: int, scale: float = 1.0) -> Any:
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), tree)


def state_shapes(state: Any) -> Any:
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), state)


def counting_jit(tx: optax.GradientTransformation) -> tuple[Callable, list]:
  """``(grads, state, params, extra) -> tx.update(...)`` jitted, and a list that grows by one at each trace."""
  traces = []

  def step(grads, state, params, extra):
    traces.append(1)
    return tx.update(grads, state, params, **extra)

  return jax.jit(step), traces


def assert_jit_traces_once(tx: optax.GradientTransformation, params: Any, extra_for: Callable[[int], dict]) -> None:
  """Runs three jitted updates with different data; the update must be traced exactly once."""
  jitted, traces = counting_jit(tx)
  state = tx.init(params)
  shapes = state_shapes(state)
  for i in range(3):
    updates, state = jitted(random_like(params, i), state, params, extra_for(i))
    params = optax.apply_updates(params, updates)
    assert state_shapes(state) == shapes, "state shapes or dtypes changed with the data"
  assert len(traces) == 1, f"traced {len(traces)} times"
  assert jitted._cache_size() == 1


def assert_chain_and_unknown_extra_args(tx: optax.GradientTransformation, params: Any, extra: dict) -> None:
  """Same result alone and as the first link of a chain with an identity; unknown extra args are ignored."""
  grads = random_like(params, 7)
  alone, _ = tx.update(grads, tx.init(params), params, **extra)
  chained = optax.chain(tx, optax.identity())
  with_unknown, _ = chained.update(grads, chained.init(params), params, unknown_argument=3, **extra)
  chex.assert_trees_all_equal(alone, with_unknown)


def assert_same_updates_as(tx: optax.GradientTransformation, ref: optax.GradientTransformation, extra: dict,
                           steps: int = 4) -> None:
  """``tx`` (given ``extra``) and its synchronous reference ``ref`` give the same updates, bit for bit, step after
  step, on random gradients, with the parameters moving as ``tx`` moves them."""
  params = params_tree()
  s, r = tx.init(params), ref.init(params)
  for i in range(steps):
    g = random_like(params, i)
    u, s = tx.update(g, s, params, **extra)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)
    params = optax.apply_updates(params, u)
