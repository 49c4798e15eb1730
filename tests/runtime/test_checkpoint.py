"""Checkpoints know their run and their content: another run's or a damaged one is a clear error."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import regression_problem


class Stop(Exception):
  pass


def _stop_after(chunks, seen=None):
  def callback(info):
    if seen is not None:
      seen.append(info)
    if info["chunk"] + 1 == chunks:
      raise Stop

  return callback


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """A run stopped after 2 of its 5 chunks, its checkpoint left behind, and the same run uninterrupted."""
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=40, seed=0)
  kw = dict(sampling=dj.Sampling(batch_size=8), execution=dj.Execution(chunk_size=2), seed=1)
  directory = tmp_path_factory.mktemp("run")
  seen = []
  with pytest.raises(Stop):
    dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint(directory),
                record=dj.Record(callback=_stop_after(2, seen)), **kw)
  full = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, **kw)
  full.stats["updates_checkpointed"] = seen[-1]["updates_done"]
  return directory, (loss_fn, params, data, schedule), kw, full


def _copy(directory, tmp_path):
  shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
  return tmp_path


def _state_size(folder):
  """The bytes of the latest committed Orbax step in ``folder`` (an older one may await its deletion)."""
  latest = max((name for name in os.listdir(folder) if name.isdigit()), key=int)
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder / latest) for f in files)


def _largest_shard_file(copy):
  """The biggest file of the database Orbax reads the arrays from (the step's ``state/d``)."""
  folder = copy / "simulate" / "2" / "state" / "d"
  return max((folder / name for name in os.listdir(folder)), key=os.path.getsize)


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
    dj.simulate(args["loss_fn"], args["tx"], args["params"], args["data"], schedule,
                checkpoint=dj.Checkpoint(directory), **kw)


def test_resume_is_bit_identical_and_ignores_a_chunk_appended_before_a_crash(interrupted, tmp_path):
  directory, (loss_fn, params, data, schedule), kw, full = interrupted
  copy = _copy(directory, tmp_path)
  with open(copy / "simulate.records", "ab") as f:
    f.write(b"a chunk whose checkpoint was never written")
  resumed = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint(copy), **kw)
  np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(full.params["w"]))
  np.testing.assert_array_equal(resumed.history.loss, full.history.loss)


def test_a_relative_checkpoint_dir_resumes_too(interrupted, tmp_path, monkeypatch):
  """Orbax takes absolute paths only: a relative checkpoint_dir (as notebooks give) is the working directory's."""
  directory, (loss_fn, params, data, schedule), kw, full = interrupted
  _copy(directory, tmp_path / "relative")
  monkeypatch.chdir(tmp_path)
  resumed = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint("relative"),
                        **kw)
  np.testing.assert_array_equal(resumed.history.loss, full.history.loss)
  assert max(int(n) for n in os.listdir(tmp_path / "relative" / "simulate") if n.isdigit()) > 2  # saved there


def test_history_is_appended_not_rewritten(interrupted, tmp_path):
  # The state does not grow with the run; the history file grows by a chunk's rows per save.
  directory, (loss_fn, params, data, schedule), kw, _ = interrupted
  copy = _copy(directory, tmp_path)
  sizes = []
  dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint(copy),
              record=dj.Record(callback=lambda info: sizes.append((_state_size(copy / "simulate"),
                                                                   os.path.getsize(copy / "simulate.records")))),
              **kw)
  state, history = np.array(sizes).T
  # One Orbax step is kept, of the carry's size, not the run's: a state that held the run so far would grow
  # in proportion to the chunks done (3 to 10 of 10 here). Its compressed chunks and Orbax's own files vary from
  # save to save, one save by up to about 50% under load (12,501 bytes against 8,268 in a full suite on 2
  # cores): the medians of the later and the earlier saves are compared, which such a save does not move.
  half = len(state) // 2
  assert np.median(state[half:]) < 1.2 * np.median(state[:half])
  # Each save adds one chunk's rows (chunks differ only in how many updates they apply), not the run so far.
  grew = np.diff(history)
  assert np.all(grew > 0) and grew.max() < 1.5 * grew.min()


