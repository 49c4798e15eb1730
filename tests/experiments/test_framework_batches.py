"""The framework's batched runs: a reproduction's runs computed several at a time (Reproduction.batch/run_batch)."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import pytest

from experiments import _framework as fw

# What run_batch computed in this process: (members, progress's checkpoint folder, the records it returned).
CALLS: list[tuple[list[tuple[str, int]], str | None, list[dict]]] = []


def _specs(config):
  return [{"key": key, "w": w} for key, w in config["ws"].items()]


def _batch(config, spec, seed):
  """The key of the runs computed together: a spec's pending seeds."""
  return spec["key"]


def _record(members, index):
  """A deterministic stand-in for a batched run: its seed, its place in the batch and the whole membership."""
  (spec, seed) = members[index]
  names = [[s["key"], n] for s, n in members]  # as JSON reads it back
  tag = zlib.crc32(json.dumps(names).encode()) % 1000
  return {"metrics": {"value": seed * 100 + index + tag / 1000 + spec["w"]}, "batch": names}


def _run_batch(config, members, progress):
  progress(0, len(members))
  records = [_record(members, i) for i in range(len(members))]
  progress(len(members), len(members))
  CALLS.append(([(s["key"], n) for s, n in members], progress.checkpoint_dir, records))
  return records


def _plain_run(config, spec, seed, progress):
  progress(1, 1)
  return {"metrics": {"value": seed * 10 + spec["w"]}, "checkpoints": progress.checkpoint_dir is not None}


def _summarize(config, records):
  return fw.mean_rows(records)


def _plots(config, records, rows, out):
  return []


def _repro(name="batched", batched=True, **overrides):
  fields = dict(name=name, paper="nobody", description="records from a formula",
                scales={"quick": {"ws": {"a": 1, "b": 2}, "seeds": 2}}, specs=_specs, run=_plain_run,
                summarize=_summarize, claims=[], plots=_plots)
  if batched:
    fields.update(batch=_batch, run_batch=_run_batch)
  return fw.Reproduction(**{**fields, **overrides})


@pytest.fixture(autouse=True)
def _calls():
  CALLS.clear()
  yield
  CALLS.clear()


def _saved(out):
  """The saved records by (key, seed), without their wall seconds."""
  records = {}
  for record in fw.load_records(str(out)):
    record = dict(record)
    assert record.pop("seconds") >= 0
    records[record["key"], record["seed"]] = record
  return records


def _returned(members, key, seed):
  """What run_batch returned for the member (key, seed) of its call on ``members``."""
  (calls,) = [c for c in CALLS if c[0] == members]
  return calls[2][members.index((key, seed))]


def _run(repro, out, seeds=2, **kwargs):
  config = fw.config_for(repro, "quick", seeds=seeds)
  return config, fw.execute(repro, config, str(out), plots=False, verbose=False, **kwargs)


def test_the_pending_runs_of_a_key_are_computed_together_and_saved_as_returned(tmp_path):
  repro = _repro()
  config, result = _run(repro, tmp_path)
  # Four pending runs, two keys: one call per key, with its pending seeds, in order, without a checkpoint folder.
  assert [c[0] for c in CALLS] == [[("a", 0), ("a", 1)], [("b", 0), ("b", 1)]]
  assert all(c[1] is None for c in CALLS)
  assert (result["ran"], result["reused"]) == (4, 0)
  saved = _saved(tmp_path)
  for (key, seed), record in saved.items():
    spec = {"key": key, "w": config["ws"][key]}
    assert record == {**_returned([(key, 0), (key, 1)], key, seed), "key": key, "spec": spec, "seed": seed,
                      "fingerprint": fw.run_fingerprint(config, spec, seed)}
  assert {r["key"]: r["value"] for r in result["rows"]} == pytest.approx(
      {k: sum(_returned([(k, 0), (k, 1)], k, s)["metrics"]["value"] for s in (0, 1)) / 2 for k in "ab"})

  # A lost run (b, 1), a new seed 2 and --only a: only a's pending run is computed, alone in its batch.
  os.remove(fw.run_path(str(tmp_path), "b", 1))
  CALLS.clear()
  _, result = _run(repro, tmp_path, seeds=3, only=["a"])
  assert [c[0] for c in CALLS] == [[("a", 2)]] and (result["ran"], result["reused"]) == (1, 2)
  assert sorted(_saved(tmp_path)) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]

  # Then b's two pending seeds, 1 and 2, in one batch; a rerun reuses every run and computes nothing.
  CALLS.clear()
  _, result = _run(repro, tmp_path, seeds=3)
  assert [c[0] for c in CALLS] == [[("b", 1), ("b", 2)]] and result["ran"] == 2
  CALLS.clear()
  _, result = _run(repro, tmp_path, seeds=3)
  assert CALLS == [] and (result["ran"], result["reused"]) == (0, 6)


