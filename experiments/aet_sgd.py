"""AET-SGD against D-PSGD: event-triggered gossip with a growing threshold (Nguyen & Han 2021).

Eight replicas on a ring train softmax regression on the digits (every
replica samples the whole training set), in synchronous D-PSGD rounds
(``dj.cluster.d_psgd`` on the ring, Metropolis weights 1/3, exponential
compute times of mean 1 s). Both specs run on the same schedule, seed by
seed, on the replica runtime ``dj.simulate_gossip``:

- ``d_psgd``: ``dj.gossip.d_psgd``: every replica sends its model to its two
  neighbours at every round;
- ``aet_sgd``: ``dj.gossip.aet_sgd``: a replica sends only when its model
  has moved more than :math:`\\tau_0 (1 + \\rho k)` since its last send
  (:math:`k` its gradient steps so far), otherwise its neighbours mix the
  model it sent last; ``result.extra.events`` counts the sends.

Messages: a send goes to both ring neighbours (2 messages); D-PSGD sends at
every mix, so its count is the schedule's. The message price is charged
after the run (the schedule's timing is the same for both specs: a rule
decided inside the step cannot shorten it): ``costed_time`` is the
schedule's simulated time plus ``message_seconds`` for each message of the
replica that sent the most (messages of a replica go out one after the
other). Reported: the average model's training loss and test error, the
messages, the costed time, and the replicas' mean consensus distance.

**Only the paper's abstract could be read** (the authors' code was read as
well, see ``dj.gossip.aet_sgd``): it claims a communication cost reduced by
44x to 120x against the state of the art (event-triggered baselines) while
keeping good convergence, on MNIST, Fashion-MNIST, KMNIST and CIFAR-10.
The claims below are that statement at this scale, against D-PSGD (the
full-communication baseline): at least half the messages saved at the same
accuracy, and so a shorter run when messages are costly.

    python -m experiments run aet_sgd
"""

from __future__ import annotations

from typing import Any

import numpy as np

import delayjax as dj
from . import _gossip_train as gt
from ._framework import COUNT, POSITIVE, Claim, ClaimResult, Reproduction, Summary, paired

# Config: the gossip reproductions' task (digits, softmax regression, batch 16, lr 0.5, iid data, exponential compute
# of mean 1 s) on 8 replicas of a ring, 150 gradients each; message_seconds 0.5 (a message costs half a gradient's
# mean compute time: messages are costly). These were fixed before any run. threshold and growth were chosen on one
# pilot seed (100, outside the reported 0-5) from a grid: threshold (0.1, 0.3, 1.0) x growth (0, 0.02), then 1.0 and
# 2.0 x 0.005 (one gradient step moves a replica's model by about 1 in L2 norm here). Fractions of D-PSGD's messages
# and final test error (D-PSGD: 3.62%): 0.1: 0.99 / 0.85 (growth 0 / 0.02); 0.3: 0.83 / 0.61; 1.0: 0.46 (3.62%) /
# 0.39 (6.69%); 1.0 with 0.005: 0.42 (3.90%, training loss 0.305 against 0.323); 2.0 with 0.005: 0.35 (9.47%).
# threshold 1.0 with growth 0.005 (the threshold doubles after 200 steps) is the largest saving whose test error
# stayed within a point of D-PSGD's. evals 20.
# Result (6 seeds): two of three claims held. AET-SGD sent 0.429 [0.416, 0.442] of D-PSGD's messages (1030 of
# 2400) and, with messages priced, finished its 1200 gradients 81 s [79, 83] sooner (482 s against 563). The
# accuracy claim did not hold as stated: test error +0.42 points [-0.48, +1.32] (within the band), but the training
# loss ended 0.0185 [0.0171, 0.0199] *lower* than D-PSGD's (0.304 against 0.323), outside the +-5% band of a match:
# the rarely refreshed broadcast models leave each replica's own progress unmixed, and at this lr the loss of the
# average model drops faster (its consensus distance is 5x D-PSGD's, 0.54 against 0.10).
SCALES = {
    "quick": dict(workers=8, topology="ring", compute="exponential", steps=150, batch=16, lr=0.5, momentum=0.0,
                  shards="iid", threshold=1.0, growth=0.005, message_seconds=0.5, evals=20, seeds=6),
}
LIMITS = {"threshold": POSITIVE, "growth": POSITIVE, "message_seconds": POSITIVE, "workers": COUNT}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  del config
  return [{"key": "d_psgd", "paradigm": "d_psgd", "method": "d_psgd"},
          {"key": "aet_sgd", "paradigm": "d_psgd", "method": "aet_sgd"}]


def sends_per_replica(schedule: dj.cluster.GossipSchedule) -> np.ndarray:
  """D-PSGD's sends on ``schedule``: the mixes each replica is a member of (it sends at every one)."""
  members = schedule.members[schedule.members >= 0]
  return np.bincount(members, minlength=schedule.num_workers).astype(np.int64)


def message_counts(sends: np.ndarray, degree: int) -> tuple[int, int]:
  """``(total, busiest)``: messages of all replicas and of the replica that sent the most, each send going to
  ``degree`` neighbours."""
  sends = np.asarray(sends, np.int64)
  return int(sends.sum()) * degree, int(sends.max()) * degree


