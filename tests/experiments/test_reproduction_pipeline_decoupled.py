"""experiments.pipeline_decoupled: equal examples per update, the staleness ADL's accumulation leaves, the claims."""

import math

import numpy as np
import pytest

from experiments import pipeline_decoupled as repro

CONFIG = dict(repro.SCALES["quick"], steps=40)


def _forward_versions_by_hand(k: int, K: int, m: int, U: int) -> list[int]:
  """Stage ``k``'s weight version at each of its forward passes, from its operation order alone: ``K - 1 - k``
  warm-up forwards, then one forward and one backward, an update after the backward of a mini-batch's last
  micro-batch. A stage's version counts its own updates, so the order decides it whatever the times."""
  N = U * m
  warm = min(K - 1 - k, N)
  order = [("F", n) for n in range(warm)]
  for i in range(N - warm):
    order += [("F", warm + i), ("B", i)]
  order += [("B", n) for n in range(N - warm, N)]
  version, out = 0, [0] * N
  for kind, n in order:
    if kind == "F":
      out[n] = version
    elif (n + 1) % m == 0:
      version += 1
  return out


def test_every_spec_sees_the_same_examples():
  specs = {s["key"]: s for s in repro.specs(CONFIG)}
  M, b = CONFIG["accumulate"], CONFIG["batch"]
  assert {s["micro_batch"] * s["microbatches"] for s in specs.values()} == {M * b}
  assert (specs["adl"]["microbatches"], specs["decoupled"]["microbatches"], specs["sync"]["microbatches"]) == (M, 1, M)
  assert specs["dsp"]["compensate"] and not specs["decoupled"]["compensate"]
  for key, spec in specs.items():
    sched = repro.schedule_for(CONFIG, spec, 0)
    assert sched.num_passes * spec["micro_batch"] == CONFIG["steps"] * M * b, key


@pytest.mark.parametrize("key", ["decoupled", "adl", "sync"])
def test_forward_versions_match_a_hand_count(key):
  """The decoupled schedules' forward versions (with random pass times) are the hand count's; GPipe's are u."""
  spec = next(s for s in repro.specs(CONFIG) if s["key"] == key)
  sched = repro.schedule_for(CONFIG, spec, 7)
  K, m, U = CONFIG["stages"], spec["microbatches"], CONFIG["steps"]
  if key == "sync":
    np.testing.assert_array_equal(sched.forward_version, np.repeat(np.arange(U * m)[:, None] // m, K, axis=1))
    return
  hand = np.array([_forward_versions_by_hand(k, K, m, U) for k in range(K)]).T
  np.testing.assert_array_equal(sched.forward_version, hand)
  np.testing.assert_array_equal(sched.backward_staleness, 0)  # "latest": the backward pass at the current weights


def test_accumulation_cuts_the_staleness_about_m_times():
  specs = {s["key"]: s for s in repro.specs(CONFIG)}
  plain = repro.schedule_for(CONFIG, specs["decoupled"], 0).forward_staleness
  adl = repro.schedule_for(CONFIG, specs["adl"], 0).forward_staleness
  K = CONFIG["stages"]
  assert plain[-1].tolist() == [K - 1 - k for k in range(K)]  # steady state: stage k is K - 1 - k updates stale
  ratio = adl.mean() / plain.mean()
  assert abs(ratio - 1 / CONFIG["accumulate"]) < repro.STALENESS_BAND


def test_gap_closed():
  assert repro.gap_closed(1.0, 0.55, 0.1) == pytest.approx(0.5)
  assert repro.gap_closed(1.0, 0.1, 0.1) == pytest.approx(1.0)
  assert repro.gap_closed(1.0, 1.2, 0.1) < 0
  assert math.isnan(repro.gap_closed(0.3, 0.2, 0.3))


def _summary(rows):
  return {key: {"microbatches": m, "per_seed": values} for key, (m, values) in rows.items()}


def test_claims_arithmetic():
  seeds = range(4)
  loss = {"sync": [0.1, 0.12, 0.09, 0.11], "decoupled": [0.8, 0.7, 0.9, 0.75], "adl": [0.15, 0.14, 0.12, 0.2],
          "dsp": [0.7, 0.6, 0.85, 0.7]}
  speed = {"sync": [1.0] * 4, "decoupled": [1.5, 1.6, 1.55, 1.5], "adl": [1.6, 1.55, 1.6, 1.62], "dsp": [1.5] * 4}
  stale = {"sync": [0.0] * 4, "decoupled": [1.5] * 4, "adl": [0.38] * 4, "dsp": [1.5] * 4}
  M = CONFIG["accumulate"]
  summary = _summary({k: (M if k in ("sync", "adl") else 1,
                          {"train_loss": dict(zip(seeds, loss[k])), "examples_per_second": dict(zip(seeds, speed[k])),
                           "staleness_updates": dict(zip(seeds, stale[k]))}) for k in loss})
  assert repro._closes_gap("adl")(summary).verdict == "held"
  assert repro._closes_gap("dsp")(summary).verdict == "not held"
  assert repro._staleness(summary).verdict == "held"
  assert repro._speedup(summary).verdict == "held"
  summary["adl"]["per_seed"]["staleness_updates"] = dict(zip(seeds, [0.75] * 4))  # half, not a quarter
  assert repro._staleness(summary).verdict == "not held"
  summary["adl"]["per_seed"]["examples_per_second"] = dict(zip(seeds, [0.8, 0.82, 0.79, 0.8]))
  assert repro._speedup(summary).verdict == "not held"
