"""Buffers stacked on a leading axis that keep the sharding of the arrays they stack.

A ring of ``R`` past gradients, or a table of one row per worker, is a leaf
``[R, *shape]`` per parameter leaf ``[*shape]``. Made with plain ``jnp.zeros``
it lands on the default device (or, inside ``jit``, is replicated on every
device): an FSDP- or tensor-parallel-sharded parameter would then have its
buffers gathered whole onto each device, ``R`` times its own size, and every
write into the buffer would all-gather the sharded value first. Here the new
leading axis is left unsharded and the parameter's own axes keep the
parameter's partition, so each device holds ``R`` copies of its own shard and
reading or writing a row moves no data between devices.

Where the sharding is known: a concrete ``jax.Array`` with a ``NamedSharding``
(``init`` called outside ``jit``, the usual case), and a traced value whose
type carries its sharding (a mesh with ``jax.sharding.AxisType.Explicit``
axes, set with ``jax.set_mesh``). A traced value on ``Auto`` axes does not say
how it is sharded; its buffers are plain zeros, and the caller's
``out_shardings`` (or XLA's propagation) decides.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["leaf_sharding", "stacked_zeros"]


def leaf_sharding(leaf: Any) -> NamedSharding | None:
  """The ``NamedSharding`` of ``leaf`` when it is known and partitions something, else ``None``."""
  if isinstance(leaf, jax.core.Tracer):
    try:
      sharding = jax.typeof(leaf).sharding
    except (AttributeError, TypeError):
      return None
    # On Auto axes a tracer's type says nothing (every entry of its spec is None).
    if not isinstance(sharding, NamedSharding) or all(s is None for s in sharding.spec):
      return None
    return sharding
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, NamedSharding) and len(sharding.mesh.devices.flat) > 1:
    return sharding
  return None


def stacked_zeros(leaf: Any, rows: int) -> jax.Array:
  """Zeros ``[rows, *leaf.shape]`` in ``leaf``'s dtype, sharded as ``leaf`` on its axes, unsharded on the new one."""
  shape = (rows,) + tuple(jnp.shape(leaf))
  dtype = jnp.result_type(leaf)
  sharding = leaf_sharding(leaf)
  if sharding is None:
    return jnp.zeros(shape, dtype)
  stacked = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec), memory_kind=sharding.memory_kind)
  if isinstance(leaf, jax.core.Tracer):
    return jnp.zeros(shape, dtype, out_sharding=stacked)
  return jnp.zeros(shape, dtype, device=stacked)
