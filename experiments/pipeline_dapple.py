"""DAPPLE's early-backward schedule against GPipe: the same bubble and updates, fewer activations in flight.

DAPPLE (Fan et al., PPoPP 2021) is synchronous pipeline training with a flush
every mini-batch, as GPipe, whose stages start their backward passes early:
stage ``k`` runs ``K - 1 - k`` warm-up forward passes, then one forward, one
backward, so it holds the activations of at most ``K - k`` micro-batches where
GPipe's holds all ``m`` (``dj.cluster.pipeline("dapple", ...)``). Every pass
of mini-batch ``u`` reads version ``u`` in both schedules, so the updates are
the same. Reproduced here with the pipeline simulator and the staged MLP on
digits (``K = 4`` stages, ``m = 8`` micro-batches):

- the bubble and the throughput are GPipe's (examples per simulated second
  within 5%; gamma-distributed pass times, a backward pass twice a forward
  pass on average);
- the peak activation memory, counted from the schedule (micro-batches whose
  activations a stage holds at once, :meth:`PipelineSchedule.activations_kept`),
  is ``K`` on the busiest stage instead of ``m``;
- the trained model is GPipe's, bit for bit (the final training loss differs
  by 0 on every seed);
- the paper's throughput headline, 1.6x over GPipe, comes from the memory the
  schedule saves: with micro-batches of a fixed size (what keeps a device
  efficient) and an activation budget of ``K`` micro-batches per stage, GPipe
  can run at most ``m = K`` micro-batches per update, DAPPLE any number (here
  ``4 K``), so its bubble shrinks. One update takes :math:`(m + K - 1)\\, t`
  (``t`` a micro-batch's forward and backward time), so the examples per
  second are :math:`m / (m + K - 1)` of the ideal: :math:`4/7` for GPipe at
  ``m = K = 4``, :math:`16/19` for DAPPLE at ``m = 16``, a ratio of 1.47.
  Those two schedules are timed, not trained (their updates average
  different numbers of micro-batches).

**Sources.** The paper's abstract and the opening of its full text (ar5iv,
https://ar5iv.labs.arxiv.org/html/2007.01045) were readable with the search
tools; the later sections (the schedule's figures, the planner's algorithm, the
per-model memory tables) were not. The schedule is the one-forward-one-backward
order with a flush, as ``dj.cluster.pipeline``'s docstring gives it; the
headline numbers are the abstract's: the planner up to 3.23x faster than
PipeDream's planner's strategies, the runtime 1.6x GPipe's throughput while
saving 12% of memory. Linear time in the micro-batch size is delayjax's
simplification: on a real accelerator a smaller micro-batch is less efficient,
which the paper's measured 1.6x includes.

**The planner is not reproduced.** DAPPLE's planner chooses, for a model's
profiled layers and a cluster's topology, how many replicas of how many
pipeline stages to run, where to cut the layers and on which devices to place
each stage, minimizing a modelled iteration time (the pipeline's latency plus
the data-parallel all-reduce of each stage's gradients over the links between
its replicas). Its algorithm (a dynamic program over layer prefixes and device
sets in the paper) was not readable here, and what it decides is outside what
delayjax simulates: ``dj.cluster.pipeline`` runs one pipeline replica on
``K`` devices, with no placement, no device topology and no all-reduce between
replicas; ``dj.simulate_pipeline`` trains one replica. A planner would need a
cost model of devices and links (bandwidth per link, which devices share a
machine), per-layer profiles (time and activation size per example), and a
hybrid runtime with replicas of each stage and their gradient all-reduce; its
claim (strategies up to 3.23x faster than PipeDream's planner's) could then be
checked by timing both planners' strategies in that simulator.

    python -m experiments run pipeline_dapple
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from . import pipeline_common as pc
from ._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows, paired,
                         seed_values)

# Config. Nothing was tuned on the claims' seeds: the schedules' counts follow from K and m, and the training setting
# is pipeline_bubbles' (SGD, lr 0.05, momentum 0.9), so that both synchronous runs train. The margins were fixed
# before the first run: throughput within 5% of GPipe's; at the same activation budget, DAPPLE at least 1.3x GPipe's
# throughput (the closed form above gives 1.47 for equal pass times; gamma times move it a little).
# Result of the first quick run (seeds 0-4): DAPPLE's throughput 1.022x GPipe's ([+0.018, +0.026] above 1: held);
# the final training loss equal on every seed (held); at the same activation budget 1.39x [1.37, 1.41] (held; the
# paper's 1.6x includes a small micro-batch's lower efficiency, not modelled). less-activation-memory is not held
# although its memory part holds (4 against 8 micro-batches on every seed): with gamma pass times DAPPLE's bubble
# is 1.3 points below GPipe's ([-1.5, -1.1]), outside the claimed 1-point band -- smaller, not larger. The claim
# stays as written.
SCALES = {
    "quick": dict(stages=4, layers=4, width=32, microbatches=8, budget_microbatches=16, steps=150, batch=8, lr=0.05,
                  momentum=0.9, eval_every=50, seeds=5),
    "paper": dict(stages=8, layers=8, width=256, microbatches=16, budget_microbatches=32, steps=2000, batch=16,
                  lr=0.05, momentum=0.9, eval_every=250, seeds=3),
}
THROUGHPUT_BAND, BUDGET_SPEEDUP = 0.05, 1.3
# Seconds of a forward pass per example of a micro-batch on one stage (a backward pass takes twice as long), and
# the gamma distribution's shape.
FORWARD_PER_EXAMPLE, SHAPE = 0.125, 4.0

VARIANTS = {  # schedule, micro-batches per mini-batch (None: the config's, "K": one per stage, "budget"), trained
    "gpipe": ("gpipe", None, True),
    "dapple": ("dapple", None, True),
    "gpipe-budget": ("gpipe", "K", False),
    "dapple-budget": ("dapple", "budget", False),
}


def microbatches(config: dict[str, Any], which: str | None) -> int:
  """Micro-batches per mini-batch of a variant: the config's ``microbatches``, ``K`` or ``budget_microbatches``."""
  return {None: config["microbatches"], "K": config["stages"], "budget": config["budget_microbatches"]}[which]


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": key, "schedule": s, "microbatches": microbatches(config, m), "trained": t}
          for key, (s, m, t) in VARIANTS.items()]


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.PipelineSchedule:
  """The spec's schedule: ``spec["microbatches"]`` micro-batches of ``batch`` examples per update, gamma pass
  times (a backward pass twice a forward pass on average)."""
  mean = FORWARD_PER_EXAMPLE * config["batch"]
  return dj.cluster.pipeline(spec["schedule"], config["stages"], config["steps"],
                             num_microbatches=spec["microbatches"], forward=dj.cluster.gamma(SHAPE, mean),
                             backward=dj.cluster.gamma(SHAPE, 2 * mean), seed=seed)


