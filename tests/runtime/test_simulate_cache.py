"""``dj.simulate`` compiles once per program: a repeated run reuses it and gives what a fresh compile gives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine as engine
from delayjax.runtime import _simulate
from simulate_reference import compiled_by

BATCH = 4


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=40, seed=0)
  return data, schedule, {"w": jnp.zeros(3, jnp.float32)}


def _loss(scale):
  def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ (params["w"] * scale) - batch["y"]) ** 2)
  return loss_fn


def _run(problem, tx, seed=0, loss_fn=None):
  data, schedule, params = problem
  return dj.simulate(loss_fn or _loss(jnp.ones(3)), tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                     seed=seed, execution=dj.Execution(chunk_size=4))


def _fresh(run):
  """``run()`` with nothing cached, as in a new process."""
  engine.clear_cache()
  _simulate._plans.clear()
  return run()


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves((a.params, a.history.loss)), jax.tree.leaves((b.params, b.history.loss)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_repeated_run_reuses_the_compiled_chunk_and_equals_a_fresh_compile(problem):
  first = _fresh(lambda: _run(problem, optax.sgd(0.05)))
  hits = engine.cache_info()["hits"]
  # A new transformation and a new closure of the same model: the same program.
  again = _run(problem, optax.sgd(0.05))
  assert engine.cache_info()["hits"] == hits + 1
  _assert_same(first, again)
  # Only the seed differs: still a hit, and the numbers a fresh process gives for that seed.
  other_seed = _run(problem, optax.sgd(0.05), seed=5)
  assert engine.cache_info()["hits"] == hits + 2
  _assert_same(other_seed, _fresh(lambda: _run(problem, optax.sgd(0.05), seed=5)))
  assert not np.array_equal(other_seed.history.loss, first.history.loss)


def test_a_hyper_parameter_held_in_the_state_is_an_argument(problem):
  sgd = optax.inject_hyperparams(optax.sgd)
  slow = _fresh(lambda: _run(problem, sgd(learning_rate=0.01)))
  hits = engine.cache_info()["hits"]
  fast = _run(problem, sgd(learning_rate=0.08))
  assert engine.cache_info()["hits"] == hits + 1
  _assert_same(fast, _fresh(lambda: _run(problem, sgd(learning_rate=0.08))))
  assert not np.array_equal(fast.history.loss, slow.history.loss)


def test_a_different_program_is_not_taken_from_the_cache(problem):
  base = _fresh(lambda: _run(problem, optax.sgd(0.05)))
  changed = {
      "learning rate literal": lambda: _run(problem, optax.sgd(0.02)),
      # The same model text closing over other values: its constants are part of the program's identity.
      "closed-over array": lambda: _run(problem, optax.sgd(0.05), loss_fn=_loss(jnp.asarray([1.0, 0.5, 2.0]))),
  }
  for name, run in changed.items():
    misses = engine.cache_info()["misses"]
    result = run()
    assert engine.cache_info()["misses"] == misses + 1, name
    # A wrongly shared program would have repeated the base run's numbers.
    assert not np.array_equal(result.history.loss, base.history.loss), name


@pytest.mark.standard_promotion
def test_a_resumed_run_reuses_the_compiled_chunk(problem, tmp_path):
  straight = _fresh(lambda: _run(problem, optax.adam(0.05)))

  class Stop(Exception):
    pass

  def stop_after_two(info):
    if info["chunk"] == 1:
      raise Stop

  data, schedule, params = problem
  run = lambda callback: dj.simulate(_loss(jnp.ones(3)), optax.adam(0.05), params, data, schedule,
                                     sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(chunk_size=4),
                                     checkpoint=dj.Checkpoint(str(tmp_path)), record=dj.Record(callback=callback))
  with pytest.raises(Stop):
    run(stop_after_two)
  chunks = []
  compiled, resumed = compiled_by(lambda: run(lambda info: chunks.append(info["chunk"])))
  assert chunks[0] == 2  # it continued from the checkpoint
  # The restored carry is placed as a fresh one is, so JAX's compile cache serves the chunk program.
  assert not [name for name in compiled if "chunk" in name], compiled
  _assert_same(resumed, straight)


def test_shards_of_other_sizes_share_the_program_and_their_padding_is_never_drawn(problem):
  data, schedule, params = problem

  def run(shards):
    return dj.simulate(_loss(jnp.ones(3)), optax.sgd(0.05), params, data, schedule,
                       sampling=dj.Sampling(batch_size=BATCH, scheme="shard", shards=shards),
                       execution=dj.Execution(chunk_size=4))

  # A seed's own split (federated's non-iid shards): widest shards of 9 and of 12 examples, both padded to 16.
  narrow = [np.arange(16 * m, 16 * m + 9 - (m % 2)) for m in range(4)]
  wide = [np.arange(16 * m, 16 * m + 12 - (m % 3)) for m in range(4)]
  assert _simulate.shard_table(narrow, 64, 4, 4)[0].shape == _simulate.shard_table(wide, 64, 4, 4)[0].shape == (4, 16)
  first = _fresh(lambda: run(narrow))
  hits = engine.cache_info()["hits"]
  second = run(wide)
  assert engine.cache_info()["hits"] == hits + 1
  _assert_same(second, _fresh(lambda: run(wide)))
  assert not np.array_equal(first.history.loss, second.history.loss)
  # The padding is never drawn: a worker's shard padded to any width gives the same minibatches.
  shard = np.arange(30, 39, dtype=np.int32)
  draws = {width: [np.asarray(dj.runtime.minibatch_indices(3, u, 1, 2, num_examples=64, batch_size=8,
                                                           sampling="shard", shard=np.pad(shard, (0, width - 9)),
                                                           shard_size=9)) for u in range(6)]
           for width in (9, 16, 64)}
  for width in (16, 64):
    np.testing.assert_array_equal(draws[width], draws[9])
  assert set(np.concatenate(draws[9]).tolist()) <= set(shard.tolist())


def test_an_evaluation_of_the_parameters_alone_is_compiled_once_for_every_optimizer(problem):
  """The first evaluation of runs of different optimizers on one model is one compiled program (it does not take
  their states), and it gives exactly ``eval_fn`` of the initial parameters; one that reads the state is compiled
  for that state."""
  data, schedule, params = problem

  def run(tx, eval_fn, eval_state=False):
    return dj.simulate(_loss(jnp.ones(3)), tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                       record=dj.Record(eval_fn=eval_fn, every=10, eval_state=eval_state),
                       execution=dj.Execution(chunk_size=4))

  def evaluate(p):
    return {"norm": jnp.sum(p["w"] ** 2) + 1.5}

  def evaluations():
    return sum(key[0] == "eval" for key in engine._cache)

  engine.clear_cache()
  runs = [run(optax.sgd(0.05), evaluate), run(optax.sgd(0.05, momentum=0.9), evaluate)]
  assert evaluations() == 1 and len(engine._cache) == 3  # two chunks, one evaluation
  for result in runs:
    np.testing.assert_array_equal(np.asarray(result.history.eval_metrics["norm"])[0],
                                  np.asarray(jax.jit(evaluate)(params)["norm"]))
  run(optax.sgd(0.05, momentum=0.9), lambda p, s: evaluate(p), eval_state=True)
  assert evaluations() == 2
