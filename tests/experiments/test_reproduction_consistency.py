"""The consistency reproduction's B-within-tau-M claim: its sign, and that the worst paradigm decides it."""

from __future__ import annotations

from experiments import consistency


def _row(part: str, b_prior: list[float], b_max: list[float]) -> dict:
  return {"part": part, "per_seed": {"b_prior": dict(enumerate(b_prior)), "b_max": dict(enumerate(b_max))}}


def test_b_within_tau_m_holds_when_every_paradigm_is_below_its_bound():
  summary = {"torn-tau0": _row("torn", [0.0] * 4, [0.0] * 4),  # tau 0 is no bound to check
             "torn-tau4": _row("torn", [10.0, 10.2, 9.9, 10.1], [5.0, 5.3, 4.8, 5.1]),
             "pull-H8": _row("elastic", [20.4] * 4, [19.0, 19.2, 18.9, 19.1])}
  result = consistency._b_within_tau_m(summary)
  assert result.verdict == "held"
  assert "tau_max M - B_max, pull-H8: +1.35 " in result.figures
  assert "torn-tau0" not in result.figures


def test_b_within_tau_m_is_decided_by_the_worst_paradigm():
  # One paradigm above its bound on every seed makes the claim not held, however far below the others are.
  summary = {"torn-tau4": _row("torn", [10.0, 10.2, 9.9, 10.1], [5.0, 5.3, 4.8, 5.1]),
             "asp-M16": _row("elastic", [200.0, 210.0, 190.0, 205.0], [90.0, 100.0, 95.0, 92.0]),
             "pull-H8": _row("elastic", [20.4] * 4, [21.0, 21.3, 20.9, 21.2])}
  result = consistency._b_within_tau_m(summary)
  assert result.verdict == "not held"
  assert result.comparison.what == "tau_max M - B_max, pull-H8"
