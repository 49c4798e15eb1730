"""What ``dj.simulate`` prepares on the host equals what the compiled programs give.

The first step's lane parameters are a NumPy selection when no state defines ``read_params``; delay draws of
integers alone are compiled without the compiler's optimizations; the default worker's minibatches are drawn on
the host a chunk at a time. Each must give exactly what the compiled defaults give.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _sampling, _simulate
from delayjax.runtime._sampling import shard_table

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import hand_schedule, regression_problem  # noqa: E402


def _tables(rng, lanes, workers, slots):
  # Rows past the last worker (padding lanes) and slot -1 (from the end) are indexed as JAX indexes them.
  rows = rng.integers(0, workers + 2, lanes).astype(np.int32)
  slot = rng.integers(-1, slots, lanes).astype(np.int32)
  fresh = rng.random((lanes, 1)) < 0.5
  return rows, slot, fresh


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_first_lanes_on_the_host_equal_the_compiled_selection(dtype):
  rng = np.random.default_rng(0)
  workers, slots, lanes = 3, 4, 7
  params = {"w": rng.normal(size=(5, 2)).astype(dtype), "b": rng.normal(size=(2,)).astype(dtype)}
  held = jax.tree.map(lambda p: rng.normal(size=(workers, slots) + p.shape).astype(dtype), params)
  opt_state = optax.adam(0.1).init(params)
  rows, slot, fresh = _tables(rng, lanes, workers, slots)
  assert fresh.any() and not fresh.all()
  got = _simulate._first_lanes(opt_state, params, held, rows, rows, slot, fresh, None)
  want = jax.device_get(_simulate._first_stale(opt_state, params, held, rows, rows, slot, fresh, None))
  for name in params:
    assert got[name].dtype == want[name].dtype
    np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32))


def test_a_state_that_defines_read_params_is_read_by_the_compiled_program():
  params = {"w": jnp.arange(4, dtype=jnp.float32)}
  tx = dj.dana(0.1, momentum=0.9, num_workers=2)
  opt_state = tx.init(params)
  # One update, so that DANA's look-ahead read differs from the parameters.
  _, opt_state = tx.update({"w": jnp.ones(4, jnp.float32)}, opt_state, params, staleness=jnp.int32(0),
                           worker=jnp.int32(1))
  held = {"w": np.zeros((2, 1, 4), np.float32)}
  rows, slot, fresh = np.array([0, 1], np.int32), np.array([0, 0], np.int32), np.ones((2, 1), bool)
  got = _simulate._first_lanes(opt_state, params, held, rows, rows, slot, fresh, None)
  want = [dj.read_params(opt_state, params, jnp.int32(m))["w"] for m in rows]
  np.testing.assert_array_equal(np.asarray(got["w"]), np.stack([np.asarray(w) for w in want]))
  assert not np.array_equal(np.asarray(got["w"][1]), np.asarray(params["w"]))


@pytest.mark.parametrize("model, exact", [
    (dj.delays.uniform(6), True), (dj.delays.constant(2), True), (dj.delays.trace([0, 3, 1, 2]), True),
    (dj.delays.geometric(0.3, 5), False)])
def test_delay_draws_equal_the_default_compilation(model, exact):
  key, steps = jax.random.fold_in(jax.random.key(7), 0), jnp.arange(300, dtype=jnp.int32)
  draw = jax.vmap(lambda k, t: model.sample(jax.random.fold_in(k, t), t), in_axes=(None, 0))
  got = np.asarray(_simulate._delay_draws.__wrapped__(model)(key, steps))
  np.testing.assert_array_equal(got, np.asarray(jax.jit(draw)(key, steps)))
  # Only integer draws go without the compiler's optimizations; a floating-point one keeps them.
  text = str(jax.make_jaxpr(draw)(key, steps[:1]))
  assert (_simulate._FLOAT_TYPE.search(text) is None) is exact


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("model", [dj.delays.uniform(0), dj.delays.uniform(6), dj.delays.uniform(2**20),
                                   dj.delays.constant(3)])
@pytest.mark.parametrize("seed", [0, 11, 2**32 - 1])
def test_delays_drawn_in_numpy_equal_the_compiled_draw(partitionable, model, seed):
  """``uniform`` and ``constant`` delays are computed on the host, the integers of the model's own sample under
  ``jax.random`` (both Threefry layouts, any seed below ``2**32``); other models (a subclass too) are not."""
  key, steps = jax.random.fold_in(jax.random.key(seed), 0), jnp.arange(500, dtype=jnp.int32)
  with jax.threefry_partitionable(partitionable):
    want = jax.vmap(lambda t: model.sample(jax.random.fold_in(key, t), t))(steps)
    got = _simulate._host_delays(model, 500, seed)
  assert got.shape == (500, 1) and got.dtype == np.int64
  np.testing.assert_array_equal(got[:, 0], np.asarray(want))

  class Own(type(model)):
    pass

  assert _simulate._host_delays(dj.delays.geometric(0.3, 5), 4, seed) is None
  assert _simulate._host_delays(Own(*dataclasses.astuple(model)), 4, seed) is None


@pytest.mark.parametrize("num_microbatches, num_examples, batch_size", [(1, 50, 4), (4, 1797, 32), (3, 7, 5)])
def test_the_pipelines_micro_batch_draws_are_minibatch_indices(num_microbatches, num_examples, batch_size):
  from delayjax.runtime import _pipeline

  updates = np.arange(40, 104, dtype=np.int32)
  kw = dict(num_microbatches=num_microbatches, num_examples=num_examples, batch_size=batch_size)
  got = _pipeline._micro_indices(11, updates, **kw)
  # Micro-batch j of update u: minibatch_indices(seed, u, j, 0), whatever the other updates drawn with it, from
  # the host's shared draw as from the default compilation of the rule.
  micro = jnp.arange(num_microbatches, dtype=jnp.int32)
  want = jax.jit(jax.vmap(lambda u: jax.vmap(lambda j: dj.runtime.minibatch_indices(
      11, u, j, 0, num_examples=num_examples, batch_size=batch_size))(micro)))(jnp.asarray(updates))
  np.testing.assert_array_equal(got, np.asarray(want))
  np.testing.assert_array_equal(got[5, -1], np.asarray(dj.runtime.minibatch_indices(
      11, 45, num_microbatches - 1, 0, num_examples=num_examples, batch_size=batch_size)))
  assert got.shape == (64, num_microbatches, batch_size) and got.dtype == np.int32
  assert got.min() >= 0 and got.max() < num_examples


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("batch_size", [1, 5, 32])
def test_numpy_threefry_draws_equal_the_compiled_draw(partitionable, batch_size):
  """The NumPy Threefry draw gives the compiled draw's integers under both of ``jax.random``'s Threefry layouts,
  for odd and even batch sizes (the original layout pads odd counts) and spans up to ``2**31 - 1``."""
  rng = np.random.default_rng(3)
  updates, workers, draws = (rng.integers(0, 2**31 - 1, 300).astype(np.int32) for _ in range(3))
  sizes = np.concatenate([[1, 2, 3, 2**31 - 1], rng.integers(1, 2**31 - 1, 296)]).astype(np.int32)
  with jax.threefry_partitionable(partitionable):
    want = np.asarray(_sampling._draw_positions(np.uint32(2**32 - 5), updates, workers, draws, sizes,
                                                batch_size=batch_size))
    got = _sampling._host_positions(2**32 - 5, updates, workers, draws, sizes, batch_size)
  assert got.dtype == np.int32 and got.shape == (300, batch_size)
  np.testing.assert_array_equal(got, want)


def test_draws_switch_to_the_compiled_draw_after_their_share(monkeypatch):
  """NumPy draws a batch size's first ``_HOST_DRAWN_INDICES`` indices of a process, the compiled draw the rest;
  ``jax.random`` keys other than Threefry's always take the compiled draw."""
  monkeypatch.setattr(_sampling, "_host_drawn", {})
  monkeypatch.setattr(_sampling, "_HOST_DRAWN_INDICES", 100)
  assert [_sampling._on_host(4, 16) for _ in range(3)] == [True, True, False]
  assert _sampling._on_host(5, 16)
  with jax.default_prng_impl("rbg"):
    assert not _sampling._on_host(6, 1)


