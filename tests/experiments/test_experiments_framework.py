"""The reproduction framework: resumable runs, atomic records, outputs, claims decided by the numbers."""

import csv
import json
import os

import numpy as np
import pytest

from experiments import _framework as fw
from experiments import dc_asgd


def _toy(calls: list, claim_threshold: float = 0.5) -> fw.Reproduction:
  """A reproduction whose 'training' is a formula: error = 1 / (1 + lr * seed + 1); counts its runs."""

  def specs(config):
    return [{"key": f"lr{lr}", "lr": lr} for lr in config["lrs"]]

  def run(config, spec, seed, progress):
    calls.append((spec["key"], seed))
    progress(config["steps"], config["steps"])
    updates = np.arange(0, config["steps"] + 1, 5)
    error = 1.0 / (1.0 + spec["lr"] * (updates + 1) * (seed + 1))
    return {"metrics": {"test_error": float(error[-1])},
            "curves": {"update": updates, "time": 2.0 * updates, "test_error": error},
            "staleness_hist": np.array([3, 2, 1])}

  def summarize(config, records):
    return fw.mean_rows(records, fields=("lr",))

  def check(summary):
    best = min(r["test_error"] for r in summary.values())
    return fw.ClaimResult(best < claim_threshold, f"best error {best:.3f}")

  def plots(config, records, rows, out):
    from experiments import _plots
    return [_plots.curves(records, out, "curves"), _plots.staleness_histograms(records, out)]

  return fw.Reproduction(
      name="toy", paper="nobody", description="a formula", scales={"quick": {"lrs": [0.1, 1.0], "steps": 20,
                                                                              "seeds": 2}},
      specs=specs, run=run, summarize=summarize, claims=[fw.Claim("low", "error below threshold", check)],
      plots=plots)


def test_resume_skips_finished_runs_and_redoes_changed_ones(tmp_path):
  calls = []
  repro = _toy(calls)
  config = fw.config_for(repro, "quick")
  first = fw.execute(repro, config, str(tmp_path), verbose=False)
  assert sorted(calls) == [("lr0.1", 0), ("lr0.1", 1), ("lr1.0", 0), ("lr1.0", 1)]
  assert (first["ran"], first["reused"]) == (4, 0)
  # An interrupted reproduction: one finished run lost, and a leftover temp file from a killed write.
  os.remove(fw.run_path(str(tmp_path), "lr1.0", 1))
  (tmp_path / "runs" / ".tmp-partial.json").write_text("{trunc")
  calls.clear()
  second = fw.execute(repro, config, str(tmp_path), verbose=False)
  assert calls == [("lr1.0", 1)]
  assert (second["ran"], second["reused"]) == (1, 3)
  assert second["rows"] == first["rows"]
  # A changed config invalidates the finished runs (their fingerprint no longer matches).
  calls.clear()
  fw.execute(repro, fw.config_for(repro, "quick", steps=10), str(tmp_path), verbose=False)
  assert len(calls) == 4


