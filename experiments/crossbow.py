"""CROSSBOW's synchronous model averaging (SMA) against S-SGD with one large batch (Koliousis et al., VLDB 2019).

CROSSBOW's headline: with many learners that each train on a small batch
and are synchronized by SMA (``dj.gossip.sma``: each learner is pulled
toward a central average model, which moves with momentum), training
reaches a target accuracy in fewer epochs than parallel synchronous SGD,
whose batch is the learners' batches together. Eight replicas train
softmax regression on the digits (every replica samples the whole training
set), each with a batch of 8 and SGD with momentum 0.9, on the replica
runtime ``dj.simulate_gossip``:

- ``ssgd``: synchronous SGD (the all-reduce of the gradients): one batch of
  64 per round;
- ``averaging``: plain model averaging, the learners' models averaged every
  round (D-PSGD's rule on the complete graph);
- ``sma``: SMA with the authors' code's constants (``alpha = 0.1`` of their
  benchmark scripts, the central model's momentum 0.9), on the same
  synchronous rounds (``dj.cluster.d_psgd`` on ``dj.topology.complete``:
  read, all-reduce, apply).

Every round processes 64 examples in each spec, so rounds count epochs
alike; the simulated time of a round is the same too (all wait for the
slowest), so the comparison is statistical efficiency only: CROSSBOW's gain
in hardware efficiency (several learners per GPU) is not modelled. The
model reported is the runtime's average model, the mean of the learners
(for SMA, pulled toward the central model every round; the central model
itself is ``extra.central``, not evaluated along the run). Only the paper's
abstract could be read (the rule is the authors' code's, see
``dj.gossip.sma``), so no figure of the paper is compared.

    python -m experiments run crossbow
"""

from __future__ import annotations

from typing import Any

import delayjax as dj
from . import _gossip_train as gt
from ._framework import COUNT, POSITIVE, Claim, ClaimResult, Range, Reproduction, Summary, paired

# Settings, fixed before the reported seeds ran, on a pilot seed outside them (100): each spec's learning rate is the
# one of the grid {0.2, 0.5, 1.0} (SGD with momentum 0.9) that reached the target training loss 0.2 in the fewest
# epochs there: S-SGD 1.42 epochs at 1.0 (1.51 at 0.5, 3.56 at 0.2), averaging 1.42 at 1.0 (1.51, 3.47), SMA 1.78
# at 0.5 (2.31 at 1.0, 3.38 at 0.2). The target 0.2 is a training loss that every spec passed at every rate of
# the grid within the 100 rounds (4.5 epochs) of the pilot; SMA's alpha and momentum are the authors' code's, not
# tuned. The pilot already showed SMA no faster at this scale; the claims are the paper's, stated before the
# reported run. The model measured is the learners' mean; on the pilot seed SMA's central model z was no better
# (training loss 0.428 against the mean's 0.313 after 20 rounds, 0.193 against 0.189 after 40, 0.120 against 0.116
# after 100), so measuring the mean does not understate SMA here.
# Result (10 seeds): neither claim held; both are not held. SMA needed 1.81 epochs to the target, S-SGD 1.26 (SMA -
# S-SGD +0.54 [+0.33, +0.76]) and plain averaging 1.43 (+0.37 [+0.23, +0.51]); final test errors 4.7%, 4.6%, 4.7%.
# Softmax regression on the digits is convex; CROSSBOW's evidence is on deep networks (ResNets, VGG, LeNet on
# GPUs), which this scale does not test.
SCALES = {
    "quick": dict(speeds=[1.0] * 8, compute="exponential", comm=0.05, steps=100, batch=8, momentum=0.9,
                  lrs={"ssgd": 1.0, "averaging": 1.0, "sma": 0.5}, alpha=0.1, central_momentum=0.9,
                  shards="iid", target_loss=0.2, evals=50, seeds=10, runtime="dj"),
}

