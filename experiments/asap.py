"""ASAP's stochastic reduce with NOTIFY-ACK against all-reduce SGD and unsynchronized averaging (Kadav, Kruus 2016).

Sixteen replicas with heterogeneous speeds train softmax regression on the
digits. All-reduce SGD averages every replica's gradient each round and waits
for the slowest; ASAP (``dj.cluster.asap`` on a random 4-regular graph, each
replica averaging its model with the ones its in-neighbours sent, run with
``dj.gossip.d_psgd``'s averaging) never waits for everyone: with NOTIFY-ACK a
replica sends its next model only once its receivers have consumed the
previous one; without it (``sync="none"``) it sends after every gradient and
an unconsumed message is overwritten. Every run applies the same number of
gradients. Reported: the average model's training loss and test error, the
simulated time to a target loss, the consensus distance, the time the
replicas spent blocked, the messages lost to overwriting.

Only the paper's abstract could be read: it claims 2-10x faster convergence
than synchronous all-reduce for the same result (stochastic reduce converges
to the all-reduce's result), and that plain asynchrony, where workers
progress at different speeds and read inconsistent intermediate outputs,
gives poor final accuracy, which NOTIFY-ACK's fine-grained synchronization
avoids. The claims below are those statements at this scale.

    python -m experiments run asap
"""

from __future__ import annotations

from typing import Any

import numpy as np

import delayjax as dj
from . import _gossip_train as gt
from ._framework import (COUNT, NON_NEGATIVE_INT, POSITIVE, Claim, ClaimResult, Reproduction, Summary, paired,
                         remembered)

C = dj.cluster

# Config: the gossip reproductions' task (16 replicas, batch 16, lr 0.5, every replica sampling the whole training
# set, exponential compute times of mean 1 s, 0.05 s messages), with heterogeneous speeds: twelve replicas at 1,
# two at 1/2, two at 1/4 (the stragglers all-reduce waits for every round). The graph of the stochastic reduce:
# dj.topology.random_regular(16, 4, seed=0), each replica sending to log2(16) = 4 others, uniform weights 1/5,
# spectral gap 0.27 (a 3-regular graph's is at most about 0.04 with weights 1/4).
# Settings chosen on a pilot seed (100) outside the reported ones, before they ran: on label-sharded data (each
# replica one or two classes) no gossip run came near all-reduce in 150 gradients per replica (final loss 0.78 to
# 0.86 against 0.33 with a 3-regular graph; 1.27 to 1.51 against 0.88 at lr 0.1), so the data are iid, as in the
# other gossip reproductions. target_loss: the largest final loss of the three specs on the pilot (0.373, ASAP with
# NOTIFY-ACK) rounded up to the next 0.05, so that every spec passed it there.
# Result (5 seeds, 45.6 CPU s): asap-faster held (ASAP reached the target 386 s [296, 476] sooner than all-reduce:
# 378 s against 764 s); asap-same-result inconclusive (test error +1.6 points [+1.0, +2.2] above all-reduce's, the
# interval across the 2-point margin); asap-notify-ack not held: at the same gradients NOTIFY-ACK ended at a loss
# 0.047 [0.027, 0.067] *higher* than unsynchronized averaging, which lost 54% of its messages to overwriting but
# averaged with its senders' newest models (mean message lag 0.08 local versions against NOTIFY-ACK's 1.1 on the
# pilot seed, where NOTIFY-ACK's blocked replicas also consumed each arrival as a mix of its own: 6772 mixes
# against 1901). On iid data, fresher averaging won over delivering every message.
# No paper_numbers: only the abstract was reachable, and its figures (2-10x, up to 10x less network) are of other
# applications and clusters.
# Seeds at quick scale: 12 (issue 28; was 5). The 5-seed run's asap-same-result differences (ASAP - all-reduce
# test error) had a mean of 1.61 points and sd 0.46, 0.39 below the 2-point margin; the half-width t s / sqrt(N)
# is 0.35 at 9 seeds, 0.33 at 10 and 0.29 at 12, which would decide the margin if the mean stayed near 1.6 and leaves
# it some room to move. A seed costs about 3 CPU s after the first (compilation), so 12 seeds stay near 50 s.
# (Added after that 12-seed run: it took 129 CPU s, most seeds compiling programs of their own, so the seeds' runs now
# share programs, ``like`` in run, which changes results only by float rounding; the seeds stay 12.)
# Result (12 seeds, 81 CPU s; seeds 0-4 the same, bit for bit, as the 5-seed run's, and the two 12-seed runs the
# same): asap-faster held (-398 s [-437, -360]); asap-same-result held (+0.58 points [-0.13, +1.29]: seeds 5-11
# came out lower than 0-4); asap-notify-ack not held (+0.044 [+0.037, +0.052]).
SCALES = {
    "quick": dict(speeds=[1.0] * 12 + [0.5, 0.5, 0.25, 0.25], compute="exponential", comm=0.05, steps=150,
                  batch=16, lr=0.5, momentum=0.0, shards="iid", degree=4, graph_seed=0, target_loss=0.4,
                  evals=15, seeds=12),
}

