"""Checks on the extra arguments a transformation receives, shared so every one fails the same way, and the
stateless per-leaf transformation several of them are."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax


def require_extra(transform: str, name: str, value: Any, what: str = "", *, runtime_passes: bool = True) -> Any:
  """Returns ``value``, or raises a ValueError saying ``transform`` needs the extra argument ``name``.

  ``what`` describes the argument; ``runtime_passes`` says whether the
  delayjax runtimes provide it (otherwise only a hand-written loop can).
  """
  if value is None:
    described = f" ({what})" if what else ""
    who = "the delayjax runtimes pass it, a hand-written loop" if runtime_passes else "a hand-written loop"
    # Flax's TrainState.apply_gradients passes no extra arguments to tx.update: name the one that does.
    raise ValueError(f"{transform} needs the extra argument {name}={described}; {who} must pass it to update() "
                     f"(in a Flax loop: dj.apply_gradients(state, grads=grads, {name}=...), since "
                     f"TrainState.apply_gradients passes none).")
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
  if isinstance(worker, (str, bytes)) or not isinstance(worker, (int, np.integer, np.ndarray, jax.Array)):
    raise TypeError(f"worker must be an integer scalar (the pushing worker's index), got {type(worker).__name__} "
                    f"{worker!r}.")
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


def check_updates_like(transform: str, updates: Any, like: Any, what: str) -> None:
  """Raises a ValueError naming ``updates`` when its tree or a leaf's shape differs from ``like``.

  ``like`` is what the state keeps per parameter (a sum, a momentum), built
  by ``init`` from the parameters. Without this check, a gradient of another
  tree fails inside ``jax.tree.map`` with a message that names neither, and
  one whose shape broadcasts (``[1]`` for ``[3]``) is silently spread over
  the parameter.
  """
  expected, given = jax.tree.structure(like, is_leaf=_is_masked), jax.tree.structure(updates, is_leaf=_is_masked)
  if expected != given:
    raise ValueError(f"{transform}: updates (the gradients) must have the tree structure of the parameters its "
                     f"{what} was initialized with, {expected}; got {given}.")
  for (path, u), x in zip(jax.tree_util.tree_leaves_with_path(updates, is_leaf=_is_masked),
                          jax.tree.leaves(like, is_leaf=_is_masked)):
    if not _is_masked(u) and jnp.shape(u) != jnp.shape(x):
      raise ValueError(f"{transform}: updates (the gradients) must have the shapes of the parameters its {what} "
                       f"was initialized with: at {jax.tree_util.keystr(path) or 'the root'} got shape "
                       f"{jnp.shape(u)}, expected {jnp.shape(x)}.")


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


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_like(tree: Any, updates: Any) -> Any:
  """The part of ``tree`` that matches ``updates`` when an Optax mask has hidden some of the updates.

  ``optax.masked`` and ``optax.multi_transform`` replace the updates and
  parameters outside a group by ``optax.MaskedNode`` but pass extra arguments
  through whole. Where ``updates`` has a ``MaskedNode``, the corresponding
  subtree of ``tree`` is replaced by one too; a ``tree`` that already matches
  (no mask, or ``mask_compatible_extra_args=True``) is returned as it is, and
  one that matches neither way is returned as it is for the caller's error.
  """
  if jax.tree.structure(tree) == jax.tree.structure(updates):
    return tree
  masked = jax.tree.leaves(updates, is_leaf=_is_masked)
  if not any(_is_masked(u) for u in masked):
    return tree
  outer = jax.tree.structure(updates, is_leaf=_is_masked)
  try:
    parts = outer.flatten_up_to(tree)
  except (ValueError, TypeError):
    return tree
  return outer.unflatten([optax.MaskedNode() if _is_masked(u) else p for u, p in zip(masked, parts)])


def map_unmasked(fn: Any, params: Any, table: Any) -> Any:
  """``jax.tree.map(fn, params, table)``, with ``params`` passed through where an Optax mask hid ``table``.

  A state inside ``optax.masked`` or ``optax.multi_transform`` holds its
  group's part of the parameters' tree (``optax.MaskedNode`` elsewhere), while
  a runtime asks it about all the parameters (``read_params``).
  """
  outer = jax.tree.structure(table, is_leaf=_is_masked)
  kept = jax.tree.leaves(table, is_leaf=_is_masked)
  if not any(_is_masked(t) for t in kept):
    return jax.tree.map(fn, params, table)
  parts = outer.flatten_up_to(params)
  return outer.unflatten([p if _is_masked(t) else jax.tree.map(fn, p, t) for p, t in zip(parts, kept)])


def like_updates(name: str, tree: Any, updates: Any, *, batch: int | None = None) -> Any:
  """``tree`` (an extra argument) matched to ``updates``; raises a ValueError naming ``name`` if it does not match.

  Inside ``optax.masked`` or ``optax.multi_transform`` the part of ``tree``
  under the group's updates is taken (:func:`masked_like`), so every
  transformation that takes a tree-valued extra argument works per group.

  Args:
    name: the extra argument's name, for errors.
    tree: its value, a pytree with the structure of the updates.
    updates: the updates the transformation received.
    batch: if given, every leaf of ``tree`` has a leading axis of this size
      before the shape of the update's leaf.

  Returns:
    ``tree``, or its part under the (masked) updates.
  """
  tree = masked_like(tree, updates)
  try:
    chex.assert_trees_all_equal_structs(tree, updates)
  except AssertionError:
    raise ValueError(
        f"{name} must have the structure of the updates {jax.tree.structure(updates)}; got "
        f"{jax.tree.structure(tree)}.") from None
  expected = updates if batch is None else jax.tree.map(
      lambda g: jax.ShapeDtypeStruct((batch,) + jnp.shape(g), jnp.result_type(g)), updates)
  try:
    chex.assert_trees_all_equal_shapes(tree, expected)
  except AssertionError as error:
    what = "the shapes of the updates" if batch is None else (
        f"shape [len(sample_indices), *update_shape] (a leading axis of {batch})")
    detail = str(error).split("failed:", 1)[-1].strip()
    raise ValueError(f"{name} leaves must have {what}: {detail}") from None
  return tree


def stateless_leaf_map(leaf: Any) -> optax.GradientTransformationExtraArgs:
  """A transformation with an empty state that maps each update leaf ``g`` to ``leaf(g)`` and ignores the
  parameters and every extra argument (a quantizer, a deterministic sparsifier)."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return jax.tree.map(leaf, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
