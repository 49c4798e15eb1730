"""``dj.Checkpoint(min_interval=...)``: fewer writes, the same results, a resume from the last write.

The engine reads its wall clock from ``_engine.clock``; here a clock that
the run's own callback advances by one second a chunk drives it, so which
chunks write is decided by the chunk count alone (no sleeps, no timing).
The writes are counted by wrapping ``_checkpoint.Checkpoint.save``. The
references: the same run with no checkpoint (bit for bit), and the rule
itself, replayed in plain Python over the chunks.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _checkpoint, _engine
from tests.pipeline.pipeline_reference import mlp_problem
from tests.runtime.simulate_reference import regression_problem

INTERVAL = 2.5  # seconds, i.e. chunks of the clock below


class Stop(Exception):
  pass


class ChunkClock:
  """A wall clock that reads ``k`` once ``k`` chunks' callbacks have run: chunk ``c`` ends at time ``c`` + start."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now

  def tick(self, info):
    self.now += 1.0


@pytest.fixture
def saves(monkeypatch):
  """Every write, as ``(chunks_done, number of chunks' rows it appends)``."""
  done = []
  save = _checkpoint.Checkpoint.save

  def counting(self, carry, new_rows, chunks_done):
    done.append((chunks_done, len(new_rows)))
    return save(self, carry, new_rows, chunks_done)

  monkeypatch.setattr(_checkpoint.Checkpoint, "save", counting)
  return done


@pytest.fixture
def clock(monkeypatch):
  clock = ChunkClock()
  monkeypatch.setattr(_engine, "clock", clock)
  return clock


def _problem():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=40, seed=0)
  evaluate = lambda p: {"norm": jnp.sum(p["w"] ** 2)}
  kw = dict(sampling=dj.Sampling(batch_size=8), execution=dj.Execution(chunk_size=2), seed=1)
  return (loss_fn, optax.sgd(0.05, momentum=0.9), params, data, schedule), evaluate, kw


def _run(callback=None, checkpoint=None):
  args, evaluate, kw = _problem()
  return dj.simulate(*args, record=dj.Record(eval_fn=evaluate, every=7, callback=callback), checkpoint=checkpoint,
                     **kw)