def _plan(config: dict[str, Any], spec: dict[str, Any], seed: int) -> pc.Training:
  tx = optax.sgd(config["lr"], momentum=config["momentum"]) if spec["trained"] else None
  return pc.Training(config, schedule_for(config, spec, seed), tx)


def _finish(config: dict[str, Any], spec: dict[str, Any], sched: dj.cluster.PipelineSchedule,
            record: dict[str, Any]) -> dict[str, Any]:
  del spec
  activations = sched.activations_kept()
  record["metrics"].update(
      examples_per_second=sched.num_passes * config["batch"] / sched.total_time,
      activations_kept_max=int(activations.max()), activations_kept_last=int(activations[-1]))
  return record


run, run_batch = pc.runners(_plan, _finish)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("schedule", "microbatches"))
  for r in rows:
    if r.get("test_error") is not None:
      r["accuracy_pct"] = 100 * (1 - r["test_error"])
  return rows


def _ratio(summary: Summary, a: str, b: str, metric: str) -> dict[Any, float]:
  return across_seeds(lambda x, y: x / y, seed_values(summary, a, metric), seed_values(summary, b, metric))


def _same_throughput(summary: Summary) -> ClaimResult:
  gap = across_seeds(lambda r: r - 1.0, _ratio(summary, "dapple", "gpipe", "examples_per_second"))
  return ClaimResult.decide(compare(gap, claim="within", margin=THROUGHPUT_BAND,
                                    what="DAPPLE / GPipe examples per simulated second - 1"))


