"""Synchronous pipelines against asynchronous ones in simulated time: bubbles against staleness.

The same MLP on digits, cut into K stages, trains with ``m`` micro-batches per
mini-batch (one update per mini-batch) on GPipe (flush every mini-batch: no
staleness, a bubble of :math:`(K - 1)/(m + K - 1)` of every stage's time) and on
PipeDream's asynchronous 1F1B (no flush: almost no bubble, stage ``k``'s
forward pass a fraction of an update stale), with and without weight
stashing. A backward pass takes twice a forward pass. Reported: the bubble
fraction, simulated seconds per update, and the accuracy against updates
and against simulated time.

    python -m experiments run pipeline_bubbles
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

import delayjax as dj
from . import _plots
from . import pipeline_common as pc
from ._framework import Claim, ClaimResult, Reproduction, Summary, mean_rows, paired
from ._training import first_reach

# Config: at lr 0.2 with momentum 0.9 both asynchronous runs diverged in a first quick run (GPipe did not); lr 0.05.
# Seeds: 5 (were 2). A run's later seeds now reuse its compiled program (about 0.5 CPU s each), so the quick scale
# can afford the 5 seeds its claims need; nothing else changed. With 2 seeds both comparisons were inconclusive
# (updates to the target gpipe - 1f1b-stash: -75 [-392.7, +242.7]; seconds 1f1b-stash - gpipe: +346.5
# [-4895, +5588]); with 5, per update GPipe is better (-75 [-124.1, -25.92]; against 1f1b-no-stash -65 [-100.4,
# -29.61]: held) while the simulated-time comparison stays within the noise (+369 [-356.5, +1095]).
# Seeds: 12 (were 5), the count at which a t interval is about half as wide as at 5, fixed before seeds 5-11 ran
# (a run costs about 1 CPU s); nothing else changed. With 12, asynchronous 1F1B is not sooner than GPipe in
# simulated time: +315 [+16, +614] s (not held); the other two claims are held as before.
SCALES = {
    "quick": dict(stages=4, layers=4, width=64, microbatches=4, steps=300, batch=8, lr=0.05, momentum=0.9,
                  target_accuracy=0.9, eval_every=25, seeds=12),
    "paper": dict(stages=8, layers=8, width=256, microbatches=8, steps=4000, batch=16, lr=0.1, momentum=0.9,
                  target_accuracy=0.95, eval_every=100, seeds=3),
}

VARIANTS = {"gpipe": ("gpipe", "stash"), "1f1b-stash": ("1f1b", "stash"), "1f1b-no-stash": ("1f1b", "latest")}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": key, "schedule": s, "weights": w} for key, (s, w) in VARIANTS.items()]


def _plan(config: dict[str, Any], spec: dict[str, Any], seed: int) -> pc.Training:
  del seed
  sched = dj.cluster.pipeline(spec["schedule"], config["stages"], config["steps"],
                              num_microbatches=config["microbatches"], weights=spec["weights"],
                              forward=1.0, backward=2.0)
  return pc.Training(config, sched, optax.sgd(config["lr"], momentum=config["momentum"]))


def _finish(config: dict[str, Any], spec: dict[str, Any], sched: dj.cluster.PipelineSchedule,
            record: dict[str, Any]) -> dict[str, Any]:
  del spec
  target = 1.0 - config["target_accuracy"]
  curves = record["curves"]
  for x in ("time", "update"):
    reach = first_reach(curves[x], curves["test_error"], target)
    record["metrics"][f"{x}_to_target"] = reach if np.isfinite(reach) else None
  record["metrics"]["seconds_per_update"] = sched.total_time / sched.num_updates
  return record


run, run_batch = pc.runners(_plan, _finish)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("schedule", "weights"))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"])
    r["stages"], r["microbatches"] = config["stages"], config["microbatches"]
  return rows


def _gpipe_bubble(summary: Summary) -> ClaimResult:
  K, m = summary["gpipe"]["stages"], summary["gpipe"]["microbatches"]
  want, got, other = (K - 1) / (m + K - 1), summary["gpipe"]["bubble_fraction"], summary["1f1b-stash"]["bubble_fraction"]
  return ClaimResult(abs(got - want) < 1e-9 and other < got,
                     f"GPipe bubble {got:.3f} (closed form (K-1)/(m+K-1) = {want:.3f}); 1F1B {other:.3f}")


def _async_sooner(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, "1f1b-stash", "gpipe", "time_to_target"))


def _sync_per_update(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([paired(summary, "gpipe", "1f1b-stash", "update_to_target"),
                             paired(summary, "gpipe", "1f1b-no-stash", "update_to_target")])


CLAIMS = [
    Claim("gpipe-bubble", "GPipe idles (K-1)/(m+K-1) of the time; asynchronous 1F1B much less", _gpipe_bubble),
    Claim("async-sooner", "asynchronous 1F1B reaches the target accuracy sooner in simulated time than GPipe",
          _async_sooner),
    Claim("sync-per-update", "per update, the synchronous pipeline is better: it reaches the target in fewer updates",
          _sync_per_update),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
  for ax, (key, (schedule, weights)) in zip(axes, [("gpipe", VARIANTS["gpipe"]), ("1f1b", VARIANTS["1f1b-stash"])]):
    sched = dj.cluster.pipeline(schedule, config["stages"], 2, num_microbatches=config["microbatches"],
                                weights=weights, forward=1.0, backward=2.0)
    dj.cluster.plot_pipeline(sched, ax=ax)
  fig.tight_layout()
  path = f"{out}/pipeline_timelines.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [_plots.curves(records, out, "error_vs_time", xs=("update", "time")), path]


# No paper_numbers: only the two abstracts were reachable. GPipe's figures are model results (84.4% top-1 on
# ImageNet with a 557M-parameter AmoebaNet, a 6B-parameter Transformer), PipeDream's a speed-up (up to 5.3x) over
# intra-batch parallelism, which no row runs; neither gives a bubble fraction or a time to accuracy for these rows.
REPRODUCTION = Reproduction(
    name="pipeline_bubbles",
    paper="Huang et al.: GPipe, NeurIPS 2019; Narayanan et al.: PipeDream, SOSP 2019",
    description="GPipe against asynchronous 1F1B (with and without stashing) on 4 stages, 4 micro-batches: "
                "bubbles against staleness, in simulated time.",
    scales=SCALES, specs=specs, run=run, batch=pc.batch_key, run_batch=run_batch, summarize=summarize, claims=CLAIMS,
    plots=plots,
    columns=("key", "accuracy_pct", "bubble_fraction", "seconds_per_update", "time_to_target", "update_to_target",
             "mean_staleness"),
    smoke=dict(steps=8, eval_every=4, seeds=1, width=8, stages=2, layers=2, microbatches=2),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
