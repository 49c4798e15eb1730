"""The read models' side of ``dj.simulate``: which stored read each part of the parameters comes from.

A stale-read source may read the parameters in *groups*, each at its own
version: ``dj.delays.per_leaf`` groups whole leaves, ``dj.delays.torn``
blocks of coordinates (a torn read). The planner (``_waves.plan_steps``) is
the same for both: one read per group (``G`` groups). What differs is where a
group's read lands, and the staleness the transformation is given; each
model answers that with the same three methods, so the step has no branch per
model:

- ``ids()``: each parameter leaf's group (an int), or each coordinate's (an
  int32 array of the leaf's shape);
- ``store(slots, value, row, slot, group, out_of_range)``: the slots with
  group ``group`` of ``value`` written at ``[row, slot]``;
- ``staleness(per_group, params)``: the staleness a transformation is given,
  from the groups' staleness on the last axis of ``per_group``.

``None`` (one group: every read whole) keeps the step as it was without
groups. Both classes are static and hashable: they are part of the compiled
program's key and of the run's identity (``identity()``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from delayjax import delays as delays_lib

__all__ = ["BlockGroups", "LeafGroups", "map_groups"]


def map_groups(fn: Callable[..., Any], groups: "LeafGroups | BlockGroups | None", *trees: Any) -> Any:
  """``jax.tree.map(fn(group, *leaves), *trees)``, with each leaf's group from ``groups.ids()`` (0 for every leaf
  when ``groups`` is ``None``)."""
  leaves = [jax.tree.leaves(t) for t in trees]
  ids = groups.ids() if groups is not None else (0,) * len(leaves[0])
  out = [fn(g, *xs) for g, *xs in zip(ids, *leaves, strict=True)]
  return jax.tree.unflatten(jax.tree.structure(trees[0]), out)


class LeafGroups(NamedTuple):
  """Each parameter leaf's group for ``dj.delays.per_leaf``: a leaf is read whole, at its group's version."""

  groups: tuple[int, ...]  # the parameter leaves' groups, in tree order

  def ids(self) -> tuple[int, ...]:
    return self.groups

  def identity(self) -> tuple[int, ...]:
    return self.groups

  def store(self, slots: Any, value: Any, row: Any, slot: Any, group: Any, out_of_range: int) -> Any:
    # Only the read group's leaves are stored: the others are written at a row out of range, which drops.
    return map_groups(lambda g, s, v: s.at[jnp.where(group == g, row, out_of_range), slot].set(v, mode="drop"),
                      self, slots, value)

  def staleness(self, per_group: jax.Array, params: Any) -> Any:
    """A tree like ``params``: each leaf's group's staleness."""
    return map_groups(lambda g, p: per_group[..., g], self, params)


class BlockGroups(NamedTuple):
  """Each coordinate's group for a torn read: block ``j // block_size`` of its leaf, numbered across leaves."""

  block_size: int
  shapes: tuple[tuple[int, ...], ...]  # the parameter leaves' shapes, in tree order

  @classmethod
  def of(cls, model: delays_lib.Torn) -> "BlockGroups":
    return cls(model.block_size, model.shapes)

  def ids(self) -> list[np.ndarray]:
    """int32 ``[*leaf shape]`` per leaf: the group (block) of each coordinate."""
    return delays_lib.block_ids(self.shapes, self.block_size)

  def identity(self) -> "BlockGroups":
    return self

  def store(self, slots: Any, value: Any, row: Any, slot: Any, group: Any, out_of_range: int) -> Any:
    """Only block ``group``'s coordinates of ``value`` are written at ``[row, slot]``, the others kept (a row
    out of range writes nothing)."""
    del out_of_range  # every leaf holds coordinates of the block: the write keeps the others instead

    def store_leaf(ids, slot_leaf, v):
      current = slot_leaf[jnp.minimum(row, slot_leaf.shape[0] - 1), slot]
      return slot_leaf.at[row, slot].set(jnp.where(jnp.asarray(ids) == group, v, current), mode="drop")

    return map_groups(store_leaf, self, slots, value)

  def staleness(self, per_group: jax.Array, params: Any) -> jax.Array:
    """A torn read is one read: its staleness is its stalest block's."""
    del params
    return jnp.max(per_group, axis=-1)