def _writes(first_chunk, num_chunks, interval):
  """The chunks done at each write under the rule "a chunk's end writes once ``interval`` has passed since the
  run's start or its last write", with chunk ``c`` ending at time ``c - first_chunk`` (the clock above)."""
  last, out = 0.0, []
  for chunk in range(first_chunk, num_chunks):
    if chunk - first_chunk - last >= interval:
      out.append(chunk + 1)
      last = chunk - first_chunk
  return out


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state, a.history)),
                  jax.tree.leaves((b.params, b.opt_state, b.history)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _steps(directory):
  folder = directory / "simulate"
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if folder.exists() else []


def test_zero_writes_after_every_chunk(saves, clock, tmp_path):
  result = _run(clock.tick, dj.Checkpoint(tmp_path, min_interval=0.0))
  num_chunks = result.stats["num_chunks"]
  assert num_chunks >= 8
  assert [c for c, _ in saves] == list(range(1, num_chunks + 1))
  # Each write appends its own chunk's rows (the first also the evaluation before the first update).
  assert [n for _, n in saves] == [2] + [1] * (num_chunks - 1)
  assert dj.Checkpoint(tmp_path).min_interval == 0.0  # the default: today's behaviour


def test_a_long_interval_writes_nothing_and_changes_nothing(saves, clock, tmp_path):
  spaced = _run(clock.tick, dj.Checkpoint(tmp_path, min_interval=1e6))
  assert clock.now == spaced.stats["num_chunks"]  # the clock did run
  assert saves == [] and _steps(tmp_path) == []
  _assert_equal(spaced, _run())


def test_an_interrupted_run_resumes_from_its_last_write(saves, clock, tmp_path):
  whole = _run()
  num_chunks = whole.stats["num_chunks"]
  expected = _writes(0, num_chunks, INTERVAL)
  assert 2 <= len(expected) < num_chunks - 1  # spaced writes, more than one
  # Stopped two chunks after its first write: those two chunks are not in the checkpoint.
  stop = expected[0] + 1

  def stop_after(info):
    clock.tick(info)
    if info["chunk"] == stop:
      raise Stop

  with pytest.raises(Stop):
    _run(stop_after, dj.Checkpoint(tmp_path, min_interval=INTERVAL))
  assert [c for c, _ in saves] == [c for c in expected if c <= stop + 1] == [expected[0]]
  # That write appended the rows of every chunk before it at once (and the initial evaluation's).
  assert saves[0][1] == expected[0] + 1
  assert _steps(tmp_path) == [expected[0]]

  saves.clear()
  clock.now = 0.0
  seen = []

  def follow(info):
    clock.tick(info)
    seen.append(info["chunk"])

  resumed = _run(follow, dj.Checkpoint(tmp_path, min_interval=INTERVAL))
  assert seen[0] == expected[0]  # it continued from the last write
  assert [c for c, _ in saves] == _writes(expected[0], num_chunks, INTERVAL)
  _assert_equal(resumed, whole)


def test_the_gossip_and_pipeline_runtimes_space_their_writes(saves, clock, tmp_path):
  data, loss_fn, params = regression_problem()
  sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                     num_steps=12, seed=0)
  stages, stage_loss, stage_params, stage_data = mlp_problem(2)
  pipe = dj.cluster.pipeline("1f1b", 2, 12, weights="latest")
  runs = {
      "gossip": lambda checkpoint: dj.simulate_gossip(
          loss_fn, optax.sgd(0.05), dj.gossip.d_psgd(), params, data, sched, sampling=dj.Sampling(batch_size=4),
          record=dj.Record(callback=clock.tick), checkpoint=checkpoint, execution=dj.Execution(chunk_size=3)),
      "pipeline": lambda checkpoint: dj.simulate_pipeline(
          stages, stage_loss, optax.sgd(0.1), stage_params, stage_data, pipe, sampling=dj.Sampling(batch_size=8),
          record=dj.Record(callback=clock.tick), checkpoint=checkpoint, execution=dj.Execution(chunk_size=3)),
  }
  for name, run in runs.items():
    for interval in (0.0, INTERVAL, 1e6):
      saves.clear()
      clock.now = 0.0
      run(dj.Checkpoint(tmp_path / name / str(interval), min_interval=interval))
      num_chunks = int(clock.now)  # the callback runs once a chunk
      assert num_chunks >= 4, name
      assert [c for c, _ in saves] == _writes(0, num_chunks, interval), (name, interval)


@pytest.mark.parametrize("value, error, message", [
    (-1.0, ValueError, r"Checkpoint.min_interval must be >= 0.0, got -1.0"),
    (float("nan"), ValueError, r"Checkpoint.min_interval must be finite, got nan"),
    (float("inf"), ValueError, r"Checkpoint.min_interval must be finite, got inf"),
    ("10", TypeError, r"Checkpoint.min_interval must be a real number, got '10' of type str"),
    (True, TypeError, r"Checkpoint.min_interval must be a real number, got True of type bool"),
    (None, TypeError, r"Checkpoint.min_interval must be a real number, got None"),
])
def test_bad_intervals_are_refused(value, error, message, tmp_path):
  with pytest.raises(error, match=message):
    dj.Checkpoint(tmp_path, min_interval=value)


def test_an_interval_is_refused_with_a_mesh_across_processes(monkeypatch, tmp_path):
  """Every process must write at the same chunk; their clocks could disagree, so the run is refused."""
  args, _, kw = _problem()
  mesh = jax.make_mesh((1,), ("workers",), devices=jax.devices()[:1])
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"Checkpoint.min_interval must be 0 with a mesh in a multi-process run "
                                       r"\(2 processes\), got 10.0"):
    dj.simulate(*args, checkpoint=dj.Checkpoint(tmp_path, min_interval=10.0),
                **{**kw, "execution": dj.Execution(mesh=mesh, chunk_size=4)})
  assert not os.path.exists(tmp_path / "simulate")