@pytest.mark.parametrize("sampling", ["iid", "shard", "epoch"])
@pytest.mark.parametrize("own_batches", [True, False])
@pytest.mark.parametrize("host", [True, False])
def test_lane_examples_drawn_in_blocks_are_minibatch_indices(sampling, own_batches, host, monkeypatch):
  """The host draws a chunk's minibatches in fixed blocks (the last one padded); every active lane's are still
  ``minibatch_indices`` of its update, worker and draw, across block boundaries: its own ``batches`` of them
  (zeros beyond), or all ``max_batches`` without ``batches``. Inactive lanes get zeros. Whether NumPy or the
  compiled draw computes them."""
  monkeypatch.setattr(_sampling, "_DRAW_BLOCK", 8)
  monkeypatch.setattr(_sampling, "_host_drawn", {})
  monkeypatch.setattr(_sampling, "_HOST_DRAWN_INDICES", 1 << 30 if host else 0)
  rng = np.random.default_rng(0)
  steps, lanes, max_batches, n, batch = 5, 4, 3, 40, 4
  active = rng.random((steps, lanes)) < 0.7
  batches = np.where(active, rng.integers(1, max_batches + 1, size=(steps, lanes)), 0).astype(np.int32)
  first = rng.integers(0, 50, size=(steps, lanes)).astype(np.int32)
  worker = rng.integers(0, 6, size=(steps, lanes)).astype(np.int32)
  update = rng.integers(0, 30, size=(steps, lanes)).astype(np.int32)
  shards = [np.arange(q, n, 6) for q in range(6)]
  rows, sizes = shard_table(shards, n, 6, 6) if sampling == "shard" else (np.zeros((6, 1), np.int32),
                                                                          np.ones(6, np.int32))
  assert batches.sum() > 2 * 8  # several blocks, the last one partial
  got = _sampling.lane_examples(active, first, worker, max_batches, update=update,
                                batches=batches if own_batches else None, seed=7, num_examples=n, batch_size=batch,
                                sampling=sampling, shard_rows=rows, shard_sizes=sizes)
  assert got.shape == (steps, lanes, max_batches, batch)
  for s, lane in np.ndindex(steps, lanes):
    for b in range(max_batches):
      if active[s, lane] and (b < batches[s, lane] or not own_batches):
        i = int(worker[s, lane])
        want = dj.runtime.minibatch_indices(7, int(update[s, lane]), i, int(first[s, lane]) + b, num_examples=n,
                                            batch_size=batch, sampling=sampling, shard=rows[i], shard_size=sizes[i])
        np.testing.assert_array_equal(got[s, lane, b], np.asarray(want))
      else:
        np.testing.assert_array_equal(got[s, lane, b], 0)


