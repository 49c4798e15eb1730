"""Pisces against FedBuff- and FedAsync-style uniform selection on clients of unequal speed (Jiang et al., SoCC 2022).

Twenty non-iid clients (two classes of the digits each), half of them
``slow_factor`` times slower; at most ``concurrency`` train at once. A selected
client reads the server model, runs ``local_steps`` SGD steps on its shard
(``dj.workers.LocalSteps``) and pushes its pseudo-gradient ``x_read - x_new``.
Three servers, all on ``dj.cluster.pisces``'s simulator so that only the rule
differs:

  pisces     clients chosen by utility / (mean staleness + 1)^0.5 with
             exploration, buffer applied at the adaptive pace I = max latency / b
  fedbuff    uniform selection, the buffer applied every ``buffer`` updates
  fedasync   uniform selection, every update applied at once

The servers weigh each update by 1 / (staleness + 1)^0.5 before
averaging the buffer (``dj.per_contribution(dj.scale_by_staleness("polynomial",
a=0.5))``, the artifact's aggregation), then take a server SGD step. A
client's statistical utility is Oort's |B_i| sqrt(mean loss^2) of the initial
model on its shard, given once (``dj.cluster.Pisces`` says why). Every method
runs for the same simulated time; reported: the simulated seconds until the
test accuracy first reaches the target, the final accuracy, the staleness.

**Only the paper's abstract could be read here** (the rules follow the
authors' artifact, see ``dj.cluster.Pisces``). The claim is its headline at
this scale: Pisces reaches the target accuracy sooner than asynchronous
training with uniform selection (FedBuff, FedAsync). Synchronous FedAvg is
left out: its rounds (all clients, ``dj.cluster.bsp()``) compile a program of
their own, which the quick scale's minute cannot pay for five seeds.

    python -m experiments run pisces
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import (COUNT, FRACTION, POSITIVE, Claim, ClaimResult, Range, Reproduction, Summary, mean_rows,
                         paired, remembered)
from ._training import (Task, seeds_like, shared_chunk_size, simulate_record, task_for, time_horizon,
                        with_time_to_target, within_time)
from .federated import non_iid_shards

# Config: 20 clients, the last half 5x slower (lognormal compute times, heavy-tailed as in experiments/federated.py;
# mean 1 s for a fast client), C = 5 concurrent clients, FedBuff's buffer K = 3 of them; local SGD at 0.3, server
# SGD at 1.0 on the staleness-weighted mean of the pseudo-gradients. lanes = concurrency: the three specs and every
# seed share compiled programs.
# Pilots on seed 100 (outside the reported seeds 0-4), before they ran. Schedules alone (60 s): Pisces applies 85
# updates of 189 client updates, FedBuff 34 of 102, FedAsync 107 of 107; Pisces gives the slow half 9% of its
# updates, the uniform ones 37%. Training: with client_lr 0.05 no method reached 85% in 60 s (FedAsync 77%); with
# 0.3 and exponential times FedBuff reached 80% at 40 s, FedAsync at 43 s, Pisces not (67%); with lognormal times
# (kept, with 0.3 and the target 80%) FedBuff at 47 s, Pisces ended at 76%, FedAsync at 72%. Pisces avoids the slow
# clients, and here they hold half the classes: its utilities, measured once, cannot rise as those classes' loss
# stays high (the paper refreshes them after each training), so it trains mostly on the fast half's classes.
# FedAvg (BSP on all 20) is left out: its own compiled program does not fit the quick scale's minute.
# Result (seeds 0-4): both claims inconclusive; no method reached 80% on every seed within the 60 s. Seconds to the
# target (the whole 60 s when never reached), Pisces - FedBuff +5.9 [-7.2, +19.0], Pisces - FedAsync -2.3 [-17.3,
# +12.7]; final accuracy Pisces 75.4%, FedBuff 79.4%, FedAsync 72.7%. Pisces applied 99 updates (FedBuff 38,
# FedAsync 110) of more client updates than either and gave the slow half 11% of them (the uniform ones 42-43%): it
# is the faster to apply updates, but with the utilities fixed it keeps away from the slow clients' classes.
# Seeds at quick scale: 20 (issue 28; was 5). The 5-seed run's per-seed spread, with a miss counted as the 60 s budget
# (see _training.with_time_to_target): Pisces - FedBuff mean +5.8 s, sd 10.6 s, gives a half-width near 5.0 s
# at 20 seeds (5.7 s at 16, the fewest that would clear), enough to decide the 0 margin from that mean if it stays there
# (on the side opposite the claim). Pisces - FedAsync, mean -2.7 s, sd 11.9 s, would need about 80 seeds, well past this
# reproduction's 200 CPU s: more seeds cannot decide it here, and none are added for it. Cost: one Pisces program per
# largest buffer size (five sizes on seeds 0-19), one per uniform method, so near 130 CPU s for 20 seeds.
# Result (seeds 0-19): Pisces - FedBuff +7.0 s [+0.2, +13.8], not held (FedBuff reached 80% sooner); Pisces -
# FedAsync -4.3 s [-9.8, +1.2], inconclusive. Final accuracy Pisces 77.6%, FedBuff 81.0%, FedAsync 75.0%; the slow
# half's share of the updates Pisces 10%, the uniform ones 42%. The quick run took 174 CPU s (148 s wall).
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=32, clients=20, classes_per_client=2, slow_fraction=0.5,
                  slow_factor=5.0, compute="lognormal", concurrency=5, buffer=3, local_steps=5, batch=16,
                  client_lr=0.3, server_lr=1.0, beta=0.5, time_budget=60.0, target_accuracy=0.8, seeds=20,
                  eval_points=20, lanes=5),
    "paper": dict(data="mnist", model="mlp", hidden=200, clients=200, classes_per_client=2, slow_fraction=0.5,
                  slow_factor=5.0, compute="lognormal", concurrency=20, buffer=10, local_steps=20, batch=32,
                  client_lr=0.01, server_lr=1.0, beta=0.5, time_budget=1000.0, target_accuracy=0.95, seeds=1,
                  eval_points=40, lanes=20),
}
METHODS = ("pisces", "fedbuff", "fedasync")

LIMITS = {"clients": COUNT, "classes_per_client": COUNT, "slow_fraction": Range(0.0, 1.0), "slow_factor": Range(1.0),
          "concurrency": COUNT, "buffer": COUNT, "local_steps": COUNT, "client_lr": POSITIVE, "server_lr": POSITIVE,
          "beta": Range(0.0), "time_budget": POSITIVE, "target_accuracy": FRACTION, "eval_points": COUNT,
          "lanes": COUNT}

# The paper's own figure (abstract): Pisces reaches the target accuracy up to 1.9x sooner than the asynchronous
# schemes (a best case over its workloads; 2.0x against the synchronous ones, not run here), written as
# time-to-accuracy relative to Pisces' (Pisces = 1).
PAPER_NUMBERS = {"fedbuff": {"time_vs_pisces": 1.9}}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": m, "method": m} for m in METHODS]


def speeds(config: dict[str, Any]) -> list[float]:
  """Each client's speed: the last ``slow_fraction`` of them ``slow_factor`` times slower."""
  slow = int(round(config["slow_fraction"] * config["clients"]))
  return [1.0] * (config["clients"] - slow) + [1.0 / config["slow_factor"]] * slow


