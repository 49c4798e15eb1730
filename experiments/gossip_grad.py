"""GossipGraD against all-reduce SGD and D-PSGD on a ring (Daily, Vishnu, Siegel, Warfel, Amatya 2018).

Sixteen replicas train softmax regression on the digits (every replica
samples the whole training set, as GossipGraD's distributed shuffle
intends). All-reduce SGD averages every replica's gradient each step;
D-PSGD (ring, Metropolis-Hastings weights) averages parameters with both
ring neighbours; GossipGraD (``dj.cluster.gossipgrad`` with
``dj.gossip.gossip_grad``) averages each replica's gradient with the one
received from a single partner, ``2^(t mod ceil(log2 M))`` positions away
in a node order reshuffled every ``ceil(log2 M)`` steps, and never mixes
parameters. All three are synchronous and apply the same number of
gradients.

Communication is what GossipGraD saves, and the gossip schedules charge one
``comm`` per step whatever the paradigm, so each spec's per-step ``comm`` is
its messages in sequence times one message's seconds: all-reduce
``ceil(log2 M)`` (recursive doubling, the paper's Theta(log p)), D-PSGD on a
ring 2 (one model to each neighbour), GossipGraD 1 (the paper's O(1)).
Reported: the average model's training loss and test error, the simulated
time to a target loss, the messages and the communication seconds per step.

Only the paper's abstract was reachable: it claims the O(1) communication
per step, ~100% compute efficiency on 128 P100 GPUs for ResNet-50 on
ImageNet-1K, and top-1 accuracy matching the published all-reduce results.
The claims below are that statement at this scale.

    python -m experiments run gossip_grad
"""

from __future__ import annotations

import math
from typing import Any

from . import _gossip_train as gt
from ._framework import POSITIVE, Claim, ClaimResult, Reproduction, Summary, paired

# Config: the gossip reproductions' task and run length (16 replicas, 200 gradients each, batch 16, lr 0.5, iid
# data, exponential compute times of mean 1 s). message_seconds = 0.25: communication a real but minor share of
# a GossipGraD step (1.25 s with a 1 s gradient) and a large one of all-reduce's (2 s with log2 16 = 4 messages),
# the regime the paper targets; not tuned on any verdict. target_loss 0.35: a training loss all three passed
# within their 200 gradients on exploration seeds 100-102 (outside the reported 0-5), fixed before seeds 0-5 ran.
# On those seeds GossipGraD minus D-PSGD in time to the target was -43 s [-89, +3] with 20 evaluations a run, whose
# spacing (160 gradients, about 36 s) is of the size of the difference: evals 40 halves it and seeds 6 narrow the
# interval; both fixed before seeds 0-5 ran. Nothing else changed.
# Result (6 seeds): all three claims held. Test error GossipGraD minus all-reduce 0.00 points [-0.32, +0.32] and
# training loss -0.0044 [-0.0047, -0.0041] (both 3.81% test error); GossipGraD reached the target 118.5 s
# [113.7, 123.2] sooner than all-reduce (474 s against 592) and 35.5 s [27.8, 43.1] sooner than D-PSGD on a ring.
SCALES = {
    "quick": dict(speeds=[1.0] * 16, compute="exponential", message_seconds=0.25, steps=200, batch=16, lr=0.5,
                  momentum=0.0, shards="iid", target_loss=0.35, evals=40, seeds=6),
}
LIMITS = {"message_seconds": POSITIVE, "target_loss": POSITIVE}


def messages_per_step(spec: dict[str, Any], num: int) -> int:
  """Messages a replica sends, one after the other, in a step of the spec's paradigm over ``num`` replicas."""
  if spec["paradigm"] == "allreduce":
    return max(1, math.ceil(math.log2(num)))
  if spec["paradigm"] == "d_psgd":
    return int(gt.topology_for(spec["topology"], num).degree.max())
  if spec["paradigm"] == "gossipgrad":
    return 1
  raise ValueError(f"no communication model for paradigm {spec['paradigm']!r}.")


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  del config
  return [{"key": "allreduce", "paradigm": "allreduce"},
          {"key": "d_psgd-ring", "paradigm": "d_psgd", "topology": "ring"},
          {"key": "gossipgrad", "paradigm": "gossipgrad"}]