def test_a_batched_and_a_plain_reproduction_in_one_plan(tmp_path):
  """The plain reproduction's runs are performed and saved as without the batched one beside it."""
  batched, plain = _repro(), _repro("plain", batched=False)
  config = fw.config_for(batched, "quick", seeds=3)
  fw.execute(plain, config, str(tmp_path / "alone"), plots=False, verbose=False)
  results = fw.execute_many([(plain, config, str(tmp_path / "plain")), (batched, config, str(tmp_path / "b"))],
                            plots=False, verbose=False)
  assert [(r["ran"], r["reused"]) for r in results] == [(6, 0), (6, 0)]
  assert _saved(tmp_path / "plain") == _saved(tmp_path / "alone")
  assert all(r["checkpoints"] for r in _saved(tmp_path / "plain").values())  # each plain run keeps its checkpoint
  assert [c[0] for c in CALLS] == [[(k, s) for s in range(3)] for k in "ab"]
  assert set(_saved(tmp_path / "b")) == {(k, s) for k in "ab" for s in range(3)}


@pytest.mark.slow
def test_worker_processes_save_the_same_records(tmp_path):
  """--jobs 2: each batch is one task of the pool; the saved records are those of --jobs 1, and the plain
  reproduction in the same plan too."""
  batched, plain = _repro(), _repro("plain", batched=False)
  config = fw.config_for(batched, "quick", seeds=6)
  for jobs in (1, 2):
    results = fw.execute_many([(batched, config, str(tmp_path / f"b{jobs}")),
                               (plain, config, str(tmp_path / f"p{jobs}"))], plots=False, verbose=False, jobs=jobs)
    assert [(r["ran"], r["reused"]) for r in results] == [(12, 0), (12, 0)]
  assert [c[0] for c in CALLS] == [[(k, s) for s in range(6)] for k in "ab"]  # only --jobs 1 computed here
  for name in ("b", "p"):
    assert _saved(tmp_path / f"{name}2") == _saved(tmp_path / f"{name}1")
  assert len(_saved(tmp_path / "b2")) == 12
  unpicklable = _repro(run_batch=lambda config, members, progress: _run_batch(config, members, progress))
  with pytest.raises(fw.UsageError, match="batched's run_batch function cannot be sent to a worker"):
    _run(unpicklable, tmp_path / "lambda", seeds=6, jobs=2)  # two batches: a pool


def test_batch_and_run_batch_go_together():
  with pytest.raises(ValueError, match="batched: batch and run_batch go together.*run_batch is given but batch"):
    _repro(batch=None)
  with pytest.raises(ValueError, match="batched: batch and run_batch go together.*batch is given but run_batch"):
    _repro(run_batch=None)
  with pytest.raises(TypeError, match="batched: batch must be a function, got 3"):
    _repro(batch=3)
  assert _repro(batched=False).batch is None


def _unhashable_batch(config, spec, seed):
  return [spec["key"]]


def _short_run_batch(config, members, progress):
  return _run_batch(config, members, progress)[:-1]


def test_a_bad_batch_raises_naming_the_reproduction(tmp_path):
  with pytest.raises(ValueError, match=r"^batched: batch gave run 'a' seed 0 the key \['a'\], which is not hashable"):
    _run(_repro(batch=_unhashable_batch), tmp_path)
  with pytest.raises(ValueError, match=r"^batched: run_batch returned 1 records for the batch .* of 2 runs"):
    _run(_repro(run_batch=_short_run_batch), tmp_path)
  assert not os.path.isdir(tmp_path / "runs") or not os.listdir(tmp_path / "runs")  # nothing saved


def _slow_run_batch(config, members, progress):
  CLOCK[0] += 8.0  # the batch takes 8 s of the framework's clock
  return _run_batch(config, members, progress)


CLOCK = [0.0]


def test_seconds_are_the_batchs_wall_time_shared_by_its_members(tmp_path, monkeypatch):
  monkeypatch.setattr(fw, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: CLOCK[0])}))
  _run(_repro(run_batch=_slow_run_batch), tmp_path)
  assert {r["seconds"] for r in fw.load_records(str(tmp_path))} == {4.0}  # 8 s over a batch's 2 runs


def test_dataclass_replace_keeps_the_pairing():
  repro = _repro()
  assert dataclasses.replace(repro, name="other").run_batch is _run_batch