def statistical_utility(task: Task, params: Any, shards: list[np.ndarray]) -> list[float]:
  """Oort's statistical utility of each client, ``|B_i| sqrt(mean_k loss_k^2)``, at ``params`` on its shard."""
  per_example = jax.jit(jax.vmap(lambda x, y: task.loss_fn(params, {"x": x[None], "y": y[None]})))
  out = []
  for shard in shards:
    losses = np.asarray(per_example(jnp.asarray(task.data["x"][shard]), jnp.asarray(task.data["y"][shard])),
                        np.float64)
    out.append(float(len(shard) * np.sqrt(np.mean(losses ** 2))))
  return out


def paradigm(config: dict[str, Any], method: str, utility: list[float] | None) -> dj.cluster.Paradigm:
  c = config["concurrency"]
  if method == "pisces":
    return dj.cluster.pisces(c, utility, beta=config["beta"])
  return dj.cluster.pisces(c, selection="random", aggregate_every=config["buffer"] if method == "fedbuff" else 1)


def server(config: dict[str, Any]) -> optax.GradientTransformation:
  """The server's rule on the clients' pseudo-gradients: the staleness-weighted mean, then an SGD step."""
  return optax.chain(dj.per_contribution(dj.scale_by_staleness("polynomial", a=config["beta"])),
                     optax.sgd(config["server_lr"]))


def _key(config: dict[str, Any], *more: Any) -> str:
  return json.dumps([sorted(config.items()), *more], default=str)