def _spec_config(config: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
  # The schedule's per-step comm: this spec's messages in sequence, each message_seconds.
  num = len(config["speeds"])
  return {**config, "comm": config["message_seconds"] * messages_per_step(spec, num)}


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  # gt.run_spec with a per-spec comm: all-reduce and D-PSGD run one rule (parameter averaging) and share one
  # compiled program through `like`, with the other's schedule for the same seed; GossipGraD has its own.
  schedule = gt.schedule_for(_spec_config(config, spec), spec, seed)
  program = gt._PROGRAMS[spec["paradigm"]]
  like = tuple(gt.schedule_for(_spec_config(config, other), other, seed) for other in specs(config)
               if other["key"] != spec["key"] and gt._PROGRAMS[other["paradigm"]] == program)
  task = gt.digits_task(len(config["speeds"]), config["shards"])
  record = gt.run_replica_runtime(task, schedule, spec["paradigm"], lr=config["lr"], momentum=config["momentum"],
                                  batch=config["batch"], seed=seed, eval_every=gt.eval_every(config, schedule),
                                  shards=config["shards"], like=like, phases=gt.PHASES[program])
  progress(1, 1)
  record = gt.finish_record(config, schedule, record)
  messages = messages_per_step(spec, len(config["speeds"]))
  record["metrics"].update(messages_per_step=messages, comm_seconds_per_step=config["message_seconds"] * messages,
                           test_error_pct=100 * record["metrics"]["test_error"])
  return record


def _sooner(other: str):
  def check(summary: Summary) -> ClaimResult:
    # A target never reached counts as the run's simulated length (a lower bound): conservative.
    budget = max(r["simulated_time"] for r in summary.values())
    g, o = summary["gossipgrad"], summary[other]
    return ClaimResult.decide(
        paired(summary, "gossipgrad", other, "time_to_target", censor=budget),
        f"simulated seconds to the target training loss: GossipGraD {g['time_to_target']:.1f} "
        f"({g['comm_seconds_per_step']:.2f} s of communication a step), {other} {o['time_to_target']:.1f} "
        f"({o['comm_seconds_per_step']:.2f} s)")
  return check


CLAIMS = [
    Claim("gossipgrad-accuracy", "GossipGraD matches all-reduce SGD's accuracy at the same number of gradients "
          "(test error within 2 points, training loss within 5%)",
          gt.matches_accuracy("gossipgrad", "GossipGraD", "allreduce", "all-reduce")),
    Claim("gossipgrad-faster-than-allreduce", "With one message's cost O(1) a step against all-reduce's log2 M, "
          "GossipGraD reaches the target training loss sooner in simulated time than all-reduce SGD",
          _sooner("allreduce")),
    Claim("gossipgrad-faster-than-dpsgd", "GossipGraD (one gradient message a step) reaches the target training "
          "loss sooner in simulated time than D-PSGD on a ring (one model to each of two neighbours)",
          _sooner("d_psgd-ring")),
]

# No paper_numbers: only the abstract was reachable; its figures (~100% compute efficiency on 128 P100 GPUs,
# ResNet-50 top-1 matching the literature) are of a model and cluster this scale does not run.
REPRODUCTION = Reproduction(
    name="gossip_grad",
    paper="Daily, Vishnu, Siegel, Warfel, Amatya: GossipGraD: Scalable Deep Learning using Gossip Communication "
          "based Asynchronous Gradient Descent, arXiv 1803.05880, 2018",
    description="GossipGraD, all-reduce SGD and D-PSGD (ring) on 16 replicas with per-message communication "
                "costs: accuracy and simulated time to a target loss.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("paradigm"), claims=CLAIMS, plots=gt.plots,
    columns=("key", "loss", "test_error_pct", "time_to_target", "gradients_to_target", "simulated_time",
             "messages_per_step", "comm_seconds_per_step", "mean_consensus"),
    smoke=dict(steps=20, seeds=1, evals=4),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
