"""The reproduction framework: resumable runs, atomic records, outputs, claims decided by the numbers."""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

import delayjax as dj
from experiments import _framework as fw
from experiments import dc_asgd


def _toy(calls: list, claim_threshold: float = 0.0, seeds: int = 2) -> fw.Reproduction:
  """A reproduction whose 'training' is a formula: error = 1 / (1 + lr (update + 1) (seed + 1)); counts its runs.

  Its claim: lr = 1 ends with an error lower than lr = 0.1 by more than ``-claim_threshold``.
  """

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
    return fw.ClaimResult.decide(fw.paired(summary, "lr1.0", "lr0.1", "test_error", margin=claim_threshold,
                                           what="error lr1.0 - lr0.1"))

  def plots(config, records, rows, out):
    from experiments import _plots
    return [_plots.curves(records, out, "curves"), _plots.staleness_histograms(records, out)]

  return fw.Reproduction(
      name="toy", paper="nobody", description="a formula", scales={"quick": {"lrs": [0.1, 1.0], "steps": 20,
                                                                              "seeds": seeds}},
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
  # Two seeds: the interval (t = 12.7 for one degree of freedom) still straddles zero.
  assert claims[0]["verdict"] == "inconclusive" and claims[0]["seeds"] == "2"
  assert saved["seeds"] == [0, 1] and saved["claims"][0]["low"] < 0 < saved["claims"][0]["high"]
  for name in ("curves.png", "staleness.png"):
    with open(tmp_path / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.join(str(tmp_path), "curves.png") in result["files"]
  records = fw.load_records(str(tmp_path))
  assert len(records) == 4 and all(r["fingerprint"] for r in records)


def test_claim_is_decided_by_the_numbers(tmp_path):
  # Five seeds: the differences lr1.0 - lr0.1 are about -0.28, -0.17, -0.12, -0.09, -0.07 (all negative).
  repro = _toy([], seeds=5)
  result = fw.execute(repro, fw.config_for(repro, "quick"), str(tmp_path / "a"), verbose=False)
  assert result["claims"][0]["verdict"] == "held" and result["claims"][0]["held"] is True
  assert "error lr1.0 - lr0.1" in result["claims"][0]["figures"]
  # Claimed 0.5 lower: far beyond what the formula gives, so the opposite is significant.
  repro = _toy([], seeds=5, claim_threshold=-0.5)
  result = fw.execute(repro, fw.config_for(repro, "quick"), str(tmp_path / "b"), verbose=False)
  assert result["claims"][0]["verdict"] == "not held" and result["claims"][0]["held"] is False


def test_write_json_is_atomic_and_converts_numpy(tmp_path):
  path = str(tmp_path / "a" / "b.json")
  fw.write_json(path, {"x": np.float32(1.5), "y": np.arange(3), "z": float("nan"), "w": np.int64(2)})
  with open(path) as f:
    assert json.load(f) == {"x": 1.5, "y": [0, 1, 2], "z": None, "w": 2}
  assert os.listdir(tmp_path / "a") == ["b.json"]


def test_config_overrides_are_checked():
  repro = _toy([])
  assert fw.config_for(repro, "quick", overrides={"lrs": [0.5]})["lrs"] == [0.5]
  with pytest.raises(ValueError, match="has no setting 'nope'"):
    fw.config_for(repro, "quick", overrides={"nope": 1})
  with pytest.raises(ValueError, match="scale must be one of"):
    fw.config_for(repro, "huge")


def _summary(table: dict, fields: tuple = ()) -> dict:
  """A summary as the framework builds it, from fabricated per-seed metrics: {key: (spec, {metric: [values]})}."""
  records = [{"key": key, "spec": spec, "seed": seed, "metrics": {m: v[seed] for m, v in metrics.items()}}
             for key, (spec, metrics) in table.items() for seed in range(len(next(iter(metrics.values()))))]
  return {r["key"]: r for r in fw.mean_rows(records, fields=fields)}


JITTER = np.array([0.0, 0.002, -0.001, 0.001, -0.002])  # per-seed noise, different for each row below


def _dc(loss: dict, error: dict) -> dict:
  table = {}
  for i, key in enumerate(loss):
    method, _, m = key.rpartition("-M")
    spec = {"method": method or key, "workers": int(m) if method else 1}
    noise = np.roll(JITTER, i)
    table[key] = (spec, {"train_loss": list(loss[key] + noise), "test_error": list(error.get(key, 0.05) + noise / 10)})
  return _summary(table, fields=("method", "workers"))


def _verdicts(claims, summary):
  return {c.name: c.evaluate(summary).verdict for c in claims}


def test_dc_asgd_claims_follow_fabricated_numbers_both_ways_and_ties_are_inconclusive():
  # The paper's story: ASGD degrades with M, DC-ASGD fixes it (training losses; test errors as fractions).
  loss, error = {"sequential": 0.10}, {"sequential": 0.020, "dc-asgd-a-M4": 0.022}
  for m, asgd in ((4, 0.12), (16, 0.20)):
    loss |= {f"ssgd-M{m}": asgd + 0.05, f"asgd-M{m}": asgd, f"dc-asgd-c-M{m}": asgd - 0.01, f"dc-asgd-a-M{m}": 0.105}
  assert set(_verdicts(dc_asgd.CLAIMS, _dc(loss, error)).values()) == {"held"}
  # The opposite story: delay compensation hurts, ASGD is as good as sequential.
  loss, error = {"sequential": 0.20}, {"sequential": 0.020, "dc-asgd-a-M4": 0.040}
  for m in (4, 16):
    loss |= {f"ssgd-M{m}": 0.10, f"asgd-M{m}": 0.15 - m / 1000, f"dc-asgd-c-M{m}": 0.25, f"dc-asgd-a-M{m}": 0.3}
  assert set(_verdicts(dc_asgd.CLAIMS, _dc(loss, error)).values()) == {"not held"}
  # Every method the same, seed for seed: no comparison is decided (and "within 0.5 points" holds).
  same = {k: 0.1 for k in ("sequential", "ssgd-M4", "asgd-M4", "dc-asgd-c-M4", "dc-asgd-a-M4")}
  summary = _summary({k: ({"method": k.rpartition("-M")[0] or k, "workers": 4}, {"train_loss": [0.1, 0.2, 0.3],
                                                                                "test_error": [0.1, 0.2, 0.3]})
                      for k in same}, fields=("method", "workers"))
  verdicts = _verdicts(dc_asgd.CLAIMS, summary)
  assert verdicts.pop("dca-near-sequential") == "held" and set(verdicts.values()) == {"inconclusive"}


def test_a_claim_without_its_numbers_is_not_evaluated():
  result = dc_asgd.CLAIMS[0].evaluate({})
  assert result.held is None and result.verdict == "not evaluated" and "not evaluated" in result.figures


def test_mean_is_nan_when_any_seed_is_missing():
  records = [{"key": "a", "spec": {}, "seed": 0, "metrics": {"t": 2.0}},
             {"key": "a", "spec": {}, "seed": 1, "metrics": {"t": None}},
             {"key": "b", "spec": {}, "seed": 0, "metrics": {"t": 1.0}},
             {"key": "b", "spec": {}, "seed": 1, "metrics": {"t": 3.0}}]
  rows = {r["key"]: r for r in fw.mean_rows(records)}
  assert np.isnan(rows["a"]["t"]) and rows["a"]["nonfinite"] == 1 and rows["a"]["t_std"] == 0.0
  assert rows["b"]["t"] == 2.0 and rows["b"]["t_std"] == 1.0 and rows["b"]["nonfinite"] == 0
  assert rows["a"]["per_seed"]["t"] == {0: 2.0, 1: None} and rows["b"]["per_seed"]["t"] == {0: 1.0, 1: 3.0}
  assert fw.or_inf(None) == float("inf") and fw.or_inf(float("nan")) == float("inf") and fw.or_inf(2) == 2.0


def test_a_diverged_seed_is_left_out_of_the_means_and_shown_as_diverged():
  # Seed 2 diverged: its loss is NaN but its test error (0.9) is finite, which a plain mean would average in.
  records = [{"key": "a", "spec": {}, "seed": s, "metrics": {"loss": loss, "err": err}, "diverged": s == 2}
             for s, loss, err in ((0, 0.2, 0.10), (1, 0.4, 0.14), (2, float("nan"), 0.9))]
  row = fw.mean_rows(records)[0]
  assert row["loss"] == pytest.approx(0.3) and row["err"] == pytest.approx(0.12)
  assert row["err_std"] == pytest.approx(np.std([0.10, 0.14])) and row["diverged_seeds"] == 1
  # The claims still see every seed: the diverged one as missing (infinitely bad) or as its own value.
  assert row["per_seed"]["loss"] == {0: 0.2, 1: 0.4, 2: None} and row["per_seed"]["err"][2] == 0.9
  assert fw.diverged_text(row) == "1 of 3 seeds" and fw.diverged_text({"seeds": 3}) == ""
  repro = fw.Reproduction(name="toy", paper="p", description="d", scales={"quick": {}}, specs=lambda c: [],
                          run=None, summarize=None, claims=(), plots=None, columns=("key", "loss", "err"))
  table = fw.render(repro, [row], [])
  assert "diverged on" in table and "1 of 3 seeds" in table and "nan" not in table


def test_bar_whiskers_are_the_t_interval_cut_to_the_range():
  from scipy import stats

  from experiments import _plots

  values = np.array([0.5, 3.0, 0.2, 0.1])
  low, high = _plots.mean_interval(values.mean(), values.std(), values.size, (0.0, 100.0))
  half = stats.t.ppf(0.975, 3) * values.std(ddof=1) / np.sqrt(values.size)
  assert values.mean() - half < 0.0 and low == 0.0 and high == pytest.approx(values.mean() + half)
  assert _plots.mean_interval(99.0, 2.0, 5, (0.0, 100.0))[1] == 100.0
  assert _plots.mean_interval(1.0, 5.0, 1, (0.0, None)) == (1.0, 1.0)


def test_staleness_aware_claims_follow_fabricated_numbers_both_ways():
  from experiments import staleness_aware

  def summary(fixed, lrtau, stale):
    table = {}
    for i, n in enumerate((1, 30)):
      for rule, error in (("fixed", fixed), ("lrtau", lrtau)):
        noise = np.roll(JITTER, i + 2 * len(table))
        table[f"{rule}-n{n}"] = ({"n": n, "rule": rule}, {"test_error": list(error[n] + noise),
                                                          "mean_staleness": list(stale[n] + noise)})
    return _summary(table, fields=("n", "rule"))

  paper = summary({1: 0.18, 30: 0.90}, {1: 0.18, 30: 0.19}, {1: 1.0, 30: 29.0})
  assert set(_verdicts(staleness_aware.CLAIMS, paper).values()) == {"held"}
  opposite = summary({1: 0.18, 30: 0.19}, {1: 0.18, 30: 0.40}, {1: 1.0, 30: 5.0})
  assert set(_verdicts(staleness_aware.CLAIMS, opposite).values()) == {"not held"}


def test_dssp_claims_follow_fabricated_numbers_both_ways():
  from experiments import dssp

  def summary(wait, reach, error):
    return _summary({p: ({"paradigm": p}, {"total_wait": list(wait[p] + 10 * np.roll(JITTER, i)),
                                           "time_to_target_bound": list(reach[p] + 10 * np.roll(JITTER, i + 1)),
                                           "test_error": list(error[p] + np.roll(JITTER, i + 2))})
                     for i, p in enumerate(("bsp", "asp", "ssp", "dssp"))}, fields=("paradigm",))

  good = summary({"bsp": 90, "asp": 0, "ssp": 50, "dssp": 20}, {"bsp": 90, "asp": 40, "ssp": 60, "dssp": 45},
                 {"bsp": 0.03, "asp": 0.05, "ssp": 0.03, "dssp": 0.03})
  assert set(_verdicts(dssp.CLAIMS, good).values()) == {"held"}
  bad = summary({"bsp": 90, "asp": 0, "ssp": 50, "dssp": 70}, {"bsp": 90, "asp": 40, "ssp": 60, "dssp": 120},
                {"bsp": 0.03, "asp": 0.05, "ssp": 0.03, "dssp": 0.10})
  assert set(_verdicts(dssp.CLAIMS, bad).values()) == {"not held"}


# ---------------------------------------------------------------- the statistics, against known values


@pytest.mark.parametrize("confidence, df, expected", [
    (0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 4, 2.776), (0.95, 9, 2.262), (0.95, 29, 2.045),
    (0.95, 200, 1.972), (0.90, 4, 2.132), (0.99, 9, 3.250), (0.80, 3, 1.638)])
def test_t_quantile_matches_the_printed_table(confidence, df, expected):
  assert fw.t_quantile(confidence, df) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_refuses_what_has_no_quantile():
  with pytest.raises(ValueError, match="confidence must be in"):
    fw.t_quantile(1.0, 4)
  with pytest.raises(ValueError, match="df must be a positive integer"):
    fw.t_quantile(0.95, 0)


def test_compare_gives_the_paired_t_interval_and_three_verdicts():
  a = np.array([1.0, 1.2, 0.7, 1.1, 0.9])
  d = a - 2.0
  half = 2.7764451 * d.std(ddof=1) / np.sqrt(5)
  c = fw.compare(list(a), [2.0] * 5)
  assert (c.verdict, c.n, c.test) == ("held", 5, "paired t")
  assert (c.mean, c.low, c.high) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half), rel=1e-6)
  assert fw.compare(list(a), [2.0] * 5, claim="greater").verdict == "not held"
  assert fw.compare(list(a), [2.0] * 5, margin=-0.5).verdict == "held"  # -1.02 [-1.26, -0.78] < -0.5
  assert fw.compare(list(a), [2.0] * 5, margin=-1.0).verdict == "inconclusive"
  # A tie, a single seed and a one-seed difference decide nothing.
  assert fw.compare([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]).verdict == "inconclusive"
  assert fw.compare([1.0], [5.0]).verdict == "inconclusive"
  assert fw.compare([1.0, 1.0, 1.0, 1.0, 0.0], [1.0] * 5).verdict == "inconclusive"
  # Seeds are paired by name; missing values leave the seed out; nothing to pair: not evaluated.
  assert fw.compare({0: 1.0, 1: 2.0, 2: 3.0}, {1: 1.0, 2: 2.0, 3: 9.0}).n == 2
  assert fw.compare([1.0, None, 3.0], [0.0, 0.0, float("nan")]).n == 1
  assert fw.compare([None], [1.0]).verdict == "not evaluated"
  # One-sample "within": the whole interval inside the band, or wholly outside it.
  assert fw.compare([0.1, 0.12, 0.09, 0.11], claim="within", margin=0.3).verdict == "held"
  assert fw.compare([0.5, 0.6, 0.55, 0.52], claim="within", margin=0.3).verdict == "not held"


