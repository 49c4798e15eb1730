"""dj.simulate with torn reads (dj.delays.torn): each block of coordinates read at its own stale version.

The reference is a NumPy re-implementation of the rule: keep every version of the parameters, read coordinate
``i`` of update ``t`` from version ``max(0, t - d[t, block(i)])``, with the delays drawn as the docstring says
(block ``b`` of update ``t`` from ``model.sample(fold_in(fold_in(fold_in(key(seed), 0), t), b), t)``).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import regression_problem  # noqa: E402

LR = 0.1


def _params():
  return {"b": jnp.linspace(1.0, 2.0, 3), "w": jnp.arange(1.0, 7.0).reshape(2, 3)}


def _half_square(w, batch):
  """0.5 ||w||^2: its gradient is the read itself, so each update shows the read it was computed at."""
  del batch
  return 0.5 * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(w))


def _drawn_delays(model, num_updates, seed):
  """int64 [U, num_blocks]: block b's delay at update t, drawn one by one as the docstring says."""
  key = jax.random.fold_in(jax.random.key(seed), 0)
  return np.array([[int(model.model.sample(jax.random.fold_in(jax.random.fold_in(key, t), b), t))
                    for b in range(model.num_blocks)] for t in range(num_updates)], np.int64)


def _numpy_torn_sgd(params, delays, block_size, num_updates):
  """Every version of SGD (step LR) on 0.5 ||w||^2 under torn reads, in NumPy: [U + 1, coordinates]."""
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]
  blocks = np.concatenate([start + np.arange(x.size) // block_size for start, x in
                           zip(np.cumsum([0] + [-(-x.size // block_size) for x in leaves])[:-1], leaves)])
  versions = [np.concatenate([x.ravel() for x in leaves])]
  for t in range(num_updates):
    read_at = np.maximum(0, t - delays[t, blocks])
    read = np.array([versions[v][i] for i, v in enumerate(read_at)], np.float32)
    versions.append((versions[-1] - np.float32(LR) * read).astype(np.float32))
  return np.stack(versions)


def _run(source, params, num_updates, seed=0, tx=None, record=None):
  data = {"x": np.zeros((8, 1), np.float32)}
  return dj.simulate(_half_square, tx or optax.sgd(LR), params, data, source, num_updates=num_updates, seed=seed,
                     sampling=dj.Sampling(batch_size=1), record=record)


def _flat(tree):
  return np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in jax.tree.leaves(tree)], axis=1)


@pytest.mark.parametrize("block_size,seed", [(1, 0), (2, 3), (4, 1)])
def test_torn_read_equals_the_numpy_reconstruction(block_size, seed):
  params, num_updates = _params(), 24
  model = dj.delays.torn(params, dj.delays.uniform(3), block_size=block_size)
  result = _run(model, params, num_updates, seed=seed, record=dj.Record(every=1, eval_fn=lambda p: p))
  delays = _drawn_delays(model, num_updates, seed)
  expected = _numpy_torn_sgd(params, delays, block_size, num_updates)
  np.testing.assert_array_equal(_flat(result.history.eval_metrics), expected)
  # The reads do tear: some update reads its blocks at different versions.
  assert np.any(delays.min(axis=1) != delays.max(axis=1))
  # The update's staleness is its stalest block's (capped at the update index, as every stale read).
  np.testing.assert_array_equal(result.history.staleness, np.minimum(delays.max(axis=1), np.arange(num_updates)))


def test_equal_block_delays_are_the_consistent_read_bit_for_bit():
  data, loss_fn, params = regression_problem()
  tx = optax.sgd(0.05, momentum=0.9)
  run = lambda source: dj.simulate(loss_fn, tx, params, data, source, num_updates=40, seed=2,  # noqa: E731
                                   sampling=dj.Sampling(batch_size=4))
  consistent = run(dj.delays.constant(3))
  torn = run(dj.delays.torn(params, dj.delays.constant(3), block_size=1))
  for a, b in zip(jax.tree.leaves((torn.params, torn.opt_state)),
                  jax.tree.leaves((consistent.params, consistent.opt_state)), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(torn.history.loss, consistent.history.loss)
  np.testing.assert_array_equal(torn.history.staleness, consistent.history.staleness)


def test_equal_block_delays_on_a_nonlinear_model_agree_as_per_leaf_does():
  """On a tanh model XLA compiles the lanes' gradient from the stored blocks into another program than from one
  stored read (per_leaf reads differ from the consistent read the same way): equal to rounding, and equal to
  per_leaf's reads bit for bit."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 5)).astype(np.float32)
  data = {"x": x, "y": np.tanh(x @ np.arange(5, dtype=np.float32))}
  params = {"v": jnp.full((5, 2), 0.1), "w": jnp.zeros(5)}

  def loss(p, batch):
    hidden = jnp.tanh(batch["x"][:, :, None] * p["v"][None]).sum(-1)
    return jnp.mean((hidden @ p["w"] - batch["y"]) ** 2)

  run = lambda source: dj.simulate(loss, optax.sgd(0.05), params, data, source, num_updates=40,  # noqa: E731
                                   seed=2, sampling=dj.Sampling(batch_size=8)).params
  consistent = run(dj.delays.constant(3))
  torn = run(dj.delays.torn(params, dj.delays.constant(3), block_size=1))
  per_leaf = run(dj.delays.per_leaf({"v": dj.delays.constant(3), "w": dj.delays.constant(3)}))
  for a, b, c in zip(jax.tree.leaves(torn), jax.tree.leaves(consistent), jax.tree.leaves(per_leaf), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a, c)


def test_one_block_per_leaf_is_per_leaf_delays():
  """A block as large as a leaf makes a leaf one block: per_leaf with the same model on every leaf, drawn with the
  same keys (leaf i from fold_in(key, i) in tree order). The same reads: the same staleness, and parameters equal
  to the last bit or two (XLA compiles the two steps apart and may fuse w - lr * g into one rounding in one)."""
  params = _params()
  torn = _run(dj.delays.torn(params, dj.delays.uniform(4), block_size=6), params, 30, seed=5)
  per_leaf = _run(dj.delays.per_leaf({"b": dj.delays.uniform(4), "w": dj.delays.uniform(4)}), params, 30, seed=5)
  np.testing.assert_array_equal(torn.history.staleness, per_leaf.history.staleness)
  assert torn.history.staleness.max() == 4
  for a, b in zip(jax.tree.leaves(torn.params), jax.tree.leaves(per_leaf.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def test_sample_for_spreads_each_blocks_draw_over_its_coordinates():
  params = _params()
  model = dj.delays.torn(params, dj.delays.uniform(7), block_size=2)
  key = jax.random.key(11)
  tree = dj.delays.sample_for(model, key, 3, params)
  draws = np.asarray(model.sample(key, 3))
  assert draws.shape == (model.num_blocks,) == (5,)
  # b (3 coordinates) is blocks 0, 0, 1; w (6 coordinates) blocks 2, 2, 3, 3, 4, 4.
  np.testing.assert_array_equal(tree["b"], draws[[0, 0, 1]])
  np.testing.assert_array_equal(tree["w"], draws[[2, 2, 3, 3, 4, 4]].reshape(2, 3))
  assert model.max_delay == 7 and model.mean() == 3.5
  np.testing.assert_array_equal(model.pmf(), np.full(8, 1 / 8))


def test_same_seed_same_result_and_another_seed_another():
  params = _params()
  model = dj.delays.torn(params, dj.delays.uniform(3))
  a, b, c = (_run(model, params, 20, seed=s).params for s in (1, 1, 2))
  np.testing.assert_array_equal(a["w"], b["w"])
  assert not np.array_equal(a["w"], c["w"])


@pytest.mark.parametrize("block_size,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                              (True, TypeError)])
def test_bad_block_size_is_refused_by_name(block_size, error):
  with pytest.raises(error, match="block_size"):
    dj.delays.torn(_params(), dj.delays.uniform(2), block_size=block_size)


def test_bad_models_are_refused():
  params = _params()
  with pytest.raises(TypeError, match="model"):
    dj.delays.torn(params, dj.delays.per_leaf({"b": 1, "w": 2}))
  with pytest.raises(TypeError, match="model"):
    dj.delays.torn(params, "uniform")
  with pytest.raises(TypeError, match="model"):
    dj.delays.Torn(dj.delays.torn(params, 1), 1, jax.tree.structure(params), ((3,), (2, 3)))
  with pytest.raises(ValueError, match="at least one array leaf"):
    dj.delays.torn({}, 2)


def test_mismatched_params_are_refused_by_name():
  model = dj.delays.torn(_params(), dj.delays.uniform(2))
  with pytest.raises(ValueError, match=r"params must have the tree and leaf shapes .*\(3,\), \(2, 3\)"):
    _run(model, {"b": jnp.zeros(4), "w": jnp.zeros((2, 3))}, 5)
  with pytest.raises(ValueError, match="params must have the tree"):
    _run(model, {"w": jnp.zeros((2, 3))}, 5)
  with pytest.raises(ValueError, match="tree must have the tree"):
    dj.delays.sample_for(model, jax.random.key(0), 0, jnp.zeros(9))


def test_apply_side_consumers_refuse_a_torn_model():
  params = _params()
  model = dj.delays.torn(params, dj.delays.uniform(2))
  with pytest.raises(ValueError, match="torn read model"):
    dj.delayed(optax.sgd(0.1), model)
  with pytest.raises(ValueError, match="per_leaf or torn"):
    dj.growing_batches(model, num_updates=10)


def test_lanes_and_chunks_do_not_change_a_torn_run():
  data, loss_fn, params = regression_problem()
  source = dj.delays.torn(params, dj.delays.uniform(5), block_size=2)
  run = lambda execution: dj.simulate(loss_fn, optax.sgd(0.05), params, data, source, num_updates=30,  # noqa: E731
                                      seed=4, sampling=dj.Sampling(batch_size=4), execution=execution)
  default, narrow = run(None), run(dj.Execution(lanes=1, chunk_size=3))
  for a, b in zip(jax.tree.leaves(default.params), jax.tree.leaves(narrow.params), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(default.history.loss, narrow.history.loss)


@pytest.mark.slow
def test_torn_reads_on_eight_devices_and_across_resume(tmp_path):
  data, loss_fn, params = regression_problem()
  source = dj.delays.torn(params, dj.delays.uniform(6), block_size=1)
  tx = optax.sgd(0.05, momentum=0.9)
  kw = dict(num_updates=36, sampling=dj.Sampling(batch_size=4), seed=1)
  whole = dj.simulate(loss_fn, tx, params, data, source, execution=dj.Execution(chunk_size=4), **kw)
  multi = dj.simulate(loss_fn, tx, params, data, source,
                      execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))), **kw)
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(multi.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def stop(info):
    if info["chunk"] == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    dj.simulate(loss_fn, tx, params, data, source, execution=dj.Execution(chunk_size=4),
                checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=stop), **kw)
  resumed = dj.simulate(loss_fn, tx, params, data, source, execution=dj.Execution(chunk_size=4),
                        checkpoint=dj.Checkpoint(tmp_path), **kw)
  for a, b in zip(jax.tree.leaves((whole.params, whole.opt_state)),
                  jax.tree.leaves((resumed.params, resumed.opt_state)), strict=True):
    np.testing.assert_array_equal(a, b)
  # Another block size is another run: its checkpoint is not resumed.
  with pytest.raises(ValueError, match="of a different run: options"):
    dj.simulate(loss_fn, tx, params, data, dj.delays.torn(params, dj.delays.uniform(6), block_size=2),
                execution=dj.Execution(chunk_size=4), checkpoint=dj.Checkpoint(tmp_path, resume=True), **kw)
