"""Saved schedules (Schedule and GossipSchedule): one tagged .npz format, untagged older files, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def _schedules():
  server = C.simulate(C.ssp(1), C.workers(3), 40, seed=2)
  gossip = C.simulate_gossip(C.ad_psgd(dj.topology.ring(4)), C.workers(4), num_steps=20, seed=1)
  return {"Schedule": (C.Schedule, server), "GossipSchedule": (C.GossipSchedule, gossip)}


SCHEDULES = _schedules()


def _rewrite(path, drop=(), **replace):
  """The saved arrays again, less ``drop``, with ``replace``d fields (a file another writer could have left)."""
  with np.load(path) as data:
    arrays = {k: data[k] for k in data.files if k not in drop}
  arrays.update({k: np.asarray(v) for k, v in replace.items()})
  with open(path, "wb") as f:
    np.savez(f, **arrays)


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_saved_files_are_tagged_and_untagged_ones_still_load(kind, tmp_path):
  cls, schedule = SCHEDULES[kind]
  path = tmp_path / "s.npz"
  schedule.save(path)
  with np.load(path) as data:
    assert str(data["format"]) == kind and int(data["format_version"]) == 1
  assert cls.load(path) == schedule
  # Files written before the tag existed have the same layout without it.
  _rewrite(path, drop=("format", "format_version"))
  assert cls.load(path) == schedule


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_bad_files_are_refused_by_name(kind, tmp_path):
  cls, schedule = SCHEDULES[kind]
  other = "GossipSchedule" if kind == "Schedule" else "Schedule"
  path = tmp_path / "s.npz"
  SCHEDULES[other][1].save(path)
  with pytest.raises(ValueError, match=f"holds a {other}, not a {kind}; read it with {other}.load"):
    cls.load(path)

  schedule.save(path)
  _rewrite(path, format_version=np.int64(2))
  with pytest.raises(ValueError, match=f"written in {kind} format version 2; this delayjax reads versions up to 1"):
    cls.load(path)

  schedule.save(path)
  _rewrite(path, drop=("time",))
  with pytest.raises(ValueError, match=f"not a complete {kind} file: it lacks time"):
    cls.load(path)

  schedule.save(path)
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match=f"s.npz' is (not a readable {kind} file|damaged)"):
    cls.load(path)

  np.save(tmp_path / "one.npy", np.zeros(3))
  with pytest.raises(ValueError, match=f"holds one array, not a {kind} file"):
    cls.load(tmp_path / "one.npy")
  with pytest.raises(FileNotFoundError):
    cls.load(tmp_path / "missing.npz")
  with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
    cls.load(3)