def _schedule(config: dict[str, Any], seed: int) -> dj.cluster.GossipSchedule:
  # comm None: the schedule's rounds take the compute time only; the message price is charged afterwards.
  spec_config = {k: config[k] for k in ("workers", "compute", "steps")}
  spec_config["speeds"] = [1.0] * config["workers"]
  return gt.schedule_for(spec_config, {"paradigm": "d_psgd", "topology": config["topology"]}, seed)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  import jax.numpy as jnp
  import optax

  schedule = _schedule(config, seed)
  task = gt.digits_task(config["workers"], config["shards"])
  x, y = task.x.astype(np.float32), task.y.astype(np.int32)
  xt, yt = task.x_test.astype(np.float32), task.y_test.astype(np.int32)

  def loss_fn(params, b):
    return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ params.reshape(65, 10), b["y"]).mean()

  def eval_fn(params):
    return {"loss": loss_fn(params, {"x": x, "y": y}),
            "test_error": jnp.mean(jnp.argmax(xt @ params.reshape(65, 10), -1) != yt).astype(jnp.float32)}

  method = (dj.gossip.aet_sgd(config["threshold"], config["growth"]) if spec["method"] == "aet_sgd"
            else dj.gossip.d_psgd())
  every = gt.eval_every(config, schedule)
  # Chunks of a fixed 256 steps: the seeds of a spec, whose schedules differ, share one compiled program.
  result = dj.simulate_gossip(loss_fn, optax.sgd(config["lr"], momentum=config["momentum"] or None), method,
                              np.zeros(650, np.float32), {"x": x, "y": y}, schedule, seed=seed,
                              sampling=dj.Sampling(config["batch"], scheme="iid"),
                              record=dj.Record(eval_fn=eval_fn, every=every),
                              execution=dj.Execution(chunk_size=256))
  progress(1, 1)
  h = result.history
  curves = {"gradients": np.asarray(h.eval_gradients).tolist(), "time": np.asarray(h.eval_time).tolist(),
            "loss": np.asarray(h.eval_metrics["loss"], np.float64).tolist(),
            "test_error": np.asarray(h.eval_metrics["test_error"], np.float64).tolist()}
  # A send goes to every neighbour: the topology's largest degree (2 on the ring).
  degree = int(np.max(gt.topology_for(config["topology"], config["workers"]).degree))
  full = sends_per_replica(schedule)
  sends = np.asarray(result.extra.events) if spec["method"] == "aet_sgd" else full
  total, busiest = message_counts(sends, degree)
  full_total, _ = message_counts(full, degree)
  metrics = {"loss": curves["loss"][-1], "test_error_pct": 100 * curves["test_error"][-1],
             "gradients": int(curves["gradients"][-1]), "simulated_time": schedule.total_time,
             "messages": total, "message_fraction": total / full_total,
             "costed_time": schedule.total_time + config["message_seconds"] * busiest,
             "mean_consensus": float(np.mean(np.asarray(h.consensus, np.float64)))}
  return {"metrics": metrics, "curves": curves}


def _fewer(summary: Summary) -> ClaimResult:
  a = summary["aet_sgd"]
  return ClaimResult.decide(
      paired(summary, "aet_sgd", None, "message_fraction", claim="less", margin=0.5),
      f"messages: AET-SGD {a['messages']:.0f}, D-PSGD {summary['d_psgd']['messages']:.0f} (fraction "
      f"{a['message_fraction']:.3f}; claim below 0.5)")


def _sooner(summary: Summary) -> ClaimResult:
  a, d = summary["aet_sgd"], summary["d_psgd"]
  return ClaimResult.decide(
      paired(summary, "aet_sgd", "d_psgd", "costed_time"),
      f"simulated seconds for the run's gradients with messages priced: AET-SGD {a['costed_time']:.1f}, D-PSGD "
      f"{d['costed_time']:.1f}")


CLAIMS = [
    Claim("aet-fewer-messages", "AET-SGD sends fewer than half of D-PSGD's messages over the same gradients",
          _fewer),
    Claim("aet-accuracy", "AET-SGD matches D-PSGD's accuracy at the same number of gradients (test error within 2 "
          "points, training loss within 5%)", gt.matches_accuracy("aet_sgd", "AET-SGD", "d_psgd", "D-PSGD")),
    Claim("aet-sooner-when-messages-cost", "With messages priced at half a gradient's compute time, AET-SGD "
          "completes the same gradients in less simulated time than D-PSGD", _sooner),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  from . import _plots

  del config, rows
  return [_plots.curves(records, out, "loss", y="loss", ylabel="training loss (average model)",
                        xs=("gradients", "time"))]


# No paper_numbers: only the abstract was reachable; its 44x-120x is against event-triggered baselines on other
# models, not a figure of this setting.
REPRODUCTION = Reproduction(
    name="aet_sgd",
    paper="Nguyen, Nhuong and Han, Song: AET-SGD: Asynchronous Event-triggered Stochastic Gradient Descent, "
          "arXiv 2112.13935, 2021",
    description="AET-SGD and D-PSGD on 8 replicas of a ring: messages sent, accuracy, and simulated time with "
                "messages priced.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("method"), claims=CLAIMS, plots=plots,
    columns=("key", "loss", "test_error_pct", "messages", "message_fraction", "simulated_time", "costed_time",
             "mean_consensus"),
    smoke=dict(steps=20, seeds=1, evals=4),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
