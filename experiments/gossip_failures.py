"""Asynchronous decentralized SGD with link and node failures (the wireless-edge setting).

Sixteen replicas run asynchronous gossip SGD (each worker averages with a
random neighbour of the exponential graph while it computes, as AD-PSGD)
while links lose messages: each direction of an averaging is lost
independently with probability 0, 20% or 50% (a member whose incoming
message is lost keeps its model, so the averaging is no longer symmetric),
and, in one run, two nodes disappear for a quarter of the run. The claim
of the asynchronous-DSGD-at-the-edge literature is that training still
converges: the loss of the average model reaches the same level, at a
larger consensus distance. "Converges" is checked as: every seed reaches
the target loss, and the loss is still falling (lower at the end than at
half the run); the gap to the lossless run is reported.

    python -m experiments run gossip_failures
"""

from __future__ import annotations

from typing import Any

from . import _gossip_train as gt
from ._framework import Claim, ClaimResult, Reproduction, Summary, compare, paired, seed_values

SCALES = {
    "quick": dict(speeds=[1.0] * 16, compute="exponential", comm=0.05, steps=300, batch=16, lr=0.5,
                  momentum=0.0, shards="label", target_loss=0.5, evals=20, seeds=3),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  # The outage: nodes 3 and 11 gone during the second quarter of the run (steps ~ simulated seconds here).
  quarter = config["steps"] / 4
  # Averaging while the gradient computes ("read"), the schedule these claims were stated and first run on.
  base = {"paradigm": "ad_psgd", "topology": "exponential", "average": "read"}
  return [{"key": "drop-0", **base, "drop": 0.0},
          {"key": "drop-0.2", **base, "drop": 0.2},
          {"key": "drop-0.5", **base, "drop": 0.5},
          {"key": "drop-0.2-outage", **base, "drop": 0.2,
           "down": [[3, quarter, 2 * quarter], [11, quarter, 2 * quarter]]}]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  # Every spec runs one rule: one compiled program for all of them (gt.run_spec's specs).
  return gt.run_spec(config, spec, seed, progress, specs=specs)


def run_batch(config: dict[str, Any], members: list[tuple[dict[str, Any], int]], progress: Any) -> list[dict[str, Any]]:
  # The runs of one seed (gt.batch_key): a dj.simulate_gossip call per rule and shards (gt.call_key), a program's calls
  # in turn, separate programs' side by side.
  return gt.run_specs(config, members, progress, specs=specs)


def _converges(summary: Summary, key: str) -> ClaimResult:
  # Converging: the target loss is reached within the run (a seed that never reaches it counts as infinitely
  # late), and the loss is still falling (lower at the end than at half the run). The gap to the lossless run
  # is reported, not claimed.
  lossy, clean = summary[key], summary["drop-0"]
  reached = paired(summary, key, None, "gradients_to_target", claim="less", margin=lossy["gradients"],
                   what=f"gradients to the target ({key}) against the run's {lossy['gradients']:.0f}")
  falling = compare(seed_values(summary, key, "loss"), seed_values(summary, key, "loss_half"), claim="less",
                    what=f"loss at the end - loss at half the run ({key})")
  return ClaimResult.decide(
      [reached, falling], f"final loss {lossy['loss']:.4f} (lossless {clean['loss']:.4f}); gradients to the target "
      f"{lossy['gradients_to_target']:.0f} (lossless {clean['gradients_to_target']:.0f}); consensus "
      f"{lossy['mean_consensus']:.3g} (lossless {clean['mean_consensus']:.3g})")


CLAIMS = [
    Claim("converges-with-20pct-loss", "With 20% of messages lost, asynchronous DSGD still converges: it reaches "
          "the target loss and its loss is still falling at the end", lambda s: _converges(s, "drop-0.2")),
    Claim("converges-with-outage", "With 20% loss and two nodes gone for a quarter of the run, it still "
          "converges", lambda s: _converges(s, "drop-0.2-outage")),
]


# No paper_numbers: the claim is the literature's, not one paper's experiment, and the rule's paper (Lian et al.,
# ICML 2018) has no run with lost messages or nodes.
REPRODUCTION = Reproduction(
    name="gossip_failures",
    paper="Asynchronous decentralized SGD under link and node failures (the wireless-edge setting); rule of "
          "Lian, Zhang, Zhang, Liu, ICML 2018",
    description="Asynchronous gossip SGD on 16 replicas with 0/20/50% of messages lost and a node outage: loss "
                "and consensus.",
    scales=SCALES, specs=specs, run=run, batch=gt.batch_key, run_batch=run_batch, summarize=gt.summarize_by("drop"),
    claims=CLAIMS, plots=gt.plots,
    columns=("key", "loss", "loss_half", "test_error", "gradients_to_target", "time_to_target", "mean_consensus",
             "simulated_time"),
    smoke=dict(steps=20, seeds=1, evals=4),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