def test_infinite_values_take_the_sign_test_or_the_censor():
  assert fw.binomial_tail(6, 6) == pytest.approx(1 / 64, rel=1e-12)
  assert fw.binomial_tail(5, 6) == pytest.approx(7 / 64, rel=1e-12) and fw.binomial_tail(0, 3) == 1.0
  never = [float("inf")] * 6
  reached = [50.0, 60.0, 55.0, 52.0, 58.0, 61.0]
  c = fw.compare(never, reached, claim="greater")
  assert (c.verdict, c.test) == ("held", "sign") and "6 of 6" in c.note
  # Five seeds cannot reach one-sided p <= 0.025 (1/32 = 0.031): inconclusive.
  assert fw.compare(never[:5], reached[:5], claim="greater").verdict == "inconclusive"
  assert fw.compare(never[:5], reached[:5], claim="less").verdict == "inconclusive"
  # Censored at the budget (a lower bound of the never-reached times), the t interval decides.
  c = fw.compare(never[:5], reached[:5], claim="greater", censor=120.0)
  assert (c.verdict, c.test) == ("held", "paired t") and c.mean == pytest.approx(120 - np.mean(reached[:5]))
  assert fw.compare([float("inf")] * 4, [float("inf")] * 4).note == "all 4 seeds tie"


