"""``history="evaluations"``: no per-update rows on the host or in checkpoints, everything else bit for bit."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import delayjax as dj
from delayjax.runtime import _checkpoint
from delayjax.runtime import _engine
from tests.runtime.simulate_reference import regression_problem

PER_UPDATE = ("update", "time", "loss", "staleness")
UPDATES, CHUNK, EVAL_EVERY = 40, 4, 7


class Stop(Exception):
  pass


def _stop_after(chunks):
  def callback(info):
    if info["chunk"] + 1 == chunks:
      raise Stop

  return callback


@pytest.fixture(scope="module")
def problem():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=UPDATES, seed=0)

  def eval_fn(p):
    return {"loss": loss_fn(p, data), "w": p["w"]}

  kw = dict(sampling=dj.Sampling(batch_size=8), execution=dj.Execution(chunk_size=CHUNK), seed=1)
  return (loss_fn, params, data, schedule, eval_fn), kw


@pytest.fixture(scope="module")
def straight(problem):
  """Uninterrupted runs with each setting: ``(updates, evaluations, whether the second reused the first's
  compiled chunk)``."""
  kept = _run(problem)
  hits = _engine.cache_info()["hits"]
  bare = _run(problem, "evaluations")
  return kept, bare, _engine.cache_info()["hits"] > hits


def _run(problem, history="updates", callback=None, **extra):
  (loss_fn, params, data, schedule, eval_fn), kw = problem
  record = dj.Record(eval_fn=eval_fn, every=EVAL_EVERY, history=history, callback=callback)
  return dj.simulate(loss_fn, optax.sgd(0.05, momentum=0.9), params, data, schedule, record=record, **kw, **extra)


def _assert_same_except_per_update(kept, bare):
  """``bare`` (history="evaluations") equals ``kept`` (history="updates") bit for bit, per-update rows aside."""
  for a, b in zip(jax.tree.leaves((kept.params, kept.opt_state)), jax.tree.leaves((bare.params, bare.opt_state)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name in kept.history._fields:
    if name in PER_UPDATE:
      continue
    a, b = getattr(kept.history, name), getattr(bare.history, name)
    assert jax.tree.structure(a) == jax.tree.structure(b), name
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      assert np.asarray(x).dtype == np.asarray(y).dtype, name
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  for name in PER_UPDATE:
    full, empty = getattr(kept.history, name), getattr(bare.history, name)
    assert empty.shape == (0,) and empty.dtype == full.dtype, (name, empty.shape, empty.dtype, full.dtype)


def test_evaluations_keeps_everything_but_the_per_update_rows_and_shares_the_program(problem, straight):
  kept, bare, shared = straight
  # The same compiled chunk serves both settings (only what the host keeps differs).
  assert shared
  assert len(kept.history.loss) == UPDATES and kept.history.loss.dtype == np.float32
  _assert_same_except_per_update(kept, bare)
  (loss_fn, _, data, _, _), _ = problem
  # The last evaluation is eval_fn at the final parameters, computed independently here.
  assert bare.history.eval_update.tolist() == [0, 7, 14, 21, 28, 35, 40]
  np.testing.assert_allclose(bare.history.eval_metrics["loss"][-1], loss_fn(bare.params, data), rtol=1e-6)


def _nonfinite_run(value, tx, history, nonfinite="report"):
  # One example's gradient is `value` (the other examples' 1): a NaN or a float32-overflowing gradient.
  c = np.ones(8, np.float32)
  c[3] = value
  return dj.simulate(lambda w, batch: jnp.mean(batch["c"]) * jnp.sum(w), tx, jnp.zeros(2), {"c": c},
                     dj.delays.constant(1), num_updates=UPDATES, sampling=dj.Sampling(batch_size=1), seed=1,
                     execution=dj.Execution(chunk_size=8),
                     record=dj.Record(eval_fn=lambda w: jnp.sum(w), every=10, history=history, nonfinite=nonfinite))


@pytest.mark.standard_promotion
@pytest.mark.parametrize("value, tx, kw, reported", [
    (np.nan, optax.sgd(0.1), {}, "nonfinite"),
    (1e25, optax.adam(0.1), {"nonfinite": "skip"}, "skipped"),
], ids=["nan_gradient", "skipped_update"])
def test_nonfinite_reports_are_the_same_with_evaluations(value, tx, kw, reported):
  with pytest.warns(RuntimeWarning, match="dj.simulate"):
    kept = _nonfinite_run(value, tx, "updates", **kw)
  with pytest.warns(RuntimeWarning, match="dj.simulate"):
    bare = _nonfinite_run(value, tx, "evaluations", **kw)
  assert len(getattr(kept.history, reported)) > 0  # the comparison below covers a non-empty report
  _assert_same_except_per_update(kept, bare)


def _frames(path):
  """Every chunk's records as stored in a checkpoint's history file (see ``_checkpoint``)."""
  data, at, frames = open(path, "rb").read(), 0, []
  while at < len(data):
    length, _ = _checkpoint._FRAME.unpack_from(data, at)
    start = at + _checkpoint._FRAME.size
    frames.append(serialization.msgpack_restore(data[start:start + length]))
    at = start + length
  return frames


def test_checkpoint_resume_with_evaluations_is_bit_identical_and_stores_no_update_rows(problem, straight, tmp_path):
  straight = straight[1]
  with pytest.raises(Stop):
    _run(problem, "evaluations", checkpoint=dj.Checkpoint(tmp_path), callback=_stop_after(2))
  chunks = []
  resumed = _run(problem, "evaluations", checkpoint=dj.Checkpoint(tmp_path),
                 callback=lambda info: chunks.append(info["chunk"]))
  assert chunks[0] == 2  # continued from the checkpoint
  _assert_same_except_per_update(straight, resumed)
  frames = _frames(tmp_path / "simulate.records")
  # Stored per chunk: its health check (one flag), its non-finite gradients (none here) and its evaluations
  # (the one at version 0 is a frame of its own); nothing per update.
  assert all("loss" not in frame for frame in frames)
  stored = sum(np.size(leaf) for frame in frames for leaf in jax.tree.leaves(frame))
  evals = len(straight.history.eval_update)
  per_eval = sum(np.size(x) for x in jax.tree.leaves(straight.history.eval_metrics)) // evals
  assert stored == resumed.stats["num_chunks"] + evals * per_eval


def test_a_checkpoint_of_updates_resumes_with_evaluations_and_not_the_reverse(problem, straight, tmp_path):
  kept_dir, bare_dir = tmp_path / "kept", tmp_path / "bare"
  for directory, history in ((kept_dir, "updates"), (bare_dir, "evaluations")):
    with pytest.raises(Stop):
      _run(problem, history, checkpoint=dj.Checkpoint(directory), callback=_stop_after(2))
  # The "updates" checkpoint stores every update's loss so far (so the resume below leaves them unread).
  assert sum(len(frame["loss"]["0"]) for frame in _frames(kept_dir / "simulate.records") if "loss" in frame) > 0
  shutil.copytree(bare_dir, tmp_path / "bare_copy")
  with pytest.raises(ValueError, match=r"does not keep \['loss'\].*history='evaluations'.*dj.Checkpoint\(\.\.\., resume=False\)"):
    _run(problem, checkpoint=dj.Checkpoint(bare_dir))
  # Allowing any change of the run's identity does not make the missing rows appear.
  with pytest.raises(ValueError, match=r"does not keep \['loss'\]"):
    _run(problem, checkpoint=dj.Checkpoint(tmp_path / "bare_copy", changes=("options",)))
  chunks = []
  resumed = _run(problem, "evaluations", checkpoint=dj.Checkpoint(kept_dir),
                 callback=lambda info: chunks.append(info["chunk"]))
  assert chunks[0] == 2  # continued from the checkpoint
  _assert_same_except_per_update(straight[0], resumed)


@pytest.mark.parametrize("value", ["update", "Evaluations", None, 1])
def test_a_bad_history_names_the_argument_and_the_choices(problem, value):
  with pytest.raises(ValueError, match=f"Record.history must be one of 'updates', 'evaluations'; got {value!r}"):
    _run(problem, value)


def _assert_rows_empty_and_rest_equal(kept, bare, per_row):
  """The same for a gossip or pipeline history: ``per_row`` fields empty (their dtypes and trailing shape)."""
  state = [name for name in kept._fields if name not in ("history", "stats")]
  for a, b in zip(jax.tree.leaves([getattr(kept, n) for n in state]), jax.tree.leaves([getattr(bare, n) for n in state]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name in kept.history._fields:
    a, b = getattr(kept.history, name), getattr(bare.history, name)
    if name in per_row:
      assert len(a) > 0 and b.shape == (0,) + a.shape[1:] and b.dtype == a.dtype, (name, b.shape, b.dtype)
    else:
      jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_simulate_gossip_with_evaluations(problem):
  (loss_fn, _, data, _, _), _ = problem
  params = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  schedule = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4),
                                        num_steps=30, seed=0)

  def run(history="updates"):
    return dj.simulate_gossip(loss_fn, optax.sgd(0.05), dj.gossip.d_psgd(), params, data, schedule,
                              sampling=dj.Sampling(batch_size=8), execution=dj.Execution(chunk_size=8),
                              record=dj.Record(eval_fn=lambda p: loss_fn(p, data), every=20, history=history))

  kept, bare = run(), run("evaluations")
  assert len(kept.history.eval_gradients) > 2
  _assert_rows_empty_and_rest_equal(
      kept, bare, ("events", "gradients", "time", "loss", "loss_spread", "consensus"))


@pytest.mark.slow
def test_simulate_pipeline_with_evaluations(tmp_path):
  from tests.pipeline.pipeline_reference import mlp_problem

  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("1f1b", 2, 8, num_microbatches=2)

  eval_fn = lambda ps: {"w0": ps[0]["w"]}

  def run(history="updates", callback=None, **kw):
    return dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.3), params, data, sched,
                                sampling=dj.Sampling(batch_size=8), seed=1, execution=dj.Execution(chunk_size=4),
                                record=dj.Record(eval_fn=eval_fn, every=3, history=history, callback=callback), **kw)

  def stop_after_one(info):
    if info["updates_done"] == 4:
      raise Stop

  kept = run()
  with pytest.raises(Stop):
    run("evaluations", checkpoint=dj.Checkpoint(tmp_path), callback=stop_after_one)
  with pytest.raises(ValueError, match=r"does not keep \['loss'\]"):
    run(checkpoint=dj.Checkpoint(tmp_path))
  done = []
  bare = run("evaluations", checkpoint=dj.Checkpoint(tmp_path), callback=lambda info: done.append(info["updates_done"]))
  assert done == [8]  # continued from the checkpoint
  _assert_rows_empty_and_rest_equal(
      kept, bare, ("update", "time", "loss", "forward_staleness", "backward_staleness"))