_SCHEDULES: dict[str, tuple[dj.cluster.Schedule, list[np.ndarray], float]] = {}


def schedule(config: dict[str, Any], method: str, seed: int) -> tuple[dj.cluster.Schedule, list[np.ndarray], float]:
  """The run's schedule (cut to the time budget), the clients' shards and the run's horizon (the budget, as a miss
  counts: see ``_training.time_horizon``); kept for the other runs' ``like``."""
  def make() -> tuple[dj.cluster.Schedule, list[np.ndarray], float]:
    task = task_for(config)
    shards = non_iid_shards(task.data["y"], config["clients"], config["classes_per_client"], seed)
    utility = statistical_utility(task, task.init(seed), shards) if method == "pisces" else None
    workers = dj.cluster.workers(config["clients"], compute=config["compute"], speed=speeds(config))
    budget = config["time_budget"]
    # Enough updates to pass the budget: at most `concurrency` pushes per second of a fast client's mean time.
    longest = int(budget * config["concurrency"] * 3) + 10
    rule = paradigm(config, method, utility)
    full = dj.cluster.simulate(rule, workers, longest, seed=seed)
    return within_time(full, budget), shards, time_horizon(full, budget)

  return remembered(_SCHEDULES, _key(config, method, seed), make)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  sched, shards, horizon = schedule(config, spec["method"], seed)
  # The same method's schedules of every configured seed: one compiled program serves them all (their staleness,
  # hence the gradient buffer, differs from seed to seed). Pisces' buffers hold from 6 to 10 contributions at
  # most, by seed, and a shared program needs the same most: its seeds share one program per most (5 programs for
  # the 20 seeds at quick scale, where each seed compiled its own).
  like = seeds_like(config, seed, lambda s: schedule(config, spec["method"], s)[0])
  record = simulate_record(task_for(config), server(config), sched, seed=seed, batch_size=config["batch"],
                           eval_every=max(1, sched.num_updates // config["eval_points"]), progress=progress,
                           scheme="shard", shards=shards,
                           worker=dj.workers.LocalSteps(config["local_steps"], optax.sgd(config["client_lr"])),
                           lanes=config["lanes"], chunk_size=shared_chunk_size(sched.num_updates, most=64),
                           like=like)
  contributions = sched.contributes
  slow = len(speeds(config)) - speeds(config).count(1.0)
  record["metrics"]["slow_share"] = float(contributions[:, len(speeds(config)) - slow:].sum() / contributions.sum())
  return with_time_to_target(record, config["target_accuracy"], horizon)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("method",))
  pisces_time = next((r["time_to_target_bound"] for r in rows if r["method"] == "pisces"), float("nan"))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"])
    r["time_vs_pisces"] = r["time_to_target_bound"] / pisces_time
  return rows


def _sooner(baseline: str):
  def check(summary: Summary) -> ClaimResult:
    return ClaimResult.decide(paired(summary, "pisces", baseline, "time_to_target_bound",
                                     what=f"seconds to the target accuracy, pisces - {baseline}"))
  return check


CLAIMS = [
    Claim("pisces-faster-than-fedbuff", "with clients of unequal speed, Pisces reaches the target accuracy in less "
          "simulated time than FedBuff's uniform selection and buffer (the paper: up to 1.9x)", _sooner("fedbuff")),
    Claim("pisces-faster-than-fedasync", "Pisces reaches the target accuracy in less simulated time than "
          "FedAsync-style uniform selection with every update applied at once", _sooner("fedasync")),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["method"]  # noqa: E731
  colors = _plots.palette(METHODS)
  return [_plots.curves(records, out, "error_vs_time", label=label, xs=("time", "update"), colors=colors),
          _plots.staleness_histograms(records, out, label=label, colors=colors)]


REPRODUCTION = Reproduction(
    name="pisces",
    paper="Jiang, Wang, Li, Li: Pisces, efficient federated learning via guided asynchronous training, SoCC 2022",
    description="Pisces, FedBuff and FedAsync (uniform selection) on 20 non-iid clients, half of them 5x "
                "slower, 5 training at once: simulated time to a target accuracy.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "accuracy_pct", "time_to_target", "time_vs_pisces", "updates", "mean_staleness",
             "max_staleness", "slow_share"),
    paper_numbers=PAPER_NUMBERS,
    smoke=dict(time_budget=4.0, local_steps=1, eval_points=2, seeds=1, clients=4, concurrency=2, buffer=2, lanes=2,
               hidden=8),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