# Orbax leaves an asyncio task behind when a read fails; the error raised is what this test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["flip", "truncate", "flip_meta", "truncate_history"])
def test_a_damaged_checkpoint_names_its_file(interrupted, tmp_path, damage):
  directory, (loss_fn, params, data, schedule), kw, _ = interrupted
  copy = _copy(directory, tmp_path)
  if damage == "truncate_history":
    path, named = copy / "simulate.records", "simulate.records"
  elif damage == "flip_meta":
    path, named = copy / "simulate" / "2" / "meta" / "metadata", "simulate/2/meta"
  else:
    path, named = _largest_shard_file(copy), "simulate/2/state"
  raw = bytearray(open(path, "rb").read())
  if damage.startswith("flip"):
    raw[len(raw) // 2] ^= 1
  else:
    raw = raw[:len(raw) - 7]
  with open(path, "wb") as f:
    f.write(bytes(raw))
  with pytest.raises(ValueError, match=f"checkpoint .*{named} is damaged or truncated"):
    dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint(copy), **kw)


def test_a_checkpoint_of_the_earlier_format_says_the_format_changed(interrupted, tmp_path):
  _, (loss_fn, params, data, schedule), kw, _ = interrupted
  (tmp_path / "simulate.msgpack").write_bytes(b"delayjax checkpoint 2\n" + bytes(40))
  with pytest.raises(ValueError, match="earlier format .*simulate.msgpack.*no longer reads"):
    dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, checkpoint=dj.Checkpoint(tmp_path), **kw)


def test_resume_changes_continues_knowingly_with_a_new_learning_rate(interrupted, tmp_path):
  # Restarted with lr 0.5 after the checkpoint at update k: the same as one run whose learning rate
  # steps from 0.05 to 0.5 at update k (a schedule of optax's update count).
  directory, (loss_fn, params, data, schedule), kw, full = interrupted
  k = full.stats["updates_checkpointed"]
  copy = _copy(directory, tmp_path)
  with pytest.raises(ValueError, match=r"of a different run: tx differ.*dj.Checkpoint\(\.\.\., changes=\('tx',\)\)"):
    dj.simulate(loss_fn, optax.sgd(0.5), params, data, schedule, checkpoint=dj.Checkpoint(copy), **kw)
  with pytest.raises(ValueError, match="of a different run: loss_fn differ"):
    dj.simulate(_wrong_loss, optax.sgd(0.5), params, data, schedule,
                checkpoint=dj.Checkpoint(copy, changes=("tx",)), **kw)
  resumed = dj.simulate(loss_fn, optax.sgd(0.5), params, data, schedule,
                        checkpoint=dj.Checkpoint(copy, changes=("tx",)), **kw)
  stepped = dj.simulate(loss_fn, optax.sgd(lambda count: jnp.where(count < k, jnp.float32(0.05), jnp.float32(0.5))),
                        params, data, schedule, **kw)
  assert 0 < k < 40
  np.testing.assert_allclose(np.asarray(resumed.params["w"]), np.asarray(stepped.params["w"]), rtol=1e-5)
  np.testing.assert_allclose(resumed.history.loss, stepped.history.loss, rtol=1e-5)
  assert not np.allclose(np.asarray(resumed.params["w"]), np.asarray(full.params["w"]))
  # The checkpoint now records the new identity: resuming the new run needs no override.
  again = dj.simulate(loss_fn, optax.sgd(0.5), params, data, schedule, checkpoint=dj.Checkpoint(copy), **kw)
  np.testing.assert_array_equal(np.asarray(again.params["w"]), np.asarray(resumed.params["w"]))


def test_resume_changes_names_only_components_of_the_run(interrupted, tmp_path):
  _, (loss_fn, params, data, schedule), kw, _ = interrupted
  with pytest.raises(ValueError, match="Checkpoint.changes names 'lr', not a component.*'tx'"):
    dj.simulate(loss_fn, optax.sgd(0.5), params, data, schedule,
                checkpoint=dj.Checkpoint(tmp_path, changes=("lr",)), **kw)


@pytest.mark.parametrize("runtime", ["simulate", "gossip"])
def test_a_changed_schedule_is_refused_even_when_named_as_a_change(interrupted, tmp_path, runtime):
  # Extending 24 updates to 32 would continue the new plan from the old one's gradients in flight.
  _, (loss_fn, params, data, schedule), kw, _ = interrupted
  longer = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(schedule.num_workers, seed=0),
                               num_updates=schedule.num_updates + 8, seed=0)
  with pytest.raises(ValueError, match="Checkpoint.changes cannot include 'schedule'.*resume=False"):
    if runtime == "simulate":
      dj.simulate(loss_fn, optax.sgd(0.5), params, data, longer,
                  checkpoint=dj.Checkpoint(tmp_path, changes=("schedule",)), **kw)
    else:
      sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                         num_steps=4, seed=0)
      dj.simulate_gossip(loss_fn, optax.sgd(0.5), dj.gossip.d_psgd(), params, data, sched,
                         checkpoint=dj.Checkpoint(tmp_path, changes=("schedule",)), **kw)
