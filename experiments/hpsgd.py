"""HPSGD against synchronous all-reduce SGD, communication overlapped with local training (Zhou et al. 2020).

Eight replicas train softmax regression on the digits (every replica
samples the whole training set), with an all-reduce that costs more than a
gradient (``ceil(log2 M)`` messages in sequence, as in
``experiments/lasgd.py``). Each spec applies the same number of gradients,
on the replica runtime ``dj.simulate_gossip``:

- ``allreduce``: synchronous all-reduce SGD (``dj.cluster.allreduce``): every
  step waits for the all-reduce of the gradients;
- ``hpsgd``: ``dj.gossip.hpsgd`` on ``dj.cluster.lasgd``'s schedule (local
  steps that never wait, all-reduces back to back behind them): each
  replica commits its phase's change when an all-reduce completes, restarts
  from the global model, and the average of the commits reaches the global
  model one phase later;
- ``lasgd``: ``dj.gossip.lasgd`` on the same schedule, whose merge keeps a
  replica's own progress at once (the other rule for the same overlap).

**Only the paper's abstract could be read** (the rule is the authors'
code's, see ``dj.gossip.hpsgd``): HPSGD overlaps synchronization with local
training, remedies the stale gradients with its commit-and-merge update,
"substantially boosts the distributed DNN training" and "achieves better
accuracy in given fixed wall-time". The claims below are those statements
at this scale; the third reads "reduces the disturbance of the stale
gradients" as a comparison with the other merge of the same overlap, which
is the library's reading, not the paper's baseline (not reachable).

    python -m experiments run hpsgd
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import delayjax as dj
from . import _gossip_train as gt
from ._framework import POSITIVE, Claim, ClaimResult, Reproduction, Summary, paired

# Settings fixed before any run: the gossip reproductions' task, 8 equal replicas (the authors' loop is lockstep),
# exponential compute of mean 1 s, 0.5 s a message (an all-reduce of 8: 1.5 s), plain SGD (the authors' optimizer:
# momentum 0) at lr 0.5, batch 16, 100 gradients per replica. target_loss was chosen on one pilot seed (100, outside
# the reported 0-5) after 0.3 (set first) was reached by no spec: all three passed 0.5 (all-reduce at 324 of its 434
# simulated seconds, HPSGD and LASGD both at 78 of 106); their final losses were 0.412, 0.411 and 0.409.
# Result (6 seeds): HPSGD reached the target 243 s [233, 253] sooner than all-reduce SGD (75 s against 318: the
# synchronous steps wait for the slowest replica and for every all-reduce) and was 0.62 [0.57, 0.67] lower in
# training loss after 100 s (0.417 against 1.04): both held. Against LASGD's merge on the same schedule the final
# loss differed by -0.0007 [-0.0026, +0.0011]: inconclusive (their consensus distances, 0.082 and 0.163, differ).
# Seeds at quick scale: 40 (issue 28; were 6), fixed before seeds 6-39 ran, nothing else changed. The metric is the
# claim's: each seed's HPSGD and LASGD runs share the schedule (the same simulated end), the sampling and the start,
# and "loss" is the average model's training loss at that end. In the 6-seed run hpsgd-merge-vs-lasgd's differences
# (HPSGD - LASGD final loss) had a mean of -0.00074 and sd 0.00173 around the margin 0; the half-width t s / sqrt(N)
# is 0.00073 at 24 seeds (on the mean), 0.00065 at 30 and 0.00055 at 40, which would decide it if the mean stayed
# near -0.00074 and leaves it some room to move. A seed costs about 1 CPU s after the first (the programs are
# shared; 20 exploration seeds from 1000 took 38 CPU s in all), so 40 seeds stay near 60 s.
# (Added after that 40-seed run, 54 CPU s: both claims against all-reduce held again, -242 s [-245, -239] and -0.628
# [-0.640, -0.616]; HPSGD - LASGD was -0.00052 [-0.00136, +0.00031], inconclusive, 22 of 40 seeds below 0, sd 0.0026.
# From that mean and sd deciding it would take about 110 seeds, near 130 CPU s, past this reproduction's budget, so
# the seeds stay at 40 and the claim stays inconclusive.)
SCALES = {
    "quick": dict(speeds=[1.0] * 8, compute="exponential", message_seconds=0.5, steps=100, batch=16, lr=0.5,
                  momentum=0.0, shards="iid", target_loss=0.5, evals=50, seeds=40, phases=2),
}
LIMITS = {"message_seconds": POSITIVE, "target_loss": POSITIVE}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  del config
  return [{"key": "allreduce", "paradigm": "allreduce", "method": "d_psgd"},
          {"key": "hpsgd", "paradigm": "lasgd", "method": "hpsgd"},
          {"key": "lasgd", "paradigm": "lasgd", "method": "lasgd"}]


def allreduce_seconds(config: dict[str, Any]) -> float:
  """An all-reduce's duration: ``ceil(log2 M)`` messages of ``message_seconds`` in sequence (recursive doubling)."""
  return config["message_seconds"] * max(1, math.ceil(math.log2(len(config["speeds"]))))


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.GossipSchedule:
  spec_config = {**config, "comm": allreduce_seconds(config)}
  if spec["paradigm"] == "allreduce":
    return gt.schedule_for(spec_config, spec, seed)
  workers = dj.cluster.workers(len(config["speeds"]), compute=config["compute"], comm=spec_config["comm"],
                               speed=config["speeds"])
  return dj.cluster.simulate_gossip(dj.cluster.lasgd(), workers, config["steps"], seed=seed)


