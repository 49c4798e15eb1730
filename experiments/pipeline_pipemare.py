"""PipeMare (Yang et al. 2021): a deep asynchronous pipeline diverges where a shallow one trains; rescheduling fixes it.

One 8-layer MLP on digits is cut into a shallow (2-stage) or a deep (8-stage)
asynchronous pipeline without weight stashing (PipeMare's setting: the
backward pass runs at the stage's current weights, here in the form that
recomputes the stage's forward pass at them), one micro-batch per
update, so stage ``k``'s forward pass is ``K - 1 - k`` updates stale. At a
learning rate the shallow pipeline tolerates, plain SGD on the deep one
diverges; PipeMare's learning-rate rescheduling (each stage's step divided by
its delay at first, annealed to the base step over ``warmup`` updates) and
its discrepancy correction are then added. A run counts as diverged when its
final training loss is not finite or above chance level (ln 10).

    python -m experiments run pipeline_pipemare
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from . import pipeline_common as pc
from ._framework import (Claim, ClaimResult, Comparison, Reproduction, Summary, compare, mean_rows,
                                    paired, seed_values)

# Config. The setting was chosen on exploration seeds (100, 101) that the claims never use; the claims are
# decided on seeds 0-2 of the run itself. What was tried (300 updates, 8-layer width-32 MLP, final training loss,
# "fails" = above ln 10 or not finite):
# - plain SGD, K=2 against K=8: lr 0.6: K=2 trains (1.21, 0.47), K=8 fails (2.55, 2.31); lr 0.7: K=2 trains
#   (1.31, 0.69), K=8 fails; lr 1.0: both fail. Earlier, at lr 0.5, K=8 trained badly (1.64) without failing.
# - a deeper pipeline, 16 layers cut into 2 or 16 stages: K=2 already fails at lr 0.3 (the deep tanh net itself is
#   unstable), so depth 8 stays.
# - SGD with momentum 0.9, lr 0.05: K=2 trains (0.64, 0.67), K=8 fails (2.71, 2.34), but PipeMare with warmup = the
#   run fails too (with and without correction): dropped.
# - PipeMare at lr 0.7: warmup = half the run fails on both seeds (the loss climbs once the step reaches alpha);
#   warmup = the run fails on one; a warmup far beyond the run (alpha / tau_i throughout) ends at 1.64, 1.63.
# - PipeMare at lr 0.6: warmup = the run ends at 1.83, 2.27; alpha / tau_i throughout at 1.98, 1.50; with
#   discrepancy correction 0.56, 1.86.
# Chosen: lr 0.6 and the paper's rule with its annealing completed within the run (warmup = steps), so the last
# updates take the full step; 3 seeds. Its first run (seeds 0-2): K=2 trained on all (0.61-0.73); K=8 SGD failed on
# 2 of 3, PipeMare on 1 of 3, with correction on 1 of 3, and the deep runs that did not fail ended near chance
# (1.7-2.3), so every claim was inconclusive: at this scale the deep pipeline does not blow up cleanly but wanders
# around chance level, and rescheduling does not make it train.
# Seeds: 5 since a run's later seeds reuse its compiled program (20 runs in 61 CPU s; 12 took 52); nothing else
# changed. The verdicts stay inconclusive: K=8 SGD diverged on 3 of 5 (fraction +0.6 [-0.08009, +1.28]), PipeMare on
# 3 of 5 too, and correction lowered the loss on 3 of the 4 seeds without a tie (sign test p = 0.312).
# Setting and seeds at quick scale (issue 28): lr 0.8 (was 0.6), warmup 3000 (was 300), 16 seeds (was 5). At lr 0.6
# the run cannot show the first claim's premise: the deep pipeline diverged on 2 of 5 seeds, a fraction at the 0.5
# margin that no affordable number of seeds decides. Chosen on exploration seeds 1000-1003, which the claims never
# use: the learning rate is the smaller of {0.7, 0.8} at which plain SGD on the deep pipeline diverged on every
# exploration seed while the shallow one trained on every one; PipeMare's warmup is the one of {300 (= the run), 600,
# 3000} at which it trained on the most exploration seeds at that rate. Seen: lr 0.7: K=2 trained on 4 of 4
# (0.43-0.97), K=8 SGD diverged on 3 of 4; lr 0.8: K=2 trained on 4 of 4 (0.72-1.38), K=8 SGD diverged on 4 of 4;
# PipeMare at lr 0.8 trained on 0 of 4 (warmup 300 and 600) and 1 of 4 (3000, ending at 1.90), with correction on
# 2 of 4 (3000: 1.46, 1.36). At warmup 3000 the delay's exponent falls only from 1 to 0.9 within the 300 updates:
# nearly alpha / tau_i throughout. Seeds: 16, for the diverged fractions, 0/1 per seed, compared with 0.5: with up
# to 4 of 16 seeds against the majority the interval still clears 0.5 (12 of 16: mean 0.75, half-width near 0.24),
# and the correction's sign test needs at least 6 seeds on which the two runs do not both diverge. 4 seeds of the 4
# specs took 63 CPU s on a loaded machine (about 51 s of it compiling and starting), so 16 seeds should take near
# 115 CPU s, within twice the 5-seed run's 71 s.
# Result (16 seeds, 111 CPU s): K=8 SGD diverged on 16 of 16, K=2 on 2 of 16 (0.125 [-0.057, +0.31]): held;
# PipeMare diverged on 13 of 16 (0.81 [0.60, 1.03]): rescheduling does not make the deep pipeline train, not held;
# correction lowered the loss on 8 of the 10 seeds without a tie (sign test p = 0.055, 6 ties): inconclusive.
# Seeds at quick scale: 24 (issue 28; were 16), nothing else changed, fixed before seeds 16-23 ran. This is a second
# look at correction-helps, taken because the first came out near 0.05: its p-value is not that of one test planned
# in advance (looking again because the first look was close raises the chance of a false "held"), so the count is
# fixed here, once, and seeds 0-23 are all reported whatever they show. The 6 ties (seeds 2, 3, 5, 12, 13, 15) are
# seeds on which PipeMare diverged both with and without correction (each counts as an infinite loss, so neither
# lowers it). Of the 10 other seeds, correction trained where plain PipeMare diverged on 7 and ended lower where both
# trained on 1; it ended higher where both trained on 1 and diverged where plain PipeMare trained on 1. If the
# recorded proportions held (10 of 16 seeds untied, 8 of 10 of those on the claimed side), 24 seeds give 15 untied
# with 12 on the claimed side: one-sided p = 0.018. 20 seeds is the smallest count whose expected tallies (12.5
# untied, 10 on the claimed side) fall under 0.05 however they are rounded, but only just (p = 0.019 for 10 of 12,
# 0.046 for 10 of 13); 24 is the next count at which they are whole numbers and clears it. The 16-seed run's later
# seeds took about 4 CPU s for the four specs, so 24 seeds should take near 135 CPU s, within the 220 allowed.
# Result (24 seeds, 138 CPU s; seeds 0-15 as before): K=8 SGD diverged on 24 of 24, K=2 on 3 of 24 (0.125 [-0.018,
# +0.27]): held; PipeMare diverged on 20 of 24 (0.83 [0.67, 0.99]): not held; correction lowered the loss on 13 of
# the 16 seeds without a tie (sign test p = 0.011, 8 ties, both runs diverged on each): held, at a second look.
# Two looks were taken at this claim; split the 0.05 between them (0.025 each, a Bonferroni bound that holds
# however the second look was chosen) and the second look's p = 0.011 still clears it (worked out after the run).
SCALES = {
    "quick": dict(layers=8, width=32, shallow=2, deep=8, steps=300, batch=32, lr=0.8, warmup=3000,
                  discrepancy_decay=0.1, eval_every=50, seeds=24),
    "paper": dict(layers=16, width=128, shallow=2, deep=16, steps=5000, batch=64, lr=0.5, warmup=2500,
                  discrepancy_decay=0.1, eval_every=250, seeds=3),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  shallow, deep = config["shallow"], config["deep"]
  return [{"key": f"K{shallow}-sgd", "stages": shallow, "method": "sgd"},
          {"key": f"K{deep}-sgd", "stages": deep, "method": "sgd"},
          {"key": f"K{deep}-pipemare", "stages": deep, "method": "pipemare"},
          {"key": f"K{deep}-pipemare+correction", "stages": deep, "method": "pipemare+correction"}]


def _plan(config: dict[str, Any], spec: dict[str, Any], seed: int) -> pc.Training:
  del seed
  sched = dj.cluster.pipeline("1f1b", spec["stages"], config["steps"], weights="latest")
  momentum = config.get("momentum", 0.0)
  if spec["method"] == "sgd":
    tx = optax.sgd(config["lr"], momentum=momentum or None)
  else:
    decay = config["discrepancy_decay"] if spec["method"] == "pipemare+correction" else None
    tx = dj.pipemare(config["lr"], warmup_steps=config["warmup"], momentum=momentum, discrepancy_decay=decay)
  return pc.Training(config, sched, tx)


run, run_batch = pc.runners(_plan, pc.as_trained)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("stages", "method"))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"])
  return rows


def _row(summary: Summary, depth: str, method: str) -> dict[str, Any]:
  """The row of the shallow or the deep pipeline (fewest or most stages) trained with ``method``."""
  sizes = [r["stages"] for r in summary.values()]
  stages = min(sizes) if depth == "shallow" else max(sizes)
  return next(r for r in summary.values() if r["stages"] == stages and r["method"] == method)


def _diverged(summary: Summary, depth: str, method: str, claim: str) -> Comparison:
  row = _row(summary, depth, method)
  return compare(seed_values(summary, row["key"], "diverged"), claim=claim, margin=0.5,
                 what=f"diverged fraction of {row['key']}")


def _deep_diverges(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([_diverged(summary, "deep", "sgd", "greater"),
                             _diverged(summary, "shallow", "sgd", "less")])


def _rescheduling_fixes(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([_diverged(summary, "deep", "sgd", "greater"),
                             _diverged(summary, "deep", "pipemare", "less")])


def _correction(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, _row(summary, "deep", "pipemare+correction")["key"],
                                   _row(summary, "deep", "pipemare")["key"], "train_loss"))


CLAIMS = [
    Claim("deep-diverges", "without rescheduling the deep pipeline diverges at a learning rate the shallow one "
                           "tolerates", _deep_diverges),
    Claim("rescheduling-fixes", "PipeMare's learning-rate rescheduling makes the deep pipeline train",
          _rescheduling_fixes),
    Claim("correction-helps", "discrepancy correction lowers the deep pipeline's loss further", _correction),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  return [_plots.curves(records, out, "loss_vs_updates", y="train_loss", ylabel="training loss", log_y=True,
                        xs=("update",))]


# No paper_numbers: only the abstract was reachable; its memory and pipeline-utilization gains fit no row.
REPRODUCTION = Reproduction(
    name="pipeline_pipemare",
    paper="Yang, Zhang, Li, Ré, Aberger, De Sa: PipeMare: Asynchronous Pipeline Parallel DNN Training, MLSys 2021",
    description="One 8-layer MLP as a 2-stage and an 8-stage asynchronous pipeline: SGD, PipeMare's rescheduling "
                "and discrepancy correction.",
    scales=SCALES, specs=specs, run=run, batch=pc.batch_key, run_batch=run_batch, summarize=summarize, claims=CLAIMS,
    plots=plots,
    columns=("key", "train_loss", "accuracy_pct", "diverged", "mean_staleness"),
    smoke=dict(steps=8, eval_every=4, seeds=1, width=8, layers=4, deep=4, warmup=8),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