LIMITS = {"degree": COUNT, "graph_seed": NON_NEGATIVE_INT, "target_loss": POSITIVE}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  del config
  return [{"key": "allreduce", "paradigm": "allreduce"},
          {"key": "asap-notify_ack", "paradigm": "asap", "sync": "notify_ack"},
          {"key": "asap-none", "paradigm": "asap", "sync": "none"}]


def topology(config: dict[str, Any]) -> dj.topology.Topology:
  """The sparse graph of the stochastic reduce: a random ``degree``-regular graph over the replicas."""
  return dj.topology.random_regular(len(config["speeds"]), config["degree"], seed=config["graph_seed"])


def paradigm(config: dict[str, Any], spec: dict[str, Any]) -> C.GossipParadigm:
  if spec["paradigm"] == "allreduce":
    return C.allreduce()
  return C.asap(topology(config), sync=spec["sync"])


_SCHEDULES: dict[tuple[str, int, str], C.GossipSchedule] = {}


def schedule(config: dict[str, Any], spec: dict[str, Any], seed: int) -> C.GossipSchedule:
  """A spec's schedule (simulated once per process: it is also the ``like`` of the other specs' runs)."""
  def make() -> C.GossipSchedule:
    workers = C.workers(len(config["speeds"]), compute=config["compute"], comm=config["comm"],
                        speed=config["speeds"])
    return C.simulate_gossip(paradigm(config, spec), workers, config["steps"], seed=seed)

  return remembered(_SCHEDULES, (repr(sorted(config.items())), seed, spec["key"]), make)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  sched = schedule(config, spec, seed)
  # The two ASAP specs share one compiled program (one rule, D-PSGD's averaging, on groups of at most degree + 1
  # with late messages); all-reduce's mix of all 16 replicas has a program of its own (late messages are
  # supported in groups of at most 8).
  # The seeds 0 to seeds - 1 share them too: each seed's schedules would otherwise size a program of their own, which
  # cost most of the run's CPU time.
  like = tuple(schedule(config, other, s) for other in specs(config) for s in range(config.get("seeds", 1))
               if (other["key"], s) != (spec["key"], seed) and other["paradigm"] == spec["paradigm"])
  task = gt.digits_task(len(config["speeds"]), config["shards"])
  record = gt.run_replica_runtime(task, sched, spec["paradigm"], lr=config["lr"], momentum=config["momentum"],
                                  batch=config["batch"], seed=seed, eval_every=gt.eval_every(config, sched),
                                  shards=config["shards"], method=dj.gossip.d_psgd(), like=like,
                                  phases=gt.PHASES["averaging"])
  progress(1, 1)
  record = gt.finish_record(config, sched, record)
  record["metrics"]["overwritten_fraction"] = overwritten_fraction(sched)
  return record