def _saga(num_examples):
  return optax.chain(dj.saga(num_examples), optax.sgd(0.02))


@pytest.mark.parametrize("sampling, tx", [("iid", "sgd"), ("shard", "sgd"), ("epoch", "sgd"), ("iid", "saga")])
def test_minibatches_drawn_on_the_host_give_the_run_drawn_in_the_step(sampling, tx, monkeypatch):
  """A run whose minibatches the host draws (the default worker's, while the table is small) equals, bit for bit,
  the same run with its minibatches drawn inside the compiled step (a table over the size limit): on a schedule of
  two contributions per update and up to three minibatches each, for each sampling scheme, and with SAGA, which
  takes every drawn example's index."""
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(4, 30, group=2, max_batches=3, seed=21)
  optimizer = _saga(data["x"].shape[0]) if tx == "saga" else optax.sgd(0.05)
  drawn = []
  monkeypatch.setattr(_simulate, "lane_examples", lambda *a, **k: drawn.append(1) or _sampling.lane_examples(*a, **k))

  def run():
    return dj.simulate(loss_fn, optimizer, params, data, schedule, seed=3, sampling=dj.Sampling(4, scheme=sampling),
                       record=dj.Record(every=5, eval_fn=lambda p: {"w0": p["w"][0]}))

  on_host = run()
  assert drawn, "the default worker's minibatches were not drawn on the host"
  monkeypatch.setattr(_simulate, "_HOST_DRAWS_BYTES", 0)
  drawn.clear()
  in_step = run()
  assert not drawn
  for a, b in zip(jax.tree.leaves((on_host.params, on_host.opt_state, on_host.history)),
                  jax.tree.leaves((in_step.params, in_step.opt_state, in_step.history)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
