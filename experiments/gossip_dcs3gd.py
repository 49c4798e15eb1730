"""DC-S3GD against stale-synchronous decentralized SGD without delay compensation (Rigazzi 2019).

Sixteen replicas train softmax regression on the digits, each on one or
two classes (label shards). In synchronous rounds (the D-PSGD schedule on
the complete graph: read, all-reduce of the local models in flight,
apply), ``dj.gossip.dc_s3gd`` gives every replica the all-reduced model
one step late and continues from it with its own update, so each gradient
is computed at a local model that differs from the agreed one by the
replica's own last update minus everyone's: a staleness of one round,
which costs much with label shards (the replicas' updates point different
ways). Compared on the same schedule, seeds and minibatches, on the
replica runtime ``dj.simulate_gossip``:

- ``allreduce``: synchronous all-reduce SGD (no staleness), the reference
  that shows what the staleness costs;
- ``stale``: the same stale-synchronous scheme without compensation
  (``dc_s3gd(lam=0)``);
- ``dc_s3gd-0.04``: with DC-ASGD's first-order correction at
  ``lambda = 0.04`` (MXNet's DC-ASGD default, the library's default);
- ``dc_s3gd-1``: at ``lambda = 1``, where ``g * g`` is DC-ASGD's
  outer-product approximation of the Hessian without variance control.

(the setting ``lams`` lists the lambdas run). Both values of lambda were fixed before any run from those two sources;
none was chosen by the verdict. The lr, batch, workers and communication
time are those of the other gossip reproductions. A first probe (2 seeds,
100 rounds) showed that at lambda = 0.04 the correction changes the loss
only in the fourth decimal: ``g * g`` is small here. Note that DC-S3GD's
exact algorithm could not be confirmed from a public source (see
``dj.gossip.dc_s3gd``): this reproduces the library's construction of it.

    python -m experiments run gossip_dcs3gd
"""

from __future__ import annotations

from typing import Any

import delayjax as dj
from . import _gossip_train as gt
from ._framework import Claim, ClaimResult, Reproduction, Summary, paired

# Seeds: 5 (were 3). A run's later seeds now reuse its compiled program (about 0.2 CPU s each), so the quick
# scale affords 5; nothing else changed. Verdicts are the same with 3 and 5 seeds: staleness costs (allreduce -
# stale -0.2029 [-0.2186, -0.1871], then -0.2026 [-0.2094, -0.1958]: held), and neither lambda compensates it
# (0.04: +2.499e-05 [-7.398e-05, +0.000124], then +3.126e-05 [-8.135e-06, +7.065e-05]; 1: +0.0005429 [-0.001801,
# +0.002887], then +0.0006635 [-0.0002589, +0.001586]: inconclusive).
# Seeds: 15 (were 5). At 5 the per-seed standard deviations of the two differences were 3.2e-05 and 7.4e-04;
# 15 is the fewest at which a t interval excludes zero for differences of the sizes measured, fixed before seeds
# 5-14 ran. Nothing else changed. With 15 both compensation claims are not held: the compensated runs end above
# the uncompensated one (0.04: +3.4e-05 [+2.0e-05, +4.8e-05]; 1: +7.1e-04 [+3.9e-04, +1.0e-03]).
SCALES = {
    "quick": dict(speeds=[1.0] * 16, compute="exponential", comm=0.05, steps=80, batch=16, lr=0.5,
                  momentum=0.0, shards="label", target_loss=0.7, evals=10, seeds=15, runtime="dj",
                  lams=[0.04, 1.0]),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  rounds = {"paradigm": "d_psgd", "topology": "complete"}
  return [{"key": "allreduce", "paradigm": "allreduce", "lam": None},
          {"key": "stale", **rounds, "lam": 0.0},
          *({"key": f"dc_s3gd-{lam:g}", **rounds, "lam": lam} for lam in config["lams"])]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  if spec["lam"] is None:
    return gt.run_spec(config, spec, seed, progress, method=lambda schedule: dj.gossip.d_psgd())
  return gt.run_spec(config, spec, seed, progress, method=lambda schedule: dj.gossip.dc_s3gd(spec["lam"]))



def _staleness_costs(summary: Summary) -> ClaimResult:
  s, a = summary["stale"], summary["allreduce"]
  return ClaimResult.decide(paired(summary, "allreduce", "stale", "loss"),
                            f"final loss: all-reduce {a['loss']:.4f}, stale-synchronous {s['loss']:.4f}")


def _compensates(summary: Summary, key: str) -> ClaimResult:
  d, s = summary[key], summary["stale"]
  return ClaimResult.decide(paired(summary, key, "stale", "loss"),
                            f"final loss: {key} {d['loss']:.4f}, uncompensated {s['loss']:.4f} (all-reduce "
                            f"{summary['allreduce']['loss']:.4f})")


CLAIMS = [
    Claim("staleness-costs", "In this setting the one-round staleness costs something: the stale-synchronous "
          "scheme ends above all-reduce SGD's loss", _staleness_costs),
    Claim("dc_s3gd-0.04-compensates", "DC-S3GD (lambda = 0.04) ends below the uncompensated stale-synchronous "
          "scheme's loss", lambda s: _compensates(s, "dc_s3gd-0.04")),
    Claim("dc_s3gd-1-compensates", "DC-S3GD (lambda = 1) ends below the uncompensated stale-synchronous scheme's "
          "loss", lambda s: _compensates(s, "dc_s3gd-1")),
]


# No paper_numbers: only the abstract was reachable, and it states no figure ("state-of-the-art results" with
# large batches, no value).
REPRODUCTION = Reproduction(
    name="gossip_dcs3gd",
    paper="Rigazzi: DC-S3GD: Delay-Compensated Stale-Synchronous SGD for Large-Scale Decentralized Neural Network "
          "Training, 2019",
    description="Stale-synchronous decentralized SGD with and without DC-ASGD's delay compensation on 16 "
                "replicas, against all-reduce SGD: loss.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("lam"), claims=CLAIMS, plots=gt.plots,
    columns=("key", "loss", "loss_half", "test_error", "mean_consensus", "gradients_to_target", "simulated_time"),
    # Each lambda compiles its own program: the smoke run keeps one (the other's claim is then not evaluated).
    smoke=dict(steps=6, seeds=1, evals=2, lams=[1.0]),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
