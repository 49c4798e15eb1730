"""The ksync reproduction's AdaSync claim: within 5% of each seed's best fixed K at the end, ahead of K = P early."""

from __future__ import annotations

import math

from experiments import ksync

_JITTER = [0.0, 0.002, -0.002, 0.001, -0.001, 0.0]


def _row(kind: str, k: int, final: float, fifth: float) -> dict:
  return {"kind": kind, "k": k, "per_seed": {"train_loss": {s: final * math.exp(j) for s, j in enumerate(_JITTER)},
                                             "loss_at_fifth": {s: fifth * math.exp(j) for s, j in enumerate(_JITTER)}}}


def _summary(ada_final: float) -> dict:
  return {"k-sync-K1": _row("k-sync", 1, 1.20, 1.5), "k-sync-K2": _row("k-sync", 2, 1.05, 1.6),
          "k-sync-K8": _row("k-sync", 8, 1.10, 2.0), "adasync-K01": _row("adasync", 1, ada_final, 1.5)}


def test_adasync_within_five_percent_of_the_best_k_and_ahead_early_is_held():
  assert ksync._adasync(_summary(ada_final=1.05 * 1.02)).verdict == "held"


def test_adasync_more_than_five_percent_behind_the_best_k_is_not_held():
  result = ksync._adasync(_summary(ada_final=1.05 * 1.08))
  assert result.verdict == "not held"
  assert result.comparison.what.startswith("log final training loss AdaSync - best fixed K")
