"""Per-worker and per-sample tables: their size is found through wrappers, and a traced index outside them is never
silently clamped or wrapped around: the update is NaN and the table unchanged."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import delayjax as dj

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}

# Transformations with a per-worker table of 4 rows.
PER_WORKER = {
    "delay_compensation_a": lambda: dj.delay_compensation(2.0, adaptive=True, num_workers=4),
    "dana": lambda: dj.dana(0.1, momentum=0.5, num_workers=4),
    "dana_slim": lambda: dj.dana_slim(0.1, momentum=0.5, num_workers=4),
    "dana_dc_adaptive": lambda: dj.dana(0.1, momentum=0.5, num_workers=4, dc_lambda=1.0, dc_adaptive=True),
}


def extras(worker):
  return {"worker": worker, "stale_params": jax.tree.map(lambda p: 0.5 * p, PARAMS), "staleness": 1}


@pytest.mark.parametrize("name", PER_WORKER)
def test_capacity_is_found_through_wrappers(name):
  make = PER_WORKER[name]
  assert dj.worker_capacity(make().init(PARAMS)) == 4
  assert dj.worker_capacity(optax.chain(optax.identity(), make()).init(PARAMS)) == 4
  assert dj.worker_capacity(optax.MultiSteps(make(), 2).init(PARAMS)) == 4
  assert dj.worker_capacity(jax.eval_shape(dj.delayed(make(), dj.delays.constant(2)).init, PARAMS)) == 4
  injected = optax.inject_hyperparams(lambda scale: optax.chain(make(), optax.scale(scale)))(scale=1.0)
  assert dj.worker_capacity(injected.init(PARAMS)) == 4


def test_capacity_is_the_smallest_table_and_none_without_one():
  tx = optax.chain(dj.delay_compensation(2.0, adaptive=True, num_workers=8), dj.dana_slim(0.1, num_workers=3))
  assert dj.worker_capacity(tx.init(PARAMS)) == 3
  for tx in (optax.adam(0.1), dj.delay_compensation(0.5), dj.delay_compensation(2.0, adaptive=True),
             dj.delay_compensation(0.5, num_workers=4), dj.scale_by_staleness()):
    assert dj.worker_capacity(tx.init(PARAMS)) is None  # no per-worker rows: any number of workers


@pytest.mark.parametrize("name", PER_WORKER)
def test_traced_worker_out_of_range_gives_nan_updates_and_leaves_the_table(name):
  tx = PER_WORKER[name]()
  state = tx.init(PARAMS)
  update = jax.jit(lambda s, m: tx.update(PARAMS, s, PARAMS, **extras(m)))
  _, state = update(state, jnp.int32(1))  # some state to keep
  for bad in (4, 5, -1):
    u, after = update(state, jnp.int32(bad))
    assert all(bool(jnp.all(jnp.isnan(x))) for x in jax.tree.leaves(u)), bad
    tables = [x for x in jax.tree.leaves(after) if jnp.ndim(x) >= 2]  # the per-worker rows, unchanged
    chex.assert_trees_all_equal(tables, [x for x in jax.tree.leaves(state) if jnp.ndim(x) >= 2])
  u, _ = update(state, jnp.int32(3))
  eager, _ = tx.update(PARAMS, state, PARAMS, **extras(3))
  chex.assert_trees_all_close(u, eager, rtol=1e-6)
  with pytest.raises(ValueError, match=r"worker must be in \[0, 4\), got 5"):
    tx.update(PARAMS, state, PARAMS, **extras(5))
  with pytest.raises(TypeError, match="worker must be an integer scalar"):
    tx.update(PARAMS, state, PARAMS, **extras(1.0))


@pytest.mark.parametrize("table", ["gradients", "scalars"])
def test_saga_traced_sample_index_out_of_range_gives_nan_and_leaves_the_table(table):
  tx = dj.saga(4, table=table)
  w = jnp.ones(3)
  kwargs = {"sample_grads": jnp.ones((2, 3)), "sample_scalars": jnp.ones(2), "sample_features": jnp.ones((2, 3))}
  update = jax.jit(lambda s, idx, mask: tx.update(w, s, w, sample_indices=idx, sample_mask=mask, **kwargs))
  state = tx.init(w)
  _, state = update(state, jnp.array([0, 1]), jnp.array([True, True]))
  for bad in ([1, 4], [-1, 2]):
    u, after = update(state, jnp.array(bad), jnp.array([True, True]))
    assert bool(jnp.all(jnp.isnan(u)))
    chex.assert_trees_all_equal(after.table, state.table)
    chex.assert_trees_all_equal(after.table_sum, state.table_sum)
  # A masked entry (a runtime's padding) may hold any index.
  u, after = update(state, jnp.array([2, 9]), jnp.array([True, False]))
  eager, want = tx.update(w, state, w, sample_indices=2, sample_mask=True,
                          **{k: v[:1] for k, v in kwargs.items()})
  chex.assert_trees_all_close(u, eager, rtol=1e-6)
  chex.assert_trees_all_close(after.table, want.table, rtol=1e-6)


def test_prox_asaga_traced_sample_index_out_of_range_gives_nan_and_leaves_the_table():
  tx = dj.prox_asaga(2, 0.5, dj.prox_l1(0.1), support_counts=jnp.array([1, 1, 0]))
  w = jnp.zeros(3)
  features = (jnp.array([0]), jnp.array([1.0]))
  update = jax.jit(lambda s, i: tx.update(w, s, w, sample_indices=i, sample_scalars=-1.0, sample_features=features))
  state = tx.init(w)
  _, state = update(state, jnp.int32(1))
  for bad in (2, -1):
    u, after = update(state, jnp.int32(bad))
    assert bool(jnp.isnan(u[0]))  # the sample's support
    chex.assert_trees_all_equal(after.table, state.table)
    chex.assert_trees_all_equal(after.table_sum, state.table_sum)