def overwritten_fraction(sched: C.GossipSchedule) -> float:
  """The fraction of the messages sent that were overwritten before their receiver consumed them (0 for
  all-reduce, which sends none, and for NOTIFY-ACK, which never overwrites)."""
  if "overwritten" not in sched.extras:
    return 0.0
  # Every node sends to each out-neighbour once per gradient applied, except after its last; a message is either
  # consumed (one sender of one mix), overwritten, or still in flight at the end.
  consumed = int(np.count_nonzero(sched.members[:, 1:] >= 0))
  lost = int(sched.extras["overwritten"].sum())
  return lost / (consumed + lost) if consumed + lost else 0.0


def _faster(summary: Summary) -> ClaimResult:
  # A target never reached counts as the run's simulated length (a lower bound): conservative.
  budget = max(r["simulated_time"] for r in summary.values())
  a, r = summary["asap-notify_ack"], summary["allreduce"]
  return ClaimResult.decide(
      paired(summary, "asap-notify_ack", "allreduce", "time_to_target", censor=budget,
             what="simulated seconds to the target loss ASAP - all-reduce"),
      f"ASAP {a['time_to_target']:.1f} s, all-reduce {r['time_to_target']:.1f} s; whole runs {a['simulated_time']:.0f} "
      f"and {r['simulated_time']:.0f} s")


def _same_result(summary: Summary) -> ClaimResult:
  # The same number of gradients: ASAP's final test error within 2 points of all-reduce's.
  a, r = summary["asap-notify_ack"], summary["allreduce"]
  return ClaimResult.decide(
      paired(summary, "asap-notify_ack", "allreduce", "test_error", claim="within", margin=2.0, scale=100.0,
             what="final test error ASAP - all-reduce (points; claimed within 2)"),
      f"test error ASAP {100 * a['test_error']:.2f}%, all-reduce {100 * r['test_error']:.2f}%")


def _notify_ack_better(summary: Summary) -> ClaimResult:
  # The same number of gradients: the average model's final loss is lower with NOTIFY-ACK than without.
  a, n = summary["asap-notify_ack"], summary["asap-none"]
  return ClaimResult.decide(
      paired(summary, "asap-notify_ack", "asap-none", "loss",
             what="final training loss NOTIFY-ACK - unsynchronized"),
      f"final loss NOTIFY-ACK {a['loss']:.4f}, unsynchronized {n['loss']:.4f} "
      f"({100 * n['overwritten_fraction']:.0f}% of its messages overwritten)")


CLAIMS = [
    Claim("asap-faster", "With heterogeneous worker speeds, ASAP (stochastic reduce with NOTIFY-ACK) reaches the "
          "target loss sooner in simulated time than all-reduce SGD", _faster),
    Claim("asap-same-result", "At the same number of gradients, ASAP's final test error is within 2 points of "
          "all-reduce SGD's (the stochastic reduce converges to the all-reduce's result)", _same_result),
    Claim("asap-notify-ack", "At the same number of gradients, NOTIFY-ACK ends at a lower training loss than "
          "unsynchronized sparse averaging (fast workers sending without waiting)", _notify_ack_better),
]


REPRODUCTION = Reproduction(
    name="asap",
    paper="Kadav, Kruus: ASAP: Asynchronous Approximate Data-Parallel Computation, arXiv 2016",
    description="All-reduce SGD, and ASAP's stochastic reduce on a 4-regular graph with and without NOTIFY-ACK, "
                "on 16 replicas of heterogeneous speeds: loss against simulated time and gradients.",
    scales=SCALES, specs=specs, run=run, summarize=gt.summarize_by("paradigm", "sync"), claims=CLAIMS,
    plots=gt.plots,
    columns=("key", "loss", "test_error", "time_to_target", "gradients_to_target", "simulated_time",
             "mean_consensus", "idle_fraction", "overwritten_fraction"),
    smoke=dict(steps=20, seeds=1, evals=4),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
