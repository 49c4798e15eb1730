"""``dj.simulate_pipeline(seed=dj.Runs(...))``: several runs in one call, each equal to its single call bit for bit,
and against the sequential reference."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_reference import assert_trees_close, explicit_grad, mlp_problem, reference  # noqa: E402

OPTIONS = dict(sampling=dj.Sampling(batch_size=8), execution=dj.Execution(chunk_size=2))


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_runs_of_their_own_seeds_schedules_and_parameters_equal_their_single_calls():
  """Three runs: other seeds, another schedule (more micro-batches: another program), other initial weights and
  learning rates (``optax.inject_hyperparams``, set in every stage's state). Each equals its single call bit for
  bit, the first the sequential reference, and the callback is told each run's chunks apart."""
  stages, loss_fn, params, data = mlp_problem(3)
  U = 5
  one_f_one_b = dj.cluster.pipeline("1f1b", 3, U, num_microbatches=2)
  gpipe = dj.cluster.pipeline("gpipe", 3, U, num_microbatches=3)
  other = [jax.tree.map(lambda w: 0.5 * w, p) for p in params]
  seeds, sources, starts, rates = [4, 5, 4], [one_f_one_b, gpipe, one_f_one_b], [params, params, other], [0.3, 0.1, 0.2]
  told = []
  results = dj.simulate_pipeline(
      stages, loss_fn, optax.inject_hyperparams(optax.sgd)(learning_rate=0.3), params, data, None,
      seed=dj.Runs(seeds=seeds, sources=sources, params=starts, hyperparams={"learning_rate": rates}),
      record=dj.Record(eval_fn=lambda ps: {"norm": sum((x ** 2).sum() for x in jax.tree.leaves(ps))}, every=2,
                       callback=told.append), **OPTIONS)
  assert len(results) == 3
  for result, seed, source, start, rate in zip(results, seeds, sources, starts, rates, strict=True):
    alone = dj.simulate_pipeline(stages, loss_fn, optax.inject_hyperparams(optax.sgd)(learning_rate=rate), start,
                                 data, source, seed=seed,
                                 record=dj.Record(eval_fn=lambda ps: {"norm": sum((x ** 2).sum()
                                                                                  for x in jax.tree.leaves(ps))},
                                                  every=2), **OPTIONS)
    _equal((result.params, result.opt_states), (alone.params, alone.opt_states))
    np.testing.assert_array_equal(result.history.loss, alone.history.loss)
    np.testing.assert_array_equal(result.history.eval_metrics["norm"], alone.history.eval_metrics["norm"])
  want, losses, _ = reference(stages, loss_fn, optax.sgd(0.3), params, data, one_f_one_b, batch_size=8, seed=4,
                              grad=explicit_grad)
  assert_trees_close(results[0].params, want)
  np.testing.assert_allclose(results[0].history.loss, losses, rtol=2e-6)
  # Three chunks of two updates (of five) per run, each run's told apart.
  assert sorted((info["run"], info["chunk"]) for info in told) == [(r, c) for r in range(3) for c in range(3)]
  assert not np.array_equal(np.asarray(results[0].history.loss), np.asarray(results[2].history.loss))


def test_several_runs_refuse_what_they_cannot_do():
  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("gpipe", 2, 3)
  tx = optax.sgd(0.1)
  runs = dj.Runs(seeds=[0, 1])
  with pytest.raises(ValueError, match="on one device; got Execution.mesh"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, seed=runs, sampling=dj.Sampling(batch_size=8),
                         execution=dj.Execution(mesh=jax.make_mesh((2,), ("stages",))))
  with pytest.raises(ValueError, match="pass schedule=None, got PipelineSchedule"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, seed=dj.Runs(seeds=[0, 1], sources=[sched, sched]),
                         **OPTIONS)
  with pytest.raises(TypeError, match="Runs.sources\\[1\\] must be a dj.cluster.pipeline\\(...\\) schedule, got str"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, None, seed=dj.Runs(seeds=[0, 1], sources=[sched, "gpipe"]),
                         **OPTIONS)
  with pytest.raises(ValueError, match="Runs.sources\\[1\\] has 3 model stages, but Runs.sources\\[0\\] has 2"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, None,
                         seed=dj.Runs(seeds=[0, 1], sources=[sched, dj.cluster.pipeline("gpipe", 3, 3)]), **OPTIONS)
  with pytest.raises(ValueError, match="Runs.params\\[1\\] must have params' structure"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched,
                         seed=dj.Runs(seeds=[0, 1], params=[params, params[:1]]), **OPTIONS)
  with pytest.raises(ValueError, match="hyperparams names \\['learning_rate'\\], but tx's state holds"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched,
                         seed=dj.Runs(seeds=[0, 1], hyperparams={"learning_rate": [0.1, 0.2]}), **OPTIONS)


class _Stop(Exception):
  pass


def test_runs_checkpointed_each_on_its_own_resume_bit_for_bit(tmp_path):
  """Two runs of 3 and 5 updates in chunks of 2, interrupted in their third round (the shorter run done and saved):
  resumed, each continues from its own checkpoint and ends as the uninterrupted call, bit for bit."""
  stages, loss_fn, params, data = mlp_problem(2)
  sources = [dj.cluster.pipeline("1f1b", 2, updates, num_microbatches=2) for updates in (3, 5)]
  runs = dj.Runs(seeds=[0, 1], sources=sources)
  tx = optax.sgd(0.3, momentum=0.5)
  whole = dj.simulate_pipeline(stages, loss_fn, tx, params, data, None, seed=runs, **OPTIONS)

  def stop(info):
    if info["run"] == 1 and info["chunk"] == 2:
      raise _Stop

  with pytest.raises(_Stop):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, None, seed=runs, checkpoint=dj.Checkpoint(tmp_path),
                         record=dj.Record(callback=stop), **OPTIONS)
  told = []
  resumed = dj.simulate_pipeline(stages, loss_fn, tx, params, data, None, seed=runs,
                                 checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=told.append), **OPTIONS)
  for together, alone in zip(resumed, whole, strict=True):
    _equal((together.params, together.opt_states), (alone.params, alone.opt_states))
    np.testing.assert_array_equal(together.history.loss, alone.history.loss)
  # The shorter run (two chunks) had finished; the longer one's third chunk was computed again.
  assert [(info["run"], info["chunk"]) for info in told] == [(1, 2)]