LIMITS = {"alpha": Range(0.0), "central_momentum": Range(0.0, 1.0, high_open=True), "target_loss": POSITIVE,
          "lrs": POSITIVE, "evals": COUNT}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  lrs = config["lrs"]
  rounds = {"paradigm": "d_psgd", "topology": "complete"}
  return [{"key": "ssgd", "paradigm": "allreduce", "method": "d_psgd", "lr": lrs["ssgd"]},
          {"key": "averaging", **rounds, "method": "d_psgd", "lr": lrs["averaging"]},
          {"key": "sma", **rounds, "method": "sma", "lr": lrs["sma"]}]


def epochs(gradients: float | None, config: dict[str, Any], num_examples: int) -> float | None:
  """Epochs that ``gradients`` applied gradients (each on ``config["batch"]`` examples) make, or ``None``."""
  return None if gradients is None else gradients * config["batch"] / num_examples


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  schedule = gt.schedule_for(config, spec, seed)
  task = gt.digits_task(len(config["speeds"]), config["shards"])
  if spec["method"] == "sma":
    method = dj.gossip.sma(config["alpha"], config["central_momentum"])
    like: tuple[dj.cluster.GossipSchedule, ...] = ()
  else:
    method = dj.gossip.d_psgd()
    # The two averaging specs share one compiled program when their learning rates agree.
    like = tuple(gt.schedule_for(config, other, seed) for other in specs(config)
                 if other["method"] == "d_psgd" and other["key"] != spec["key"] and other["lr"] == spec["lr"])
  record = gt.run_replica_runtime(task, schedule, spec["paradigm"], lr=spec["lr"], momentum=config["momentum"],
                                  batch=config["batch"], seed=seed, eval_every=gt.eval_every(config, schedule),
                                  shards=config["shards"], method=method, like=like, phases=1)
  progress(1, 1)
  record = gt.finish_record(config, schedule, record)
  n = task.y.shape[0]
  m = record["metrics"]
  m["epochs_to_target"] = epochs(m["gradients_to_target"], config, n)
  # Never reached: the run's epochs, a lower bound of what it would take (conservative for the spec that missed).
  m["epochs_to_target_bound"] = epochs(m["gradients_to_target"] or m["gradients"], config, n)
  m["epochs"] = epochs(m["gradients"], config, n)
  return record


def _fewer_epochs(summary: Summary, other: str) -> ClaimResult:
  s, o = summary["sma"], summary[other]
  return ClaimResult.decide(
      paired(summary, "sma", other, "epochs_to_target_bound",
             what=f"epochs to the target training loss, SMA - {other}"),
      f"epochs to the target: SMA {s['epochs_to_target_bound']:.2f}, {other} {o['epochs_to_target_bound']:.2f}; "
      f"final test error {100 * s['test_error']:.1f}% against {100 * o['test_error']:.1f}%")


CLAIMS = [
    Claim("sma-fewer-epochs-than-ssgd", "with small per-learner batches, SMA reaches the target training loss in "
          "fewer epochs than synchronous SGD with one batch of all the learners' examples",
          lambda s: _fewer_epochs(s, "ssgd")),
    Claim("sma-fewer-epochs-than-averaging", "SMA reaches the target training loss in fewer epochs than plain "
          "model averaging of the same learners every round", lambda s: _fewer_epochs(s, "averaging")),
]


# No paper_numbers: only the abstract was reachable. Its figure, a training time 1.3-4x shorter than TensorFlow's on
# an 8-GPU server, is wall-clock time and includes the hardware efficiency (several learners per GPU) that this table
# does not model; the epochs to a target could not be read.
REPRODUCTION = Reproduction(
    name="crossbow",
    paper="Koliousis, Watcharapichat, Weidlich, Mai, Costa, Pietzuch: Crossbow: Scaling Deep Learning with Small "
          "Batch Sizes on Multi-GPU Servers, PVLDB 12(11), 2019",
    description="SMA on 8 small-batch learners against S-SGD with their batches together and against plain model "
                "averaging: epochs to a training loss.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("method", "lr"), claims=CLAIMS, plots=gt.plots,
    columns=("key", "lr", "epochs_to_target", "loss", "loss_half", "test_error", "mean_consensus", "epochs"),
    # One learning rate: S-SGD and averaging share one compiled program, SMA has the other.
    smoke=dict(steps=6, seeds=1, evals=2, lrs={"ssgd": 0.5, "averaging": 0.5, "sma": 0.5}),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
