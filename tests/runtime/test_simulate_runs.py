"""Several ``dj.simulate`` runs (seeds, hyper-parameters) computed as one program equal the separate calls."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

BATCH = 4


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=40, seed=2)
  return data, schedule, {"w": jnp.zeros(3, jnp.float32)}


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _run(problem, tx, seed=0):
  data, schedule, params = problem
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the diverging run's non-finite report
    return dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                       execution=dj.Execution(chunk_size=4),
                       record=dj.Record(eval_fn=lambda p: {"norm": jnp.sum(p["w"] ** 2)}, every=10), seed=seed)


def _assert_same(batched, single):
  """To float32 rounding: the run axis batches the gradients' matrix products, which XLA may sum in another
  order (a few ulps after 40 updates here); integers (the non-finite lists, counts) exactly."""
  for x, y in zip(jax.tree.leaves((batched.params, batched.opt_state, batched.history)),
                  jax.tree.leaves((single.params, single.opt_state, single.history)), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(x, y)


def test_seeds_in_one_program_equal_the_separate_calls(problem):
  seeds = [0, 3, 5]
  runs = _run(problem, optax.sgd(0.05), seed=dj.Runs(seeds=seeds))
  assert len(runs) == 3
  for seed, batched in zip(seeds, runs):
    _assert_same(batched, _run(problem, optax.sgd(0.05), seed=seed))
  assert not np.array_equal(runs[0].history.loss, runs[1].history.loss)


def test_hyper_parameters_in_one_program_equal_the_separate_calls(problem):
  sgd = optax.inject_hyperparams(optax.sgd)
  # A NaN rate makes every later gradient of its run NaN: they are reported for that run only.
  rates, seeds = [0.01, 0.05, np.nan], [1, 1, 2]
  runs = _run(problem, sgd(learning_rate=0.1), seed=dj.Runs(seeds=seeds, hyperparams={"learning_rate": rates}))
  for rate, seed, batched in zip(rates, seeds, runs):
    _assert_same(batched, _run(problem, sgd(learning_rate=rate), seed=seed))
  assert runs[2].history.nonfinite.shape[0] > 0 and runs[0].history.nonfinite.shape[0] == 0


def test_initial_parameters_of_their_own_in_one_program_equal_the_separate_calls(problem):
  data, schedule, params = problem
  starts = [{"w": jnp.asarray(w, jnp.float32)} for w in ([0.0, 0.0, 0.0], [1.0, -1.0, 2.0])]
  runs = _run((data, schedule, starts[0]), optax.sgd(0.05), seed=dj.Runs(seeds=[0, 0], params=starts))
  for start, batched in zip(starts, runs):
    _assert_same(batched, _run((data, schedule, start), optax.sgd(0.05), seed=0))
  assert not np.allclose(runs[0].params["w"], runs[1].params["w"])


# Runs are checked when they are made: each case builds its seed inside pytest.raises.
@pytest.mark.parametrize("make, error, match", [
    (lambda: dj.Runs(hyperparams={"momentum": [0.1, 0.2]}), ValueError,
     r"hyperparams names \['momentum'\].*learning_rate"),
    (lambda: dj.Runs(seeds=[0, 1], hyperparams={"learning_rate": [0.1, 0.2, 0.3]}), ValueError, r"lengths"),
    (lambda: dj.Runs(hyperparams={"learning_rate": 0.1}), ValueError, r"one value per run"),
    (lambda: dj.Runs(seeds=[0, 2**32]), ValueError, r"Runs.seeds\[1\] must be an integer below 2\*\*32"),
    (lambda: dj.Runs(hyperparams=[0.1]), TypeError, r"Runs.hyperparams must be a dict"),
    # A list of seeds is no longer taken as several runs: it names dj.Runs.
    (lambda: [0, 1], TypeError, r"seed must be an int; for several runs in one program pass seed=dj.Runs"),
])
def test_bad_runs_are_refused(problem, make, error, match):
  data, schedule, params = problem
  with pytest.raises(error, match=match):
    dj.simulate(loss_fn, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), params, data, schedule,
                seed=make())


def test_runs_with_a_delay_model_need_one_schedule(problem):
  data, _, params = problem
  with pytest.raises(ValueError, match="pass a Schedule"):
    dj.simulate(loss_fn, optax.sgd(0.1), params, data, dj.delays.uniform(3), num_updates=10,
                seed=dj.Runs(seeds=[0, 1]))


def test_an_evaluation_without_every_is_made_at_the_start_and_the_end(problem):
  data, schedule, params = problem
  result = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                       record=dj.Record(eval_fn=lambda p: {"norm": jnp.sum(p["w"] ** 2)}))
  np.testing.assert_array_equal(result.history.eval_update, [0, schedule.num_updates])
  np.testing.assert_array_equal(result.history.eval_metrics["norm"],
                                [0.0, np.asarray(jnp.sum(result.params["w"] ** 2))])


class _Stop(Exception):
  pass


def test_runs_in_one_program_resume_from_their_checkpoint_bit_for_bit(problem, tmp_path):
  """Three seeds with their own learning rates in one program, interrupted after a chunk and resumed: each equals the
  uninterrupted call bit for bit, only the unsaved chunks are computed again, and other seeds are another run."""
  data, schedule, params = problem
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  runs = dj.Runs(seeds=[0, 1, 2], hyperparams={"learning_rate": [0.1, 0.05, 0.2]})

  def call(callback=None, seed=runs):
    return dj.simulate(loss_fn, tx, params, data, schedule, seed=seed, sampling=dj.Sampling(batch_size=BATCH),
                       execution=dj.Execution(chunk_size=4), checkpoint=dj.Checkpoint(tmp_path),
                       record=dj.Record(eval_fn=lambda p: {"norm": jnp.sum(p["w"] ** 2)}, every=10,
                                        callback=callback))

  whole = dj.simulate(loss_fn, tx, params, data, schedule, seed=runs, sampling=dj.Sampling(batch_size=BATCH),
                      execution=dj.Execution(chunk_size=4),
                      record=dj.Record(eval_fn=lambda p: {"norm": jnp.sum(p["w"] ** 2)}, every=10))

  def stop(info):
    if info["chunk"] == 1:
      raise _Stop

  with pytest.raises(_Stop):
    call(stop)
  told = []
  resumed = call(told.append)
  for together, alone in zip(resumed, whole, strict=True):
    for a, b in zip(jax.tree.leaves((together.params, together.opt_state, together.history)),
                    jax.tree.leaves((alone.params, alone.opt_state, alone.history)), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Chunks 0 and 1 were saved before the callback that stopped the run.
  assert [info["chunk"] for info in told] == list(range(2, told[-1]["num_chunks"]))
  with pytest.raises(ValueError, match="different run: .*options"):
    call(seed=dj.Runs(seeds=[0, 1, 3], hyperparams={"learning_rate": [0.1, 0.05, 0.2]}))
  with pytest.raises(ValueError, match="different run: .*options"):
    call(seed=dj.Runs(seeds=[0, 1, 2], hyperparams={"learning_rate": [0.1, 0.05, 0.3]}))