def test_a_target_never_reached_counts_the_horizon_the_budget_sets():
  from experiments._training import time_horizon, with_time_to_target, within_time

  full = dj.cluster.simulate(dj.cluster.bsp(), dj.cluster.workers(4, compute="exponential"), 50, seed=0)
  budget = float(full.time[20] + full.time[21]) / 2
  assert within_time(full, budget).num_updates == 21
  # Cut by the budget: the model is unchanged from update 20 to the budget's end, so a miss counts the budget.
  assert time_horizon(full, budget) == budget
  # Ended by its updates before the budget: nothing is known past its last update.
  assert time_horizon(full, 1e9) == float(full.time[-1])

  def metrics(errors, horizon=None):
    record = {"metrics": {}, "curves": {"time": [1.0, 2.0, 2.9], "test_error": errors}}
    return with_time_to_target(record, 0.9, horizon)["metrics"]

  assert metrics([0.5, 0.4, 0.3], horizon=3.0) == {"time_to_target": None, "time_to_target_bound": 3.0}
  assert metrics([0.5, 0.4, 0.3])["time_to_target_bound"] == 2.9  # no horizon: the last evaluation
  assert metrics([0.5, 0.05, 0.3], horizon=3.0) == {"time_to_target": 2.0, "time_to_target_bound": 2.0}


