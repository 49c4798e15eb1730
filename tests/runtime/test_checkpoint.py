"""Checkpoints know their run and their content: another run's or a damaged one is a clear error."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import regression_problem


class Stop(Exception):
  pass


def _stop_after(chunks):
  def callback(info):
    if info["chunk"] + 1 == chunks:
      raise Stop

  return callback


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """A run stopped after 2 of its 5 chunks, its checkpoint left behind, and the same run uninterrupted."""
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=40, seed=0)
  kw = dict(batch_size=8, chunk_size=2, seed=1)
  directory = tmp_path_factory.mktemp("run")
  with pytest.raises(Stop):
    dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint_dir=directory, callback=_stop_after(2),
                **kw)
  full = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, **kw)
  return directory, (loss_fn, params, data, schedule), kw, full


def _copy(directory, tmp_path):
  for name in os.listdir(directory):
    (tmp_path / name).write_bytes((directory / name).read_bytes())
  return tmp_path


def _wrong_loss(params, batch):
  return jnp.mean(jnp.abs(batch["x"] @ params["w"] + params["b"] - batch["y"]))


@pytest.mark.parametrize("change, component", [
    (lambda a: {**a, "tx": optax.sgd(0.5)}, "tx"),
    (lambda a: {**a, "loss_fn": _wrong_loss}, "loss_fn"),
    (lambda a: {**a, "params": {"w": a["params"]["w"] + 1, "b": a["params"]["b"]}}, "initial params"),
    (lambda a: {**a, "params": {"w": a["params"]["w"], "b": a["params"]["b"][None]}}, "params (structure"),
    (lambda a: {**a, "data": {"x": a["data"]["x"] * 2, "y": a["data"]["y"]}}, "data"),
], ids=["learning_rate", "loss", "initial_params", "shape", "data"])
def test_resuming_another_run_names_what_differs(interrupted, change, component):
  directory, (loss_fn, params, data, schedule), kw, _ = interrupted
  args = change({"loss_fn": loss_fn, "tx": optax.sgd(0.05), "params": params, "data": data})
  with pytest.raises(ValueError, match=f"of a different run: .*{component.split(' (')[0]}"):
    dj.simulate(args["loss_fn"], args["tx"], args["params"], args["data"], schedule, checkpoint_dir=directory, **kw)


def test_resume_is_bit_identical_and_ignores_a_chunk_appended_before_a_crash(interrupted, tmp_path):
  directory, (loss_fn, params, data, schedule), kw, full = interrupted
  copy = _copy(directory, tmp_path)
  with open(copy / "simulate.msgpack.records", "ab") as f:
    f.write(b"a chunk whose checkpoint was never written")
  resumed = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint_dir=copy, **kw)
  np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(full.params["w"]))
  np.testing.assert_array_equal(resumed.history.loss, full.history.loss)


def test_history_is_appended_not_rewritten(interrupted, tmp_path):
  # The state file does not grow with the run; the history file grows by a chunk's rows per save.
  directory, (loss_fn, params, data, schedule), kw, _ = interrupted
  copy = _copy(directory, tmp_path)
  sizes = []
  dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint_dir=copy,
              callback=lambda info: sizes.append((os.path.getsize(copy / "simulate.msgpack"),
                                                  os.path.getsize(copy / "simulate.msgpack.records"))), **kw)
  state, history = np.array(sizes).T
  assert len(set(state)) == 1
  # Each save adds one chunk's rows (chunks differ only in how many updates they apply), not the run so far.
  grew = np.diff(history)
  assert np.all(grew > 0) and grew.max() < 1.5 * grew.min()


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate_history"])
def test_a_damaged_checkpoint_names_its_file(interrupted, tmp_path, damage):
  directory, (loss_fn, params, data, schedule), kw, _ = interrupted
  copy = _copy(directory, tmp_path)
  name = "simulate.msgpack.records" if damage == "truncate_history" else "simulate.msgpack"
  raw = bytearray((copy / name).read_bytes())
  if damage == "flip":
    raw[len(raw) // 2] ^= 1
  else:
    raw = raw[:len(raw) - 7]
  (copy / name).write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=f"checkpoint file .*{name} is damaged or truncated"):
    dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint_dir=copy, **kw)
