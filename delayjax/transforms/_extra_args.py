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


def check_worker(transform: str, worker: Any, num_workers: int) -> tuple[jax.Array, jax.Array | None]:
  """The ``worker`` extra argument as an int32 row index, and whether a traced one is in range.

  A concrete ``worker`` outside ``[0, num_workers)`` raises a ValueError; the
  second value is then ``None``. A traced one cannot raise: the index of one
  out of range is ``num_workers`` (rows written there are dropped, rather than
  a negative index wrapping around to another worker's row), and the second
  value is a traced bool that the transformation passes to
  :func:`nan_unless` with a coefficient of its update (see ``delayjax.transforms._hooks``).
  """
  worker = require_extra(transform, "worker", worker, "int32 scalar, the pushing worker")
  if jnp.ndim(worker) != 0 or not jnp.issubdtype(jnp.result_type(worker), jnp.integer):
    raise TypeError(
        f"worker must be an integer scalar, got dtype {jnp.result_type(worker)} and shape {jnp.shape(worker)}.")
  if not isinstance(worker, jax.core.Tracer):
    if not 0 <= int(worker) < num_workers:
      raise ValueError(f"worker must be in [0, {num_workers}), got {int(worker)}.")
    return jnp.asarray(worker, jnp.int32), None
  index = jnp.asarray(worker, jnp.int32)
  in_range = (index >= 0) & (index < num_workers)
  return jnp.where(in_range, index, jnp.int32(num_workers)), in_range


def nan_unless(in_range: jax.Array | None, scalar: Any, dtype: Any) -> Any:
  """``scalar`` (a coefficient of the update) unchanged if ``in_range`` is ``None``, else NaN where it is false.

  The coefficient is cast to ``dtype``, the update's, as a Python float
  multiplying the update would be, so the update's arithmetic (and its bits)
  stay those of the unpoisoned one: only the scalar is selected, not every
  element of the update.
  """
  if in_range is None:
    return scalar
  return jnp.where(in_range, jnp.asarray(scalar, dtype), jnp.asarray(jnp.nan, dtype))


def check_like_updates(name: str, tree: Any, updates: Any) -> None:
  """Raises a ValueError unless ``tree`` has the structure and leaf shapes of ``updates``."""
  if jax.tree.structure(tree) != jax.tree.structure(updates):
    raise ValueError(
        f"{name} must have the structure of the updates {jax.tree.structure(updates)}; got "
        f"{jax.tree.structure(tree)}.")
  for x, g in zip(jax.tree.leaves(tree), jax.tree.leaves(updates)):
    if jnp.shape(x) != jnp.shape(g):
      raise ValueError(f"{name} leaves must have the shapes of the updates; got {jnp.shape(x)} for {jnp.shape(g)}.")