def test_the_first_runs_program_compiles_while_the_others_are_prepared(monkeypatch):
  """The engine prepares run 0, makes its program and starts compiling its chunk before the other runs are
  prepared; the runs of the same program (the same schedule, other seeds) are computed by that executable, each
  equal to its single call bit for bit."""
  from delayjax.runtime import _engine, _pipeline

  stages, loss_fn, params, data = mlp_problem(3)
  schedule = dj.cluster.pipeline("1f1b", 3, 5, num_microbatches=2)
  calls = []
  prepare, program, ahead = _pipeline._prepare, _pipeline._program, _engine.compile_ahead

  def spied_ahead(*args):
    started = ahead(*args)
    calls.append("ahead")
    return started._replace(compiled=lambda: calls.append("waited") or started.compiled())

  monkeypatch.setattr(_pipeline, "_prepare", lambda *a, **k: calls.append("prepare") or prepare(*a, **k))
  monkeypatch.setattr(_pipeline, "_program", lambda *a: calls.append("program") or program(*a))
  monkeypatch.setattr(_engine, "compile_ahead", spied_ahead)
  results = dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.3), params, data, schedule, seed=dj.Runs(seeds=[1, 2]),
                                 **OPTIONS)
  assert calls == ["prepare", "program", "ahead", "prepare", "program", "waited", "waited"]
  monkeypatch.undo()
  for seed, result in zip((1, 2), results, strict=True):
    alone = dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.3), params, data, schedule, seed=seed, **OPTIONS)
    _equal((result.params, result.opt_states), (alone.params, alone.opt_states))
    np.testing.assert_array_equal(result.history.loss, alone.history.loss)