def test_seeds_like_names_the_configured_seeds_whose_plans_can_share_the_program():
  from experiments._training import schedule_once, seeds_like

  made = []

  def schedule_of(seed):
    # Seed 4 is synchronous (4 contributions per update), the others asynchronous (one each); seed 2's minibatches
    # grow to 3 per contribution.
    def make():
      made.append(seed)
      paradigm = dj.cluster.bsp() if seed == 4 else dj.cluster.asp()
      sched = dj.cluster.simulate(paradigm, dj.cluster.workers(4), 12, seed=seed)
      return dj.growing_batches(dj.delays.constant(1), 12, rate=0.5, maximum=3, seed=seed) if seed == 2 else sched
    return schedule_once(make, "test_seeds_like", seed)

  config = {"seeds": 4}

  def seeds(like):
    return [next(k for k in made if schedule_of(k) is s) for s in like]

  assert seeds(seeds_like(config, 1, schedule_of)) == [0, 1, 3]  # seed 2's larger minibatches are left out
  assert seeds(seeds_like(config, 2, schedule_of)) == [2]
  # A seed past the configured ones is sized with them; one that cannot share a program is sized alone.
  assert seeds(seeds_like(config, 6, schedule_of)) == [0, 1, 3, 6]
  assert seeds(seeds_like(config, 4, schedule_of)) == [4]
  # Each schedule was simulated once, however often it was asked for.
  assert sorted(made) == [0, 1, 2, 3, 4, 6]


def test_decide_combines_comparisons():
  held = fw.compare([1.0, 1.1, 0.9], [2.0, 2.0, 2.0], what="h")
  opposite = fw.compare([3.0, 3.1, 2.9], [2.0, 2.0, 2.0], what="o")
  tie = fw.compare([1.0, 2.0], [1.0, 2.0], what="t")
  assert fw.ClaimResult.decide([held, held]).verdict == "held"
  assert fw.ClaimResult.decide([held, tie]).verdict == "inconclusive"
  result = fw.ClaimResult.decide([held, tie, opposite])
  assert (result.verdict, result.held, result.comparison.what) == ("not held", False, "o")
  assert "h:" in result.figures and "o:" in result.figures
  empty = fw.ClaimResult.decide([])
  assert empty.verdict == "not evaluated" and empty.held is None and "nothing to compare" in empty.figures
  assert fw.ClaimResult(True, "legacy").verdict == "held"


# ---------------------------------------------------------------- the CLI refuses nonsense and keeps its manners


@pytest.fixture
def toy_cli(monkeypatch):
  """The CLI with the toy reproduction registered as 'toy'."""
  from experiments import _registry
  from experiments.__main__ import main

  calls = []
  repro = dataclasses.replace(_toy(calls, seeds=3), limits={"lrs": fw.POSITIVE})
  known = _registry.get
  monkeypatch.setattr(_registry, "NAMES", (*_registry.NAMES, "toy"))
  monkeypatch.setattr(_registry, "get", lambda name: repro if name == "toy" else known(name))
  return main, calls, repro


