"""Row writes into per-worker and per-sample tables that stay in place inside loops.

Inside a loop (``lax.scan``, a runtime's update loop) XLA writes rows of a
table in place only if it can tell that every read of the table comes
before the write; otherwise it copies the whole table at every update (all
rows, for one row's change: measured 1047 instead of 5 microseconds per
update for a 20000 x 200 table, ``python -m experiments.bench_tables``).
Elementwise uses of a row read are fused into their consumers, even outside
the transformation (``optax.apply_updates``), so they may read the table
again, in fusions the write is not ordered after. Two ways out, one per
shape of update:

* :func:`written_row`: when the update needs only the new row, write it and
  read it back from the new table (reads after the write are always safe).
* :func:`after_reads`: when it needs the old rows themselves (SAGA's
  correction), make the write index depend on every output computed from
  them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def written_row(table: Any, index: jax.Array, new_row: Callable[[Any], Any]) -> Any:
  """``table`` (a pytree of ``[rows, ...]`` leaves) with row ``index`` replaced by ``new_row(old row)``.

  Read the new row back from the result (``leaf[index]``), not from what
  ``new_row`` returned: then no use of the old row outlives the write.
  """
  new = new_row(jax.tree.map(lambda t: t[index], table))
  return jax.tree.map(lambda t, r: t.at[index].set(r.astype(t.dtype)), table, new)


def after_reads(index: Any, size: int, *read_results: Any) -> jax.Array:
  """``index`` unchanged, but computed from ``read_results``: the write index of a table's rows.

  ``read_results`` must hold every output computed from the rows read (see
  the module docstring). ``min(index, size + t)``, with
  ``t`` 0 or 1, is ``index`` for every index below ``size`` (negative ones
  included) and stays out of range, so dropped, for every index at or above it.

  Args:
    index: the int row index or indices to write.
    size: the number of rows of the table.
    *read_results: pytrees of arrays computed from the rows read.

  Returns:
    ``index`` as an array of its dtype.
  """
  index = jnp.asarray(index)
  token = jnp.isnan(sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(read_results)))
  return jnp.minimum(index, jnp.asarray(size, index.dtype) + token.astype(index.dtype))
