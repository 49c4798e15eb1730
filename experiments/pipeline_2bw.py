"""PipeDream-2BW: PipeDream's throughput with two weight versions, at a loss close to vertical sync.

PipeDream-2BW (Narayanan et al., ICML 2021) runs PipeDream's asynchronous
one-forward-one-backward pipeline with ``m`` micro-batches coalesced into each
update and two weight buffers per stage: every pass of mini-batch ``u`` uses
version ``u - 1``, :math:`w_{u+1} = w_u - \\nu \\nabla f(w_{u-1})`, one
staleness for all stages. The paper's claim, reproduced here on the pipeline
simulator and the staged MLP on digits (``K = 4`` stages, ``m = 4``):

- its throughput (examples per simulated second) is near PipeDream's (1F1B
  with weight stashing and one micro-batch per update), and above a
  synchronous pipeline with a flush every mini-batch (GPipe);
- it keeps two weight versions per stage, where PipeDream's stage ``k``
  keeps ``K - k``;
- it trains to a loss close to PipeDream's vertical sync (1F1B, every stage at
  the version stage 0 used, the same ``m`` micro-batches per update) and to
  GPipe's synchronous minibatch SGD.

Pass times are gamma-distributed (a backward pass twice a forward pass on
average), drawn from each seed, so throughput varies from seed to seed. In
the simulator an update takes no time and 2BW runs 1F1B's order on the same
draws, so its throughput equals PipeDream's by construction (the ratio is 1 on
every seed); what the claim checks is that coalescing ``m`` micro-batches and
reading version ``u - 1`` cost no bubble, and how far a flush (GPipe) falls
behind. PipeDream itself is timed but not trained (its updates are on one
micro-batch, a different optimization problem; the claim about it is the
throughput and memory). **Only the paper's abstract and summaries were
reachable**; the update rule is the one its abstract-level description and
later work (a constant one-step delay whatever the depth) give.

    python -m experiments run pipeline_2bw
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from . import pipeline_common as pc
from ._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                                    paired, seed_values)

# Config: the margins were fixed before the first run: throughput at least 95% of PipeDream's, loss within 10%
# (relative) of vertical sync's and of GPipe's. The first quick run trained with SGD (lr 0.05, momentum 0.9, as
# pipeline_bubbles): 2BW's loss 0.569 +- 0.16 against vertical sync's 0.277 and GPipe's 0.130, (2BW - vs) / vs
# +1.114 [+0.0855, +2.143] (inconclusive), against GPipe +3.757 [+1.008, +6.506] (not held). The paper trains its
# models with Adam, so Adam (lr 0.003) is the optimizer now; nothing else changed: (2BW - vs) / vs +0.0975
# [+0.0407, +0.154] (inconclusive), against GPipe +0.264 [+0.186, +0.341] (not held). 150 updates are far from
# convergence, where the paper compares; that is left to the paper scale. With --steps 600 (the quick scale
# otherwise, 5 seeds, about 60 CPU s): losses 0.0618 / 0.0519 / 0.0383 (2BW / vertical sync / GPipe), test
# accuracy 96.1 / 96.3 / 96.8%, both loss claims inconclusive (+0.188 [-0.095, +0.471]; +0.651 [-0.095, +1.40]).
# Seeds: 12 (were 5). At 5 the vertical-sync comparison's mean (+0.0975) sat 0.0025 below its 0.1 margin, so no
# count could be planned to decide it; 12 is the count at which a t interval is about half as wide as at 5 (a run
# costs about 0.5 CPU s), fixed before seeds 5-11 ran. Nothing else changed. With 12: within 10% of vertical sync
# held (+0.056 [+0.016, +0.095]), within 10% of GPipe not held (+0.194 [+0.134, +0.254]).
SCALES = {
    "quick": dict(stages=4, layers=4, width=32, microbatches=4, steps=150, batch=8, optimizer="adam", lr=0.003,
                  momentum=0.9, eval_every=50, seeds=12),
    "paper": dict(stages=8, layers=8, width=256, microbatches=8, steps=3000, batch=16, optimizer="adam", lr=0.001,
                  momentum=0.9, eval_every=250, seeds=3),
}
THROUGHPUT_MARGIN, LOSS_MARGIN = 0.95, 0.10

VARIANTS = {  # schedule, weights, micro-batches per update (None: the config's), trained
    "pipedream": ("1f1b", "stash", 1, False),
    "2bw": ("2bw", "stash", None, True),
    "vertical-sync": ("1f1b", "vertical_sync", None, True),
    "gpipe": ("gpipe", "stash", None, True),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": key, "schedule": s, "weights": w, "microbatches": m or config["microbatches"], "trained": t}
          for key, (s, w, m, t) in VARIANTS.items()]


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.PipelineSchedule:
  """The spec's schedule over the same micro-batches as every other spec (``steps * microbatches``)."""
  micro = config["steps"] * config["microbatches"]
  return dj.cluster.pipeline(spec["schedule"], config["stages"], micro // spec["microbatches"],
                             num_microbatches=spec["microbatches"], weights=spec["weights"],
                             forward=dj.cluster.gamma(4.0, 1.0), backward=dj.cluster.gamma(4.0, 2.0), seed=seed)


