"""experiments.pipeline_stashing: the variants' settings and the claims' arithmetic on made-up per-seed values."""

import math

from experiments import pipeline_stashing as repro


def _summary(per_seed: dict[str, list[float]]) -> dict:
  return {key: {"per_seed": {"train_loss": dict(enumerate(values))}} for key, values in per_seed.items()}


def test_variants():
  specs = {s["key"]: s for s in repro.specs(repro.SCALES["quick"])}
  assert specs["1f1b-stash"]["weights"] == "stash" and specs["1f1b-no-stash"]["weights"] == "latest"
  assert specs["1f1b-no-stash"]["backward"] == "stored" and specs["1f1b-no-stash-recompute"]["backward"] == "recompute"
  assert specs["1f1b-no-stash+spectrain"]["predict"] and not specs["1f1b-no-stash"]["predict"]


def test_claims_arithmetic():
  stash = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10]
  plain = [0.30, 0.32, 0.29, 0.31, 0.30, 0.33]
  summary = _summary({"1f1b-stash": stash, "1f1b-no-stash": plain,
                      "1f1b-no-stash+spectrain": [p - 0.75 * (p - s) + d for p, s, d in
                                                  zip(plain, stash, [0.0, 0.01, -0.01, 0.0, 0.005, -0.005])]})
  assert repro._no_stash_worse(summary).verdict == "held"
  recovered = repro._prediction_recovers(summary)
  assert recovered.verdict == "held" and math.isclose(recovered.comparison.mean, 0.75, abs_tol=0.02)
  assert repro._prediction_helps(summary).verdict == "held"
  # Stashing worse than no stashing: the first claim is not held (the difference is stash - no-stash, claimed < 0).
  summary = _summary({"1f1b-stash": plain, "1f1b-no-stash": stash, "1f1b-no-stash+spectrain": stash})
  assert repro._no_stash_worse(summary).verdict == "not held"
  # Prediction that recovers a tenth of the gap: not most of it.
  summary = _summary({"1f1b-stash": stash, "1f1b-no-stash": plain,
                      "1f1b-no-stash+spectrain": [p - (0.1 + d) * (p - s) for p, s, d in
                                                  zip(plain, stash, [0.0, 0.02, -0.02, 0.01, -0.01, 0.0])]})
  assert repro._prediction_recovers(summary).verdict == "not held"


def test_no_gap_is_not_decided():
  same = [0.2, 0.3, 0.25]
  summary = _summary({"1f1b-stash": same, "1f1b-no-stash": same, "1f1b-no-stash+spectrain": [0.1, 0.2, 0.15]})
  assert repro._prediction_recovers(summary).verdict == "not evaluated"