def loss_at(record: dict[str, Any], time: float) -> float:
  """The average model's training loss at the last evaluation at or before simulated ``time``."""
  times, losses = np.asarray(record["curves"]["time"]), np.asarray(record["curves"]["loss"])
  return float(losses[np.searchsorted(times, time, side="right") - 1])


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  schedule = schedule_for(config, spec, seed)
  task = gt.digits_task(len(config["speeds"]), config["shards"])
  method = {"d_psgd": dj.gossip.d_psgd, "hpsgd": dj.gossip.hpsgd, "lasgd": dj.gossip.lasgd}[spec["method"]]()
  record = gt.run_replica_runtime(task, schedule, spec["paradigm"], lr=config["lr"], momentum=config["momentum"],
                                  batch=config["batch"], seed=seed, eval_every=gt.eval_every(config, schedule),
                                  shards=config["shards"], method=method,
                                  phases=1 if spec["paradigm"] == "allreduce" else config["phases"])
  progress(1, 1)
  record = gt.finish_record(config, schedule, record)
  # Fixed wall time: ``steps`` gradients of the mean compute time (1 s), about where the overlapped runs end; the
  # synchronous run, which waits for every all-reduce and for the slowest replica, is then about a quarter through.
  record["metrics"]["budget"] = float(config["steps"])
  record["metrics"]["loss_at_budget"] = loss_at(record, record["metrics"]["budget"])
  record["metrics"]["test_error_pct"] = 100 * record["metrics"]["test_error"]
  record["metrics"]["syncs"] = schedule.num_mixes
  return record


def _sooner(summary: Summary) -> ClaimResult:
  budget = max(r["simulated_time"] for r in summary.values())
  h, a = summary["hpsgd"], summary["allreduce"]
  return ClaimResult.decide(
      paired(summary, "hpsgd", "allreduce", "time_to_target", censor=budget),
      f"simulated seconds to the target training loss: HPSGD {h['time_to_target']:.1f}, all-reduce "
      f"{a['time_to_target']:.1f}")


def _better_at_budget(summary: Summary) -> ClaimResult:
  h, a = summary["hpsgd"], summary["allreduce"]
  return ClaimResult.decide(
      paired(summary, "hpsgd", "allreduce", "loss_at_budget"),
      f"training loss after {h['budget']:.0f} simulated seconds: HPSGD {h['loss_at_budget']:.4f}, all-reduce "
      f"{a['loss_at_budget']:.4f}")


def _merge(summary: Summary) -> ClaimResult:
  h, g = summary["hpsgd"], summary["lasgd"]
  return ClaimResult.decide(
      paired(summary, "hpsgd", "lasgd", "loss"),
      f"final training loss on the same schedule: HPSGD {h['loss']:.4f}, LASGD's merge {g['loss']:.4f}")


CLAIMS = [
    Claim("hpsgd-faster-than-allreduce", "With an all-reduce slower than a gradient, HPSGD (synchronization "
          "overlapped with local training) reaches the target training loss sooner in simulated time than "
          "synchronous all-reduce SGD", _sooner),
    Claim("hpsgd-better-at-fixed-time", "At a fixed wall-time budget HPSGD's training loss is lower than all-reduce "
          "SGD's", _better_at_budget),
    Claim("hpsgd-merge-vs-lasgd", "On the same overlapped schedule, HPSGD's commit-and-merge (a replica's own change "
          "waits with the others') ends at a lower training loss than LASGD's merge (own progress kept at once)",
          _merge),
]

# No paper_numbers: only the abstract was reachable, and it states no figure.
REPRODUCTION = Reproduction(
    name="hpsgd",
    paper="Zhou, Ye, Zhang, Lv: HPSGD: Hierarchical Parallel SGD With Stale Gradients Featuring, arXiv 2009.02701, "
          "2020",
    description="HPSGD and LASGD (all-reduce overlapped with local steps) against synchronous all-reduce SGD on 8 "
                "replicas: time to a loss, loss at a fixed time.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("method"), claims=CLAIMS, plots=gt.plots,
    columns=("key", "loss", "loss_at_budget", "test_error_pct", "time_to_target", "gradients_to_target",
             "simulated_time", "mean_consensus", "syncs"),
    smoke=dict(steps=12, seeds=1, evals=4),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