def _plan(config: dict[str, Any], spec: dict[str, Any], seed: int) -> pc.Training:
  tx = None
  if spec["trained"]:
    tx = (optax.adam(config["lr"]) if config["optimizer"] == "adam" else
          optax.sgd(config["lr"], momentum=config["momentum"]))
  return pc.Training(config, schedule_for(config, spec, seed), tx)


def _finish(config: dict[str, Any], spec: dict[str, Any], sched: dj.cluster.PipelineSchedule,
            record: dict[str, Any]) -> dict[str, Any]:
  del spec
  kept = sched.versions_kept()
  record["metrics"].update(
      examples_per_second=sched.num_passes * config["batch"] / sched.total_time,
      versions_kept_max=int(kept.max()), versions_kept_first=int(kept[0]),
      activations_kept_max=int(sched.activations_kept().max()))
  return record


run, run_batch = pc.runners(_plan, _finish)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("schedule", "weights", "microbatches"))
  for r in rows:
    if r.get("test_error") is not None:
      r["accuracy_pct"] = 100 * (1 - r["test_error"])
  return rows


def _ratio(summary: Summary, a: str, b: str, metric: str) -> dict[Any, float]:
  return across_seeds(lambda x, y: x / y, seed_values(summary, a, metric), seed_values(summary, b, metric))


def _throughput(summary: Summary) -> ClaimResult:
  near = compare(_ratio(summary, "2bw", "pipedream", "examples_per_second"), claim="greater",
                 margin=THROUGHPUT_MARGIN, what="2BW / PipeDream examples per simulated second")
  above = compare(_ratio(summary, "2bw", "gpipe", "examples_per_second"), claim="greater", margin=1.0,
                  what="2BW / GPipe examples per simulated second")
  return ClaimResult.decide([near, above])


def _memory(summary: Summary) -> ClaimResult:
  two = paired(summary, "2bw", None, "versions_kept_max", claim="less", margin=2.5,
               what="most weight versions a 2BW stage keeps")
  fewer = paired(summary, "2bw", "pipedream", "versions_kept_first", claim="less",
                 what="weight versions on stage 0, 2BW - PipeDream")
  return ClaimResult.decide([two, fewer])


def _relative_loss(summary: Summary, other: str) -> ClaimResult:
  gap = across_seeds(lambda a, b: (a - b) / b, seed_values(summary, "2bw", "train_loss"),
                     seed_values(summary, other, "train_loss"))
  return ClaimResult.decide(compare(gap, claim="within", margin=LOSS_MARGIN,
                                    what=f"(2BW - {other}) / {other} final training loss"))


CLAIMS = [
    Claim("throughput", f"2BW's throughput is at least {THROUGHPUT_MARGIN:.0%} of PipeDream's, and above GPipe's",
          _throughput),
    Claim("two-versions", "2BW keeps at most two weight versions per stage, fewer than PipeDream's first stage",
          _memory),
    Claim("loss-vs-vertical-sync", f"2BW's final training loss is within {LOSS_MARGIN:.0%} of vertical sync's",
          lambda s: _relative_loss(s, "vertical-sync")),
    Claim("loss-vs-gpipe", f"2BW's final training loss is within {LOSS_MARGIN:.0%} of synchronous GPipe's",
          lambda s: _relative_loss(s, "gpipe")),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
  for ax, schedule in zip(axes, ("2bw", "gpipe")):
    sched = dj.cluster.pipeline(schedule, config["stages"], 3, num_microbatches=config["microbatches"],
                                forward=1.0, backward=2.0)
    dj.cluster.plot_pipeline(sched, ax=ax)
  fig.tight_layout()
  path = f"{out}/pipeline_2bw_timelines.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  trained = [r for r in records if r.get("curves")]
  return [_plots.curves(trained, out, "loss_vs_time", y="train_loss", ylabel="training loss", xs=("update", "time"),
                        log_y=True), path]


# No paper_numbers: only the abstract was reachable, and its one figure (GPT and BERT training up to 20x faster,
# at similar accuracy) is a speed-up over baselines that no row runs; nothing is stated for 2BW against PipeDream,
# vertical sync or GPipe.
REPRODUCTION = Reproduction(
    name="pipeline_2bw",
    paper="Narayanan, Phanishayee, Shi, Chen, Zaharia: Memory-Efficient Pipeline-Parallel DNN Training "
          "(PipeDream-2BW), ICML 2021, https://arxiv.org/abs/2006.09503",
    description="PipeDream-2BW on 4 stages, 4 micro-batches: throughput against PipeDream and GPipe, weight "
                "versions kept, and the loss against vertical sync and GPipe.",
    scales=SCALES, specs=specs, run=run, batch=pc.batch_key, run_batch=run_batch, summarize=summarize, claims=CLAIMS,
    plots=plots,
    columns=("key", "train_loss", "accuracy_pct", "examples_per_second", "bubble_fraction", "mean_staleness",
             "versions_kept_max", "versions_kept_first", "activations_kept_max"),
    smoke=dict(steps=8, eval_every=4, seeds=1, width=8, stages=2, layers=2, microbatches=2),
    limits={"optimizer": ("adam", "sgd")},
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
