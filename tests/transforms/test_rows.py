"""The in-place row-write helpers change no value: indices and written tables are what plain indexing gives."""

import jax
import jax.numpy as jnp
import numpy as np

from delayjax.transforms._rows import after_reads, written_row


def test_after_reads_keeps_every_index_and_drops_the_same_writes():
  table = jnp.arange(12.0).reshape(4, 3)
  reads = (jnp.ones(3), {"a": jnp.array([2.0, jnp.nan])})  # a NaN read must not move any index either
  for index in (0, 3, -1, -4, 4, 9, jnp.array([0, 2, 5, -2])):
    got = jax.jit(lambda i: after_reads(i, 4, *reads))(jnp.asarray(index, jnp.int32))
    np.testing.assert_array_equal(table.at[got].add(100.0), table.at[jnp.asarray(index)].add(100.0))
    inside = np.asarray(index)
    assert np.array_equal(np.asarray(got)[inside < 4], inside[inside < 4])


def test_written_row_equals_indexed_set_in_a_scan():
  rng = np.random.default_rng(0)
  table = {"a": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "b": jnp.zeros((5,), jnp.float32)}
  rows = jnp.array([1, 4, 1, 0, 3], jnp.int32)

  def step(t, m):
    new = written_row(t, m, lambda old: jax.tree.map(lambda x: 0.5 * x + 1.0, old))
    return new, jax.tree.map(lambda x: x[m], new)

  got, read_back = jax.lax.scan(step, table, rows)
  want = {k: np.asarray(v).copy() for k, v in table.items()}
  for i, m in enumerate(np.asarray(rows)):
    for k in want:
      want[k][m] = np.float32(0.5) * want[k][m] + np.float32(1.0)
      np.testing.assert_array_equal(np.asarray(read_back[k][i]), want[k][m])
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), want[k])
