"""Checks on the extra arguments a transformation receives, shared so every one fails the same way."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def require_extra(transform: str, name: str, value: Any, what: str = "", *, runtime_passes: bool = True) -> Any:
  """Returns ``value``, or raises a ValueError saying ``transform`` needs the extra argument ``name``.

  ``what`` describes the argument; ``runtime_passes`` says whether the
  delayjax runtimes provide it (otherwise only a hand-written loop can).
  """
  if value is None:
    described = f" ({what})" if what else ""
    who = "the delayjax runtimes pass it, a hand-written loop" if runtime_passes else "a hand-written loop"
    raise ValueError(f"{transform} needs the extra argument {name}={described}; {who} must pass it to update().")
  return value


def check_worker(transform: str, worker: Any, num_workers: int) -> jax.Array:
  """The ``worker`` extra argument as an int32 scalar, checked against ``num_workers`` when concrete."""
  worker = require_extra(transform, "worker", worker, "int32 scalar, the pushing worker")
  if not isinstance(worker, jax.core.Tracer) and not 0 <= int(worker) < num_workers:
    raise ValueError(f"worker must be in [0, {num_workers}), got {int(worker)}.")
  return jnp.asarray(worker, jnp.int32)


def check_like_updates(name: str, tree: Any, updates: Any) -> None:
  """Raises a ValueError unless ``tree`` has the structure and leaf shapes of ``updates``."""
  if jax.tree.structure(tree) != jax.tree.structure(updates):
    raise ValueError(
        f"{name} must have the structure of the updates {jax.tree.structure(updates)}; got "
        f"{jax.tree.structure(tree)}.")
  for x, g in zip(jax.tree.leaves(tree), jax.tree.leaves(updates)):
    if jnp.shape(x) != jnp.shape(g):
      raise ValueError(f"{name} leaves must have the shapes of the updates; got {jnp.shape(x)} for {jnp.shape(g)}.")
