"""FedAsync and FedBuff against synchronous FedAvg on non-iid clients: accuracy against simulated time.

Ten clients, each holding two classes of the data, with heavy-tailed
(lognormal) compute times. A client reads the server model, runs ``local_steps``
SGD steps on its own data and pushes the delta ``x_new - x_read``:

  fedavg    BSP: every round waits for all clients and averages their deltas
  fedasync  ASP: each delta is mixed in at once, x <- x + a s(tau) (x_new - x)   (Xie et al. 2019)
  fedbuff   ASP: staleness-weighted deltas are buffered, one server step per K  (Nguyen et al. 2022)

Local training runs in ``dj.simulate``'s local-SGD worker
(``dj.workers.LocalSteps``): each contribution takes its local steps on minibatches
of its client's shard and pushes the pseudo-gradient ``x_read - x_new``, the
negative delta; the server transformations receive the delta through
``optax.scale(-1)``. Every method runs for the same simulated time.

    python -m experiments run federated
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import Claim, ClaimResult, Reproduction, Summary, mean_rows, paired
from ._training import (schedule_once, seeds_like, shared_chunk_size, simulate_record, task_for, time_horizon,
                        with_time_to_target, within_time)

# Config: FedAsync's mixing 0.6 with the polynomial rule a = 0.5; FedBuff's K = 5 of 10 clients. Six seeds:
# with two, FedAsync against FedAvg was one win each; six also let a sign test decide when a method never
# reaches the target.
# Seeds at quick scale: 16 (issue 28; were 6), fixed before seeds 6-15 ran, nothing else changed: the 6-seed run
# left fedasync-faster inconclusive (FedAsync - FedAvg seconds to the target -9.0 [-25.8, +7.8]) with a per-seed
# standard deviation of 16.0 s; t_{N-1} 16.0 / sqrt(N) falls under the 9.0 s of that mean from 15 seeds (8.85),
# 8.5 at 16, so 16 decide it if the mean stays where it is.
# Issue 28: a target never reached counts the 120 s budget, not the run's last update (see
# _training.with_time_to_target). No run of the quick scale missed the 90% target: the rerun's records (bit for bit) and
# verdicts are unchanged. It took 118 CPU s (174 s wall).
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, clients=10, classes_per_client=2, local_steps=5,
                  batch=16, client_lr=0.05, time_budget=120.0, mixing=0.6, poly_a=0.5, buffer=5, server_lr=1.0,
                  compute="lognormal", target_accuracy=0.9, seeds=16, eval_points=30, steps=0),
    "paper": dict(data="mnist", model="mlp", hidden=200, clients=100, classes_per_client=2, local_steps=10,
                  batch=32, client_lr=0.05, time_budget=600.0, mixing=0.6, poly_a=0.5, buffer=10, server_lr=1.0,
                  compute="lognormal", target_accuracy=0.95, seeds=1, eval_points=40, steps=0),
}
METHODS = ("fedavg", "fedasync", "fedbuff")
# The paper's own figures, from FedBuff's abstract (Nguyen et al., AISTATS 2022; the full text, with its tables,
# was not reachable): FedBuff is 3.3x more efficient than synchronous FL and up to 2.5x more efficient than
# asynchronous FL (FedAsync, as the arXiv version's abstract names it), in cross-device FL with hundreds of
# concurrent clients, not ten. Written as each method's cost to reach the target in units of FedBuff's
# (FedBuff = 1); the abstract does not say whether "efficient" counts wall-clock time or client updates, and 2.5
# is a best case. Not comparable one-to-one with this quick scale's time_to_target: only the order compares.
PAPER_COST_VS_FEDBUFF = {"fedavg": 3.3, "fedasync": 2.5, "fedbuff": 1.0}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": m, "method": m} for m in METHODS]


def non_iid_shards(labels: np.ndarray, clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
  """Sorts the examples by label, cuts them into ``clients * classes_per_client`` pieces, deals each client
  ``classes_per_client`` pieces at random (the split of McMahan et al. 2017)."""
  order = np.argsort(labels, kind="stable")
  pieces = np.array_split(order, clients * classes_per_client)
  deal = np.random.default_rng(seed).permutation(len(pieces)).reshape(clients, classes_per_client)
  return [np.concatenate([pieces[i] for i in row]) for row in deal]


def server(config: dict[str, Any], method: str) -> optax.GradientTransformation:
  """The server's rule; its input is a client's negative delta."""
  if method == "fedavg":
    return optax.sgd(config["server_lr"])
  if method == "fedasync":
    return optax.chain(optax.scale(-1.0), dj.fed_async(config["mixing"], "polynomial", a=config["poly_a"]))
  return optax.chain(optax.scale(-1.0),
                     dj.fed_buff(optax.sgd(config["server_lr"]), buffer_size=config["buffer"]))


def _budget(config: dict[str, Any]) -> float:
  return config["time_budget"] if not config["steps"] else config["steps"] / 100 * config["time_budget"]


def schedule(config: dict[str, Any], method: str, seed: int) -> dj.cluster.Schedule:
  """The cluster run of a method, long enough to pass the time budget (simulated once per process: it is also the
  ``like`` of the other seeds' runs)."""
  def simulate() -> dj.cluster.Schedule:
    workers = dj.cluster.workers(config["clients"], compute=config["compute"])
    paradigm = dj.cluster.bsp() if method == "fedavg" else dj.cluster.asp()
    # Enough updates to pass the budget (ASP applies about `clients` per second with mean-1 s times).
    longest = int(_budget(config) * config["clients"] * 2) + 10
    return dj.cluster.simulate(paradigm, workers, longest, seed=seed)

  return schedule_once(simulate, "federated", method == "fedavg", config["clients"], config["compute"],
                       _budget(config), seed)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  task = task_for(config)
  shards = non_iid_shards(task.data["y"], config["clients"], config["classes_per_client"], seed)
  budget = _budget(config)
  full = schedule(config, spec["method"], seed)
  sched = within_time(full, budget)
  # One chunk length and one program's sizes for every seed (their runs within the budget differ in length and
  # sizes), so that the seeds share a compiled program.
  like = seeds_like(config, seed, lambda s: within_time(schedule(config, spec["method"], s), budget))
  record = simulate_record(task, server(config, spec["method"]), sched, seed=seed, batch_size=config["batch"],
                           eval_every=max(1, sched.num_updates // config["eval_points"]), progress=progress,
                           scheme="shard", shards=shards,
                           worker=dj.workers.LocalSteps(config["local_steps"], optax.sgd(config["client_lr"])),
                           chunk_size=shared_chunk_size(max(s.num_updates for s in like)), like=like)
  return with_time_to_target(record, config["target_accuracy"], time_horizon(full, budget))


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("method",))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"])
  return rows


def _faster(method: str):
  def check(summary: Summary) -> ClaimResult:
    return ClaimResult.decide(paired(summary, method, "fedavg", "time_to_target_bound",
                                     what=f"seconds to the target {method} - fedavg"))
  return check


def _buff_vs_async(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, "fedbuff", "fedasync", "test_error", scale=100.0, margin=0.5,
                                   what="final error fedbuff - fedasync (points; claimed < 0.5)"))


