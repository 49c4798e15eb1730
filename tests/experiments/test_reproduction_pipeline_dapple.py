"""experiments.pipeline_dapple: the activation counts, the budget variants and the claims' arithmetic."""

import numpy as np
import pytest

import delayjax as dj
from experiments import pipeline_dapple as repro

CONFIG = dict(repro.SCALES["quick"])


def _in_flight_by_hand(order: list[tuple[str, int]]) -> int:
  """Most micro-batches between their forward and their backward pass in one stage's operation order."""
  held, most = set(), 0
  for kind, n in order:
    if kind == "F":
      held.add(n)
      most = max(most, len(held))
    else:
      held.remove(n)
  return most


def _one_f_one_b_by_hand(k: int, K: int, m: int) -> list[tuple[str, int]]:
  warm = min(K - 1 - k, m)
  order = [("F", n) for n in range(warm)]
  for i in range(m - warm):
    order += [("F", warm + i), ("B", i)]
  return order + [("B", n) for n in range(m - warm, m)]


@pytest.mark.parametrize("K,m", [(4, 8), (3, 5), (4, 16), (2, 1)])
def test_activations_from_the_schedule_match_a_hand_count(K, m):
  """DAPPLE's stage k holds min(K - k, m) micro-batches, GPipe's all m; the schedule's count (with random times)
  agrees with the count from each stage's operation order."""
  gamma = dict(forward=dj.cluster.gamma(4.0, 1.0), backward=dj.cluster.gamma(4.0, 2.0))
  dapple = dj.cluster.pipeline("dapple", K, 2, num_microbatches=m, seed=3, **gamma).activations_kept()
  gpipe = dj.cluster.pipeline("gpipe", K, 2, num_microbatches=m, seed=3, **gamma).activations_kept()
  hand = [_in_flight_by_hand(_one_f_one_b_by_hand(k, K, m)) for k in range(K)]
  assert dapple.tolist() == hand == [min(K - k, m) for k in range(K)]
  assert gpipe.tolist() == [m] * K


def test_variants_and_the_budget_setting():
  specs = {s["key"]: s for s in repro.specs(CONFIG)}
  K = CONFIG["stages"]
  assert specs["gpipe"]["microbatches"] == specs["dapple"]["microbatches"] == CONFIG["microbatches"]
  assert specs["gpipe-budget"]["microbatches"] == K  # GPipe holds m: the budget of K micro-batches allows m = K
  assert specs["dapple-budget"]["microbatches"] == CONFIG["budget_microbatches"] > K
  assert [s["trained"] for s in specs.values()] == [True, True, False, False]
  # The budget variants hold the same activations, K micro-batches at most.
  for key in ("gpipe-budget", "dapple-budget"):
    record = repro.run(CONFIG, specs[key], 0, lambda done, total: None)
    assert record["metrics"]["activations_kept_max"] == K
  # With equal pass times, the throughput ratio at the budget is the closed form (16/19) / (4/7).
  m_d, m_g = CONFIG["budget_microbatches"], K
  times = {m: dj.cluster.pipeline("dapple", K, 3, num_microbatches=m, forward=1.0, backward=2.0).total_time
           for m in (m_g, m_d)}
  ratio = (3 * m_d / times[m_d]) / (3 * m_g / times[m_g])
  assert ratio == pytest.approx((m_d / (m_d + K - 1)) / (m_g / (m_g + K - 1)))


def _summary(**per_seed):
  return {key: {"per_seed": values} for key, values in per_seed.items()}


def test_claims_arithmetic():
  loss = {0: 0.5, 1: 0.4, 2: 0.6}
  s = _summary(gpipe={"train_loss": loss, "examples_per_second": {0: 1.0, 1: 1.1, 2: 0.9}},
               dapple={"train_loss": dict(loss), "examples_per_second": {0: 1.01, 1: 1.11, 2: 0.905}})
  assert repro._same_training(s).verdict == "held"
  assert repro._same_throughput(s).verdict == "held"
  s["dapple"]["per_seed"]["train_loss"] = {0: 0.45, 1: 0.35, 2: 0.55}
  assert repro._same_training(s).verdict == "not held"
  s["dapple"]["per_seed"]["examples_per_second"] = {0: 1.2, 1: 1.32, 2: 1.08}  # 20% faster: outside the 5% band
  assert repro._same_throughput(s).verdict == "not held"
  budget = _summary(**{"gpipe-budget": {"activations_kept_max": {0: 4, 1: 4},
                                        "examples_per_second": {0: 1.0, 1: 1.0}},
                       "dapple-budget": {"activations_kept_max": {0: 4, 1: 4},
                                         "examples_per_second": {0: 1.47, 1: 1.45}}})
  assert repro._budget_speedup(budget).verdict == "held"
  # More memory than GPipe: not the same budget.
  budget["dapple-budget"]["per_seed"]["activations_kept_max"] = {0: 5, 1: 5}
  assert repro._budget_speedup(budget).verdict == "not held"
  np.testing.assert_equal(repro.microbatches(CONFIG, "K"), CONFIG["stages"])