def _less_memory(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([
      paired(summary, "dapple", "gpipe", "activations_kept_max", claim="less",
             what="most micro-batches' activations a stage holds, DAPPLE - GPipe"),
      paired(summary, "dapple", "gpipe", "bubble_fraction", claim="within", margin=0.01,
             what="bubble fraction, DAPPLE - GPipe")])


def _same_training(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, "dapple", "gpipe", "train_loss", claim="within", margin=1e-6,
                                   what="final training loss, DAPPLE - GPipe"))


def _budget_speedup(summary: Summary) -> ClaimResult:
  same_memory = paired(summary, "dapple-budget", "gpipe-budget", "activations_kept_max", claim="within",
                       margin=0.5, what="most micro-batches' activations a stage holds, DAPPLE at m = 4 K - GPipe "
                                        "at m = K")
  faster = compare(_ratio(summary, "dapple-budget", "gpipe-budget", "examples_per_second"), claim="greater",
                   margin=BUDGET_SPEEDUP, what="DAPPLE / GPipe examples per simulated second at the same "
                                               "activation budget")
  return ClaimResult.decide([same_memory, faster])


CLAIMS = [
    Claim("same-throughput", f"DAPPLE's throughput is GPipe's (within {THROUGHPUT_BAND:.0%})", _same_throughput),
    Claim("less-activation-memory", "DAPPLE holds fewer micro-batches' activations than GPipe (K - k against m on "
                                    "stage k), at GPipe's bubble", _less_memory),
    Claim("same-training", "DAPPLE trains to GPipe's model (synchronous: the same updates)", _same_training),
    Claim("budget-speedup", f"at the same activation budget DAPPLE's throughput is at least {BUDGET_SPEEDUP}x "
                            f"GPipe's (the paper: 1.6x)", _budget_speedup),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
  for ax, schedule in zip(axes, ("gpipe", "dapple")):
    sched = dj.cluster.pipeline(schedule, config["stages"], 2, num_microbatches=config["microbatches"],
                                forward=1.0, backward=2.0)
    dj.cluster.plot_pipeline(sched, ax=ax)
  fig.tight_layout()
  path = f"{out}/pipeline_dapple_timelines.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  trained = [r for r in records if r.get("curves")]
  return [_plots.curves(trained, out, "loss_vs_updates", y="train_loss", ylabel="training loss", log_y=True,
                        xs=("update",)), path]


REPRODUCTION = Reproduction(
    name="pipeline_dapple",
    paper="Fan, Rong, Meng, Cao, Wang, Zheng, Wu, Long, Yang, Xia, Diao, Liu, Lin: DAPPLE: A Pipelined Data "
          "Parallel Approach for Training Large Models, PPoPP 2021, https://arxiv.org/abs/2007.01045",
    description="DAPPLE's early-backward schedule against GPipe on 4 stages: throughput, activations in flight, "
                "the trained model, and throughput at the same activation budget.",
    scales=SCALES, specs=specs, run=run, batch=pc.batch_key, run_batch=run_batch, summarize=summarize, claims=CLAIMS,
    plots=plots,
    paper_numbers={"dapple-budget": {"speedup_over_gpipe": 1.6, "memory_saved_pct": 12.0}},
    columns=("key", "train_loss", "accuracy_pct", "examples_per_second", "bubble_fraction", "activations_kept_max"),
    smoke=dict(steps=8, eval_every=4, seeds=1, width=8, stages=2, layers=2, microbatches=2, budget_microbatches=4),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
