"""experiments.pipeline_pipemare: the specs and the claims' arithmetic on made-up per-seed values."""

import math

from experiments import pipeline_pipemare as repro


def _summary(rows: dict[str, tuple[int, str, list[float], list[float]]]) -> dict:
  """``{key: (stages, method, diverged per seed, train_loss per seed)}`` as the summary rows the claims read."""
  return {key: {"key": key, "stages": stages, "method": method,
                "per_seed": {"diverged": dict(enumerate(diverged)),
                             "train_loss": dict(enumerate(math.nan if d else x for d, x in zip(diverged, loss)))}}
          for key, (stages, method, diverged, loss) in rows.items()}


def test_specs_cut_one_model_into_a_shallow_and_a_deep_pipeline():
  config = repro.SCALES["quick"]
  specs = repro.specs(config)
  assert [s["stages"] for s in specs] == [config["shallow"]] + [config["deep"]] * 3
  assert config["layers"] % config["shallow"] == 0 and config["layers"] % config["deep"] == 0


def test_claims_arithmetic():
  n = 6
  summary = _summary({"K2-sgd": (2, "sgd", [0] * n, [0.5] * n),
                      "K8-sgd": (8, "sgd", [1] * n, [0.0] * n),
                      "K8-pipemare": (8, "pipemare", [0] * n, [1.5, 1.6, 1.4, 1.7, 1.5, 1.6]),
                      "K8-pipemare+correction": (8, "pipemare+correction", [0] * n, [1.2, 1.3, 1.1, 1.5, 1.2, 1.4])})
  assert repro._deep_diverges(summary).verdict == "held"
  assert repro._rescheduling_fixes(summary).verdict == "held"
  assert repro._correction(summary).verdict == "held"
  # The shallow pipeline diverging too: the deep one does not diverge where the shallow one trains.
  summary["K2-sgd"]["per_seed"]["diverged"] = dict(enumerate([1] * n))
  assert repro._deep_diverges(summary).verdict == "not held"
  # PipeMare diverging on every seed: rescheduling does not make the deep pipeline train.
  summary["K8-pipemare"]["per_seed"]["diverged"] = dict(enumerate([1] * n))
  assert repro._rescheduling_fixes(summary).verdict == "not held"


def test_a_diverged_run_counts_as_infinitely_bad_loss():
  """Correction that diverges where plain PipeMare trains is on the wrong side: the sign test decides."""
  n = 6
  summary = _summary({"K2-sgd": (2, "sgd", [0] * n, [0.5] * n), "K8-pipemare": (8, "pipemare", [0] * n, [1.5] * n),
                      "K8-pipemare+correction": (8, "pipemare+correction", [1] * n, [0.0] * n)})
  result = repro._correction(summary)
  assert result.comparison.test == "sign" and result.verdict == "not held"