CLAIMS = [
    Claim("fedasync-faster", "FedAsync reaches the target accuracy sooner in wall-clock time than FedAvg",
          _faster("fedasync")),
    Claim("fedbuff-faster", "FedBuff reaches the target accuracy sooner in wall-clock time than FedAvg",
          _faster("fedbuff")),
    Claim("fedbuff-vs-fedasync", "FedBuff ends at least as accurate as FedAsync (less than 0.5 points more error)",
          _buff_vs_async),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["method"]  # noqa: E731
  colors = _plots.palette(METHODS)
  return [_plots.curves(records, out, "error_vs_time", label=label, xs=("time", "update"), colors=colors),
          _plots.staleness_histograms(records, out, label=label, colors=colors)]


REPRODUCTION = Reproduction(
    name="federated",
    paper="Xie, Koyejo, Gupta: Asynchronous Federated Optimization, 2019; Nguyen et al.: Federated Learning "
          "with Buffered Asynchronous Aggregation, AISTATS 2022",
    description="FedAvg (BSP), FedAsync and FedBuff (ASP) on 10 non-iid clients with lognormal compute times, "
                "same simulated time.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "accuracy_pct", "time_to_target", "updates", "mean_staleness"),
    paper_numbers={k: {"cost_vs_fedbuff": v} for k, v in PAPER_COST_VS_FEDBUFF.items()},
    smoke=dict(steps=10, local_steps=2, eval_points=3, seeds=1),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