@pytest.mark.parametrize("args, names", [
    (["--set", "lrs=abc"], "--set lrs"),
    (["--set", "lrs=[]"], "--set lrs"),
    (["--set", "lrs=[-1]"], "lrs[0]"),
    (["--set", "lrs=[0.1, \"x\"]"], "lrs[1]"),
    (["--set", "lrs=[1e999]"], "lrs[0]"),
    (["--set", "steps=2.5"], "--set steps"),
    (["--set", "steps=-1"], "--set steps"),
    (["--set", "steps=true"], "--set steps"),
    (["--set", "nope=1"], "nope"),
    (["--set", "lrs"], "--set"),
    (["--set", "=1"], "--set"),
    (["--set", "lrs=[1]", "lrs=[2]"], "--set lrs"),
    (["--steps", "0"], "--steps"),
    (["--seeds", "0"], "--seeds"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "4294967296"], "--seed"),
    (["--only", "nomatch"], "--only"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--checkpoint-every", "nan"], "--checkpoint-every"),
    (["--checkpoint-every", "inf"], "--checkpoint-every"),
])
def test_bad_cli_input_is_an_error_naming_the_argument(toy_cli, tmp_path, capsys, args, names):
  main, calls, _ = toy_cli
  assert main(["run", "toy", "--out", str(tmp_path / "out"), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and names in err and "Traceback" not in err
  assert calls == []  # refused before any run


@pytest.mark.parametrize("argv, names", [
    (["run", "dc_asgd", "--set", "lr=abc"], "--set lr"),
    (["run", "dc_asgd", "--set", "lr=-1"], "--set lr"),
    (["run", "dc_asgd", "--set", "compute=fast"], "--set compute"),
    (["run", "dssp", "--set", "speeds=[1, 0]"], "speeds[1]"),
    (["run", "all", "--set", "nope=1"], "--set nope"),
    (["run", "nope"], "nope"),
])
def test_bad_cli_input_to_the_real_reproductions_fails_before_any_compute(tmp_path, capsys, argv, names):
  from experiments.__main__ import main

  assert main([*argv, "--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert names in err and "Traceback" not in err
  assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("args, names", [(["--scale", "huge"], "--scale"), (["--seed", "x"], "--seed"),
                                         (["--steps", "1.5"], "--steps")])
def test_malformed_options_are_refused_by_the_parser(toy_cli, capsys, args, names):
  main, _, _ = toy_cli
  with pytest.raises(SystemExit) as exit_info:
    main(["run", "toy", *args])
  assert exit_info.value.code == 2 and names in capsys.readouterr().err


def test_unwritable_out_fails_before_any_compute(toy_cli, tmp_path, capsys):
  main, calls, _ = toy_cli
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert main(["run", "toy", "--out", str(blocker / "sub")]) == 2
  assert "--out" in capsys.readouterr().err and calls == []


def test_damaged_results_are_errors_naming_the_file(toy_cli, tmp_path, capsys):
  main, _, _ = toy_cli
  out = tmp_path / "out"
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  results = out / "results.json"
  results.write_text(results.read_text()[:40])
  assert main(["report", str(out), "--no-plot"]) == 2
  assert f"{results} is damaged" in capsys.readouterr().err
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0  # a rerun rewrites it
  record = sorted((out / "runs").iterdir())[0]
  record.write_text("{")
  assert main(["report", str(out), "--no-plot"]) == 2
  assert f"{record} is damaged" in capsys.readouterr().err
  assert main(["report", str(tmp_path / "missing")]) == 2


def test_results_of_random_bytes_are_errors_naming_the_file(toy_cli, tmp_path, capsys):
  main, calls, _ = toy_cli
  out = tmp_path / "out"
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  noise = bytes(np.random.default_rng(0).integers(128, 256, 300, dtype=np.uint8))  # never valid UTF-8
  results = out / "results.json"
  results.write_bytes(noise)
  assert main(["report", str(out), "--no-plot"]) == 2
  err = capsys.readouterr().err
  assert f"{results} is damaged (not text" in err and "Traceback" not in err
  assert results.read_bytes() == noise  # nothing rewritten
  # A run record of random bytes: report names it; run redoes that run (a damaged record is not a result).
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  record = sorted((out / "runs").iterdir())[0]
  record.write_bytes(noise)
  assert main(["report", str(out), "--no-plot"]) == 2
  assert f"{record} is damaged" in capsys.readouterr().err
  calls.clear()
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  assert len(calls) == 1 and json.loads(record.read_text())["fingerprint"]


def _outputs(out, root):
  return {name: (path.read_bytes() if path.exists() else None)
          for name, path in [(n, out / n) for n in ("results.json", "results.csv", "claims.csv")]
          + [("claims.md", root / "claims.md")]}


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.update(lrs=[0.1, 2.0]), "its config matches none of the 6 run records in"),
    (lambda c: c.update(steps=10), "its config matches none of the 6 run records in"),
    (lambda c: c.pop("lrs"), "config has no 'lrs', which every toy (quick) config has"),
    (lambda c: c.update(lrs="0.1"), "config lrs=\"0.1\": lrs must be a non-empty list like [0.1, 1.0]"),
    (lambda c: c.update(steps=2.5), "config steps=2.5: steps must be an integer >= 0"),
    (lambda c: c.update(lrs=[0.1, -1.0]), "config lrs[1]=-1.0: lrs[1] must be a number > 0"),
    (lambda c: c.update(nope=1), "config has 'nope', which no toy (quick) config has"),
    (lambda c: c.update(scale="huge"), "config scale=\"huge\": scale must be one of ['quick']"),
], ids=["value", "steps", "removed", "type", "integer", "range", "unknown", "scale"])
def test_report_refuses_an_edited_config_and_overwrites_nothing(toy_cli, tmp_path, capsys, edit, says):
  main, _, _ = toy_cli
  out = tmp_path / "out"
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  assert main(["report", str(tmp_path), "--no-plot"]) == 0
  results = out / "results.json"
  saved = json.loads(results.read_text())
  edit(saved["config"])
  results.write_text(json.dumps(saved))
  before = _outputs(out, tmp_path)
  capsys.readouterr()
  assert main(["report", str(tmp_path), "--no-plot"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {results}: ") and says in err and "Traceback" not in err
  assert len(err.strip().splitlines()) == 1
  assert _outputs(out, tmp_path) == before  # results.json, results.csv, claims.csv and claims.md untouched


def test_report_refuses_a_folder_without_run_records(toy_cli, tmp_path, capsys):
  main, _, _ = toy_cli
  out = tmp_path / "out"
  assert main(["run", "toy", "--out", str(out), "--no-plot"]) == 0
  for record in (out / "runs").iterdir():
    record.unlink()
  before = _outputs(out, tmp_path)
  assert main(["report", str(out), "--no-plot"]) == 2
  assert "holds no run records to report on; nothing was rewritten" in capsys.readouterr().err
  assert _outputs(out, tmp_path) == before


@pytest.mark.parametrize("args, seeds", [(["--seed", str(2 ** 32 - 1), "--seeds", "2"], "2 seeds (--seeds)"),
                                         (["--seed", str(2 ** 32 - 2)], "3 seeds (the quick settings' seeds")])
def test_seeds_past_the_last_are_refused_naming_both_options(toy_cli, tmp_path, capsys, args, seeds):
  main, calls, _ = toy_cli
  assert main(["run", "toy", "--out", str(tmp_path / "out"), "--no-plot", *args]) == 2
  err = capsys.readouterr().err
  assert f"error: --seed {args[1]} with {seeds}" in err and "--seeds" in err and "2**32 - 1" in err
  assert calls == []  # refused before the first seed ran
  # The last seeds that fit run.
  assert main(["run", "toy", "--out", str(tmp_path / "out"), "--no-plot", "--seed", str(2 ** 32 - 2), "--seeds",
               "2"]) == 0
  assert sorted({seed for _, seed in calls}) == [2 ** 32 - 2, 2 ** 32 - 1]


def test_every_run_diverged_leaves_the_claims_not_evaluated(tmp_path):
  repro = _toy([], seeds=3)
  diverging = dataclasses.replace(repro, run=lambda config, spec, seed, progress: {
      "metrics": {"test_error": None}, "curves": {"update": [0, 1], "time": [0, 1], "test_error": [0.5, None]},
      "diverged": True})
  result = fw.execute(diverging, fw.config_for(diverging, "quick"), str(tmp_path), verbose=False, plots=False)
  claim = result["claims"][0]
  assert claim["verdict"] == "not evaluated" and "every one of the 6 runs diverged" in claim["figures"]


def test_results_cover_every_seed_and_run_and_report_agree(toy_cli, tmp_path, capsys):
  main, calls, _ = toy_cli
  out = str(tmp_path / "out")
  assert main(["run", "toy", "--out", out, "--seed", "1", "--seeds", "1", "--no-plot"]) == 0
  assert main(["run", "toy", "--out", out, "--seeds", "1", "--no-plot"]) == 0
  with open(os.path.join(out, "results.json")) as f:
    after_run = json.load(f)
  assert after_run["seeds"] == [0, 1] and all(r["seeds"] == 2 for r in after_run["rows"])
  assert main(["report", out, "--no-plot"]) == 0
  with open(os.path.join(out, "results.json")) as f:
    after_report = json.load(f)
  assert after_report["rows"] == after_run["rows"] and after_report["claims"] == after_run["claims"]
  # --only on the finished folder runs nothing and keeps every row.
  calls.clear()
  assert main(["run", "toy", "--out", out, "--seeds", "1", "--only", "lr0.1", "--no-plot"]) == 0
  with open(os.path.join(out, "results.json")) as f:
    assert len(json.load(f)["rows"]) == 2
  assert calls == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_files_are_written_with_the_users_umask(tmp_path, umask, mode):
  old = os.umask(umask)
  try:
    fw.write_json(str(tmp_path / "a.json"), {"x": 1})
    fw.write_csv(str(tmp_path / "b.csv"), [{"x": 1}])
  finally:
    os.umask(old)
  assert os.stat(tmp_path / "a.json").st_mode & 0o777 == mode
  assert os.stat(tmp_path / "b.csv").st_mode & 0o777 == mode


def test_ctrl_c_says_what_was_saved_and_how_to_resume(toy_cli, tmp_path, capsys):
  main, calls, repro = toy_cli
  run = repro.run

  def interrupted_second(config, spec, seed, progress):
    if len(calls) == 1:
      calls.append("interrupt")
      raise KeyboardInterrupt
    return run(config, spec, seed, progress)

  object.__setattr__(repro, "run", interrupted_second)
  out = str(tmp_path / "out")
  assert main(["run", "toy", "--out", out, "--no-plot"]) == 130
  err = capsys.readouterr().err.strip().splitlines()
  assert "Traceback" not in "\n".join(err)
  assert "1 finished runs of toy are saved" in err[-1] and "rerun the same command to resume" in err[-1]
  object.__setattr__(repro, "run", run)
  calls.clear()
  assert main(["run", "toy", "--out", out, "--no-plot"]) == 0
  assert len(calls) == 5  # six runs, one kept


def test_cli_set_parses_json_values():
  from experiments.__main__ import _overrides

  assert _overrides(["workers=[4, 8]", "lr=0.5", "compute=exponential", "trace=null"]) == {
      "workers": [4, 8], "lr": 0.5, "compute": "exponential", "trace": None}
  with pytest.raises(ValueError, match="KEY=VALUE"):
    _overrides(["lr"])


class _Interrupt(Exception):
  pass


@pytest.mark.slow
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
    record(stopping(bar, str(tmp_path / "ckpt"), checkpoint_every=0))  # a checkpoint after every chunk
  assert calls and calls[0] < 300 and os.listdir(tmp_path / "ckpt")
  resumed_from = []
  counting = type("Counting", (fw.RunProgress,), {"__call__": lambda self, d, t: resumed_from.append(d)})
  resumed = record(counting(bar, str(tmp_path / "ckpt"), checkpoint_every=0))
  assert resumed_from[0] > calls[0]  # the first chunk was not recomputed
  assert fw.to_json(resumed["metrics"]) == fw.to_json(whole["metrics"])
  np.testing.assert_array_equal(resumed["curves"]["test_error"], whole["curves"]["test_error"])


def test_checkpoint_every_reaches_each_runs_checkpoint(toy_cli, tmp_path, monkeypatch):
  """--checkpoint-every (default fw.CHECKPOINT_EVERY) reaches every run's RunProgress, and simulate_record turns
  it into its dj.Checkpoint's min_interval."""
  import optax

  import delayjax as dj
  from experiments import _training

  main, _, repro = toy_cli
  given = []
  toy = repro.run

  def run(config, spec, seed, progress):
    given.append(progress.checkpoint_every)
    return toy(config, spec, seed, progress)

  object.__setattr__(repro, "run", run)
  assert main(["run", "toy", "--no-plot", "--seeds", "1", "--out", str(tmp_path / "a"), "--checkpoint-every",
               "2.5"]) == 0
  assert main(["run", "toy", "--no-plot", "--seeds", "1", "--out", str(tmp_path / "b")]) == 0
  runs = len(given) // 2
  assert runs >= 2 and given == [2.5] * runs + [fw.CHECKPOINT_EVERY] * runs

  checkpoints = []

  def simulate(*args, checkpoint, **kwargs):
    checkpoints.append(checkpoint)
    raise _Interrupt

  monkeypatch.setattr(_training.dj, "simulate", simulate)
  task = _training.task_for({"data": "digits", "model": "mlp", "hidden": 16})
  bar = type("Bar", (), {"refresh": lambda self: None})()
  for progress in (fw.RunProgress(bar, str(tmp_path / "ckpt"), 2.5), fw.RunProgress(bar, str(tmp_path / "ckpt"))):
    with pytest.raises(_Interrupt):
      _training.simulate_record(task, optax.sgd(0.1), dj.delays.constant(0), num_updates=10, seed=0, batch_size=8,
                                eval_every=5, progress=progress)
  assert [(c.directory, c.min_interval) for c in checkpoints] == [
      (str(tmp_path / "ckpt"), 2.5), (str(tmp_path / "ckpt"), fw.CHECKPOINT_EVERY)]


def _toy_run(config, spec, seed, progress):
  """The toy's run at module level, so that a worker process can receive it; records its process."""
  progress(config["steps"], config["steps"])
  updates = np.arange(0, config["steps"] + 1, 5)
  error = 1.0 / (1.0 + spec["lr"] * (updates + 1) * (seed + 1))
  return {"metrics": {"test_error": float(error[-1])},
          "curves": {"update": updates, "time": 2.0 * updates, "test_error": error}, "pid": os.getpid(),
          "cache": os.environ.get("JAX_COMPILATION_CACHE_DIR")}


@pytest.mark.slow
def test_runs_in_worker_processes_equal_runs_here(toy_cli, tmp_path, capsys):
  """--jobs 2 performs the runs in spawned processes: the same records and tables as performed here."""
  main, _, repro = toy_cli
  object.__setattr__(repro, "run", _toy_run)
  argv = ["run", "toy", "--no-plot", "--seeds", "2"]
  assert main([*argv, "--out", str(tmp_path / "here")]) == 0
  assert main([*argv, "--out", str(tmp_path / "pool"), "--jobs", "2"]) == 0
  here = sorted((tmp_path / "here" / "runs").iterdir())
  assert len(here) == 4
  caches, workers = set(), {}
  for path in here:
    a, b = (json.loads(p.read_text()) for p in (path, tmp_path / "pool" / "runs" / path.name))
    workers.setdefault(b["key"], set()).add(b["pid"])
    assert a.pop("pid") == os.getpid() != b.pop("pid")
    # The workers share one compilation cache, gone with the command; a run here needs none.
    assert a.pop("cache") is None
    caches.add(b.pop("cache"))
    a.pop("seconds"), b.pop("seconds")
    assert a == b
  assert len(caches) == 1 and None not in caches and not os.path.exists(caches.pop())
  # The seeds of a spec share its programs: one worker performs them all, and compiles them once.
  assert sorted(workers) == ["lr0.1", "lr1.0"] and all(len(pids) == 1 for pids in workers.values())
  assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
  results = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("here", "pool")]
  assert results[0]["rows"] == results[1]["rows"] and results[0]["claims"] == results[1]["claims"]
  assert main([*argv, "--out", str(tmp_path / "bad"), "--jobs", "0"]) == 2
  assert "--jobs" in capsys.readouterr().err
  object.__setattr__(repro, "run", lambda config, spec, seed, progress: {})
  assert main([*argv, "--out", str(tmp_path / "lambda"), "--jobs", "2"]) == 2
  assert "module level" in capsys.readouterr().err


def _toy_run_failing_at_seed_2(config, spec, seed, progress):
  """The toy's run, failing at seed 2 of spec lr0.1 (at module level, for a worker process)."""
  if spec["key"] == "lr0.1" and seed == 2:
    raise RuntimeError("run failed on purpose")
  return _toy_run(config, spec, seed, progress)


@pytest.mark.slow
def test_a_worker_saves_each_run_as_it_finishes_it(toy_cli, tmp_path, capsys):
  """--jobs 2: a worker performs a spec's seeds one after the other; those it finished before a run of the same
  spec failed are saved, and a rerun performs only what is missing."""
  main, _, repro = toy_cli
  object.__setattr__(repro, "run", _toy_run_failing_at_seed_2)
  argv = ["run", "toy", "--no-plot", "--seeds", "4", "--out", str(tmp_path / "out"), "--jobs", "2"]
  with pytest.raises(RuntimeError, match="on purpose"):
    main(argv)
  saved = {p.name for p in (tmp_path / "out" / "runs").iterdir() if not p.name.startswith(".")}
  assert {"lr0.1__seed0.json", "lr0.1__seed1.json"} <= saved and "lr0.1__seed2.json" not in saved
  object.__setattr__(repro, "run", _toy_run)
  assert main(argv) == 0
  assert f"{8 - len(saved)} runs performed, {len(saved)} reused" in capsys.readouterr().out


def test_curves_draws_an_error_rate_in_percent_and_any_other_curve_as_it_is(tmp_path, monkeypatch):
  from experiments import _plots

  figures = []
  monkeypatch.setattr(_plots, "save", lambda fig, out, name: figures.append(fig) or name)
  # Curves as run records hold them (read back from JSON): lists.
  records = [{"key": "a", "seed": s, "spec": {"key": "a"}, "metrics": {},
              "curves": {"update": [0, 1, 2], "test_error": [0.5, 0.25, 0.1], "error": [4.0, 2.0, 1.0]}}
             for s in (0, 1)]
  for y in ("test_error", "error"):
    _plots.curves(records, str(tmp_path), y, y=y, xs=("update",))
  rate, distance = (fig.axes[0] for fig in figures)
  # test_error is a rate (*_error): drawn x100 with '(%)'; a curve named `error` (consistency's ||x - x*||^2) is not.
  np.testing.assert_allclose(rate.lines[0].get_ydata(), [50.0, 25.0, 10.0])
  assert rate.get_ylabel() == "test error (%)"
  np.testing.assert_allclose(distance.lines[0].get_ydata(), [4.0, 2.0, 1.0])
  assert distance.get_ylabel() == "error"


def _job(index, key):
  return fw._Job(index, {"key": key}, 0, f"{index}-{key}", "", "")


def test_first_runs_alternate_between_the_halves_of_each_reproduction():
  # Neighbouring specs often share a program: two workers starting them together would both compile it.
  one = [_job(0, f"s{i}") for i in range(8)]
  assert [j.spec["key"] for j in fw.spread_firsts(one)] == ["s0", "s4", "s1", "s5", "s2", "s6", "s3", "s7"]
  odd = [_job(0, f"s{i}") for i in range(5)]
  assert [j.spec["key"] for j in fw.spread_firsts(odd)] == ["s0", "s3", "s1", "s4", "s2"]
  mixed = [_job(0, "a0"), _job(0, "a1"), _job(1, "b0"), _job(1, "b1"), _job(1, "b2"), _job(1, "b3"), _job(2, "c0")]
  assert [j.spec["key"] for j in fw.spread_firsts(mixed)] == ["a0", "a1", "b0", "b2", "b1", "b3", "c0"]
  assert fw.spread_firsts([]) == []


def test_remembered_makes_once_and_keeps_the_newest():
  made = []

  def make(v):
    return lambda: made.append(v) or v * 10

  store = {}
  assert [fw.remembered(store, k, make(k), kept=2) for k in (1, 1, 2, 3, 2)] == [10, 10, 20, 30, 20]
  assert made == [1, 2, 3] and list(store) == [2, 3]  # 1, the oldest, went when 3 came; 2 was not made again
  unbounded = {}
  for k in range(5):
    fw.remembered(unbounded, k, make(k))
  assert list(unbounded) == [0, 1, 2, 3, 4]