def test_outputs_are_written_and_well_formed(tmp_path):
  repro = _toy([])
  result = fw.execute(repro, fw.config_for(repro, "quick"), str(tmp_path), verbose=False)
  with open(tmp_path / "results.json") as f:
    saved = json.load(f)
  assert saved["reproduction"] == "toy"
  rows = {r["key"]: r for r in saved["rows"]}
  # Means over the two seeds, from the formula.
  expected = np.mean([1 / (1 + 0.1 * 21 * (s + 1)) for s in (0, 1)])
  assert rows["lr0.1"]["test_error"] == pytest.approx(expected)
  assert rows["lr0.1"]["seeds"] == 2
  with open(tmp_path / "results.csv") as f:
    table = list(csv.DictReader(f))
  assert [r["key"] for r in table] == ["lr0.1", "lr1.0"]
  assert float(table[0]["test_error"]) == pytest.approx(expected, rel=1e-5)
  with open(tmp_path / "claims.csv") as f:
    claims = list(csv.DictReader(f))
  assert claims[0]["held"] == "True"
  for name in ("curves.png", "staleness.png"):
    with open(tmp_path / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.join(str(tmp_path), "curves.png") in result["files"]
  records = fw.load_records(str(tmp_path))
  assert len(records) == 4 and all(r["fingerprint"] for r in records)


def test_claim_is_decided_by_the_numbers(tmp_path):
  repro = _toy([], claim_threshold=0.01)
  result = fw.execute(repro, fw.config_for(repro, "quick"), str(tmp_path), verbose=False)
  assert result["claims"][0]["held"] is False
  assert "best error" in result["claims"][0]["figures"]


def test_write_json_is_atomic_and_converts_numpy(tmp_path):
  path = str(tmp_path / "a" / "b.json")
  fw.write_json(path, {"x": np.float32(1.5), "y": np.arange(3), "z": float("nan"), "w": np.int64(2)})
  with open(path) as f:
    assert json.load(f) == {"x": 1.5, "y": [0, 1, 2], "z": None, "w": 2}
  assert os.listdir(tmp_path / "a") == ["b.json"]


def test_config_overrides_are_checked():
  repro = _toy([])
  assert fw.config_for(repro, "quick", overrides={"lrs": [0.5]})["lrs"] == [0.5]
  with pytest.raises(ValueError, match="no such setting"):
    fw.config_for(repro, "quick", overrides={"nope": 1})
  with pytest.raises(ValueError, match="scale must be one of"):
    fw.config_for(repro, "huge")


def _dc_summary(errors: dict[str, float]) -> dict[str, dict]:
  rows = {}
  for key, error in errors.items():
    method, _, m = key.rpartition("-M")
    rows[key] = {"key": key, "method": method or key, "workers": int(m) if method else 1, "error_pct": error}
  return rows


def _dc_verdicts(errors):
  summary = _dc_summary(errors)
  return {c.name: c.evaluate(summary).held for c in dc_asgd.CLAIMS}


def test_dc_asgd_claims_follow_fabricated_numbers_both_ways():
  # The paper's story: ASGD degrades with M, DC-ASGD fixes it.
  good = {"sequential": 8.6}
  for m, asgd in ((4, 9.3), (8, 10.0), (16, 11.0)):
    good |= {f"ssgd-M{m}": asgd + 0.2, f"asgd-M{m}": asgd, f"dc-asgd-c-M{m}": asgd - 0.5,
             f"dc-asgd-a-M{m}": 8.6 + (m / 16)}
  verdicts = _dc_verdicts(good)
  assert all(verdicts.values()), verdicts
  # The opposite story: delay compensation hurts, ASGD is as good as sequential.
  bad = {"sequential": 8.6}
  for m in (4, 8, 16):
    bad |= {f"ssgd-M{m}": 8.0, f"asgd-M{m}": 8.5, f"dc-asgd-c-M{m}": 9.0, f"dc-asgd-a-M{m}": 9.5}
  verdicts = _dc_verdicts(bad)
  assert not any(verdicts.values()), verdicts


def test_a_claim_without_its_numbers_is_not_evaluated():
  result = dc_asgd.CLAIMS[0].evaluate({})
  assert result.held is None and "not evaluated" in result.figures


def test_mean_is_nan_when_any_seed_is_missing():
  records = [{"key": "a", "spec": {}, "metrics": {"t": 2.0}}, {"key": "a", "spec": {}, "metrics": {"t": None}},
             {"key": "b", "spec": {}, "metrics": {"t": 1.0}}, {"key": "b", "spec": {}, "metrics": {"t": 3.0}}]
  rows = {r["key"]: r for r in fw.mean_rows(records)}
  assert np.isnan(rows["a"]["t"]) and rows["a"]["nonfinite"] == 1 and rows["a"]["t_std"] == 0.0
  assert rows["b"]["t"] == 2.0 and rows["b"]["t_std"] == 1.0 and rows["b"]["nonfinite"] == 0
  assert fw.or_inf(None) == float("inf") and fw.or_inf(float("nan")) == float("inf") and fw.or_inf(2) == 2.0


def test_staleness_aware_claims_follow_fabricated_numbers_both_ways():
  from experiments import staleness_aware

  def summary(fixed, lrtau, stale):
    rows = {}
    for n in (1, 30):
      rows[f"fixed-n{n}"] = {"n": n, "rule": "fixed", "error_pct": fixed[n], "mean_staleness": stale[n]}
      rows[f"lrtau-n{n}"] = {"n": n, "rule": "lrtau", "error_pct": lrtau[n], "mean_staleness": stale[n]}
    return rows

  paper = summary({1: 18.0, 30: 90.0}, {1: 18.0, 30: 19.0}, {1: 1.0, 30: 29.0})
  assert all(c.evaluate(paper).held for c in staleness_aware.CLAIMS)
  opposite = summary({1: 18.0, 30: 19.0}, {1: 18.0, 30: 40.0}, {1: 1.0, 30: 5.0})
  assert not any(c.evaluate(opposite).held for c in staleness_aware.CLAIMS)


def test_dssp_claims_follow_fabricated_numbers_both_ways():
  from experiments import dssp

  def summary(wait, reach, acc):
    return {p: {"paradigm": p, "total_wait": wait[p], "time_to_target": reach[p], "accuracy_pct": acc[p]}
            for p in ("bsp", "asp", "ssp", "dssp")}

  good = summary({"bsp": 90, "asp": 0, "ssp": 50, "dssp": 20}, {"bsp": 90, "asp": 40, "ssp": 60, "dssp": 45},
                 {"bsp": 97, "asp": 95, "ssp": 97, "dssp": 97})
  assert all(c.evaluate(good).held for c in dssp.CLAIMS)
  # DSSP never reaching the target (None) counts as infinitely slow.
  bad = summary({"bsp": 90, "asp": 0, "ssp": 50, "dssp": 70}, {"bsp": 90, "asp": 40, "ssp": 60, "dssp": None},
                {"bsp": 97, "asp": 95, "ssp": 97, "dssp": 90})
  assert not any(c.evaluate(bad).held for c in dssp.CLAIMS)


def test_cli_set_parses_json_values():
  from experiments.__main__ import _overrides

  assert _overrides(["workers=[4, 8]", "lr=0.5", "compute=exponential", "trace=null"]) == {
      "workers": [4, 8], "lr": 0.5, "compute": "exponential", "trace": None}
  with pytest.raises(SystemExit, match="KEY=VALUE"):
    _overrides(["lr"])


class _Interrupt(Exception):
  pass


def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path):
  import optax

  import delayjax as dj
  from experiments._training import simulate_record, task_for

  task = task_for({"data": "digits", "model": "mlp", "hidden": 16})
  bar = type("Bar", (), {"refresh": lambda self: None})()

  def record(progress):
    # Delay 0: every update is its own wave, so 300 updates take two chunks (a checkpoint after each).
    return simulate_record(task, optax.sgd(0.1), dj.delays.constant(0), num_updates=300, seed=3, batch_size=8,
                           eval_every=50, progress=progress)

  whole = record(fw.RunProgress(bar, None))
  calls = []

  def stop_after_first_chunk(done, total):
    calls.append(done)
    raise _Interrupt

  stopping = type("Stopping", (fw.RunProgress,), {"__call__": lambda self, d, t: stop_after_first_chunk(d, t)})
  with pytest.raises(_Interrupt):
    record(stopping(bar, str(tmp_path / "ckpt")))
  assert calls and calls[0] < 300 and os.listdir(tmp_path / "ckpt")
  resumed_from = []
  counting = type("Counting", (fw.RunProgress,), {"__call__": lambda self, d, t: resumed_from.append(d)})
  resumed = record(counting(bar, str(tmp_path / "ckpt")))
  assert resumed_from[0] > calls[0]  # the first chunk was not recomputed
  assert fw.to_json(resumed["metrics"]) == fw.to_json(whole["metrics"])
  np.testing.assert_array_equal(resumed["curves"]["test_error"], whole["curves"]["test_error"])
