"""The torn-read model's side of ``dj.simulate``: which stored read each coordinate of the parameters comes from.

``dj.delays.per_leaf`` splits a read into *groups* of whole leaves, each read
at its own version; the planner (``_waves.plan_steps``) schedules one read per
group and the step stores each in the leaves of its group. A torn read
(``dj.delays.torn``) is the same with a group per *block of coordinates*: the
planner is unchanged (``G`` = the number of blocks), and the step stores a
group's read into the coordinates of its block. :class:`BlockGroups` is that
map, static (hashable: it is part of the compiled program's key and the run's
identity).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from delayjax import delays as delays_lib

__all__ = ["BlockGroups"]


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

  @staticmethod
  def store(slot_leaf: jax.Array, value: jax.Array, row: Any, slot: Any, group: Any, ids: np.ndarray) -> jax.Array:
    """``slot_leaf`` (``[rows, slots, *shape]``) with block ``group``'s coordinates of ``value`` written at
    ``[row, slot]``, the others kept (a row out of range writes nothing)."""
    current = slot_leaf[jnp.minimum(row, slot_leaf.shape[0] - 1), slot]
    return slot_leaf.at[row, slot].set(jnp.where(jnp.asarray(ids) == group, value, current), mode="drop")
