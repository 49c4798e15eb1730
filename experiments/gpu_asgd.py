"""GPU A-SGD (Paine et al. 2013): asynchronous workers that are each a model-parallel pipeline.

Each worker is a synchronous GPipe pipeline of ``K`` stages (``m`` micro-batches
per minibatch, random stage times), so its gradient is exact and its time per
minibatch is the pipeline's makespan, fill and drain included. That time is
the worker's compute time in a parameter-server cluster (each worker replays
its own pipeline's minibatch times, ``dj.cluster.pipeline`` into
``dj.cluster.workers``; see "Model parallelism inside asynchronous workers" in
``docs/howto/pipelines.md``). An MLP on the digits is trained by one pipelined
worker (sequential SGD), by 2 and by 4 asynchronous pipelined workers (ASP,
GPU A-SGD) and by 4 synchronous ones (BSP: every update averages one gradient
of each and waits for the slowest pipeline). Every run computes the same number
of gradients at the same learning rate (BSP applies M times fewer updates, as
in the neighbouring reproductions). Reported: the simulated time to a target
training loss, the speed-up over one pipelined worker, the final test error.

**Only the paper's abstract could be read here**, with third-party summaries
of the rest: the abstract says that using model and data parallelism together
"it is possible to speed up training of large convolutional neural networks";
a summary quotes a figure caption, "Increasing the number of GPU client shows a
significant speed up", and states "comparable performance to single-GPU
training in less time". The claims below are those statements at this scale.
The composition (the worker's time is its pipeline's makespan; no overlap of
the flush with the push) is the library's construction, not the paper's
system, whose figures are machine speeds and are not simulated.

    python -m experiments run gpu_asgd
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import (COUNT, POSITIVE, Claim, ClaimResult, Reproduction, Summary, across_seeds, compare,
                         mean_rows, paired, seed_values)
from ._training import first_reach, shared_chunk_size, simulate_record, task_for

# Config: pipelines of K = 4 stages and m = 4 micro-batches, stage times gamma with shape 4 (forward mean 1 s,
# backward mean 2 s per micro-batch and stage): a minibatch takes about (m + K - 1) 3 = 21 s plus the spread of its
# slowest stages; 4 asynchronous workers, and 2 for the trend in the number of clients. SGD lr 0.1, batch 16, hidden
# 32, 480 gradients and an evaluation every 30, as apam.py's SGD (not tuned here). target_loss: a training loss that
# one pipelined worker and both asynchronous runs passed within their 480 gradients on a pilot seed outside the
# reported ones (100), chosen with every other setting here before the reported seeds (0-3) ran.
# lanes: fixed, so that the seeds of an asynchronous spec share compiled programs. The cluster is simulated once
# (schedule seed 0) for every seed, as apam.py does: the seeds vary the initialization and the minibatches. The
# time to the target is read at the evaluations (every 30 gradients) of that one cluster, so seeds that pass the
# target at the same evaluation report the same time, and an interval of zero width means that all seeds agreed.
# Pilot (seed 100): one worker reached the target at 6879 s, 2 and 4 asynchronous workers at 3828 s and 2110 s,
# the synchronous cluster not in its 120 updates (training loss 0.60 at 3389 s).
# Result (4 seeds, 0-3): 4 asynchronous pipelined workers reached the target 3.60x sooner than one (log 1.28
# [1.28, 1.28] > log 2, held) and 1475 s sooner than 4 synchronous ones (which never reached it; held); 4 against 2
# asynchronous workers, 1432 s [1134, 1729] sooner (held); test error 4 workers - one, +1.53 points [0.48, 2.59]
# against the claimed < 1: inconclusive.
# Seeds at quick scale: 12 (issue 28; was 4). The 4-seed run's gpu-asgd-comparable differences (test error of 4
# workers - one) had a mean of 1.53 points and sd 0.66, 0.53 above the 1-point margin; the half-width t s / sqrt(N)
# is 0.51 at 9 seeds, 0.47 at 10 and 0.42 at 12, which would decide the margin (here: not held) if the mean stayed
# near 1.5. A seed costs one or two CPU s after the first (the programs are shared), so 12 seeds stay near 55 s.
# Result (12 seeds, 46 CPU s; seeds 0-3 the same, bit for bit, as the 4-seed run's): speed-up 3.67x, log 1.30
# [1.27, 1.34] (held); 1427 s [1310, 1544] sooner than 4 synchronous workers (held) and 1607 s [1475, 1739] sooner
# than 2 (held); test error 4 workers - one +0.37 points [-0.40, +1.14]: still inconclusive, the mean having fallen
# from 1.53 with seeds 4-11, the interval across the 1-point margin.
# Seeds at quick scale: 32 (second raise, issue 28; was 12). The 12-seed run's gpu-asgd-comparable differences had
# a mean of +0.37 points and sd 1.21, 0.63 under the 1-point margin; the half-width t s / sqrt(N) is 0.77 at 12
# seeds, 0.62 at 17 (the fewest that would clear the margin from a mean of 0.37) and 0.44 at 32, which would decide
# the margin if the mean stayed under 0.56. 32 seeds took 61 CPU s (user) on seeds 1000-1031 (a timing run, its
# claims not used), within the 100 s allowed this reproduction.
# Result (32 seeds, 55 CPU s user; seeds 0-11 the same, bit for bit, as the 12-seed run's): speed-up 3.69x, log 1.31
# [1.28, 1.33] (held); 1420 s [1346, 1495] sooner than 4 synchronous workers and 1676 s [1591, 1762] sooner than 2
# (held); test error 4 workers - one +0.59 points [+0.01, +1.17]: still inconclusive, seeds 12-31 having raised the
# mean (+0.72 on them) and the sd (1.61) past what the 12-seed run's spread promised.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=32, steps=480, batch=16, lr=0.1, workers=4, few_workers=2,
                  stages=4, microbatches=4, forward=1.0, backward=2.0, stage_shape=4.0, target_loss=0.3, seeds=32,
                  eval_every=30, lanes=4),
}
LIMITS = {"few_workers": COUNT, "stages": COUNT, "microbatches": COUNT, "forward": POSITIVE, "backward": POSITIVE,
          "stage_shape": POSITIVE, "lanes": COUNT, "target_loss": POSITIVE}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  m, few = config["workers"], config["few_workers"]
  return [{"key": "pipe-M1", "paradigm": "asp", "workers": 1},
          {"key": f"gpu-asgd-M{few}", "paradigm": "asp", "workers": few},
          {"key": f"gpu-asgd-M{m}", "paradigm": "asp", "workers": m},
          {"key": f"sync-pipe-M{m}", "paradigm": "bsp", "workers": m}]


@functools.lru_cache(maxsize=64)
def _minibatch_times(stages: int, microbatches: int, forward: float, backward: float, shape: float, rows: int,
                     worker: int) -> tuple[float, ...]:
  p = dj.cluster.pipeline("gpipe", stages, rows, num_microbatches=microbatches,
                          forward=dj.cluster.gamma(shape, forward), backward=dj.cluster.gamma(shape, backward),
                          seed=worker)
  # The flush: minibatch u + 1 enters once stage 0, the last stage to finish minibatch u, has applied update u.
  return tuple(np.diff(p.update_time[:, 0], prepend=0.0).tolist())


def worker_times(config: dict[str, Any], num_workers: int) -> np.ndarray:
  """float64 ``[num_workers, steps]``: each worker's pipeline's minibatch times (worker ``w``'s pipeline seed ``w``).

  Worker ``w`` is the same pipeline in every spec, so one worker, the first ``M`` of the cluster and the cluster
  differ only in how many workers there are and in the paradigm.
  """
  return np.array([_minibatch_times(config["stages"], config["microbatches"], float(config["forward"]),
                                    float(config["backward"]), float(config["stage_shape"]), config["steps"], w)
                   for w in range(num_workers)])


def schedule(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.Schedule:
  workers = dj.cluster.workers(spec["workers"], compute=worker_times(config, spec["workers"]))
  rule = dj.cluster.bsp() if spec["paradigm"] == "bsp" else dj.cluster.asp()
  # The same number of gradients for every run: BSP averages M of them per update.
  updates = config["steps"] // spec["workers"] if spec["paradigm"] == "bsp" else config["steps"]
  return dj.cluster.simulate(rule, workers, max(1, updates), seed=seed)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  sched = schedule(config, spec, 0)
  every = max(1, config["eval_every"] * sched.num_updates // config["steps"])
  record = simulate_record(task_for(config), optax.sgd(config["lr"]), sched, seed=seed, batch_size=config["batch"],
                           eval_every=every, progress=progress, chunk_size=shared_chunk_size(sched.num_updates),
                           lanes=None if spec["paradigm"] == "bsp" else min(config["lanes"], spec["workers"]))
  curves = record["curves"]
  reach = first_reach(curves["time"], curves["train_loss"], config["target_loss"])
  # Never reached: the run's whole simulated time, a lower bound of the time it would take (conservative).
  record["metrics"]["time_to_target"] = reach if reach != math.inf else None
  record["metrics"]["time_to_target_bound"] = reach if reach != math.inf else float(curves["time"][-1])
  record["metrics"]["test_error_pct"] = 100 * record["metrics"]["test_error"]
  return record


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("paradigm", "workers"))
  single = next((r for r in rows if r["workers"] == 1), None)
  for r in rows:
    r["speedup"] = single["time_to_target_bound"] / r["time_to_target_bound"] if single else math.nan
  return rows


def _keys(summary: Summary) -> dict[str, Any]:
  asp = sorted(r["workers"] for r in summary.values() if r["paradigm"] == "asp" and r["workers"] > 1)
  few, m = asp[0], asp[-1]
  return {"single": "pipe-M1", "few": f"gpu-asgd-M{few}", "many": f"gpu-asgd-M{m}", "sync": f"sync-pipe-M{m}",
          "M": m}


def speedups(summary: Summary, key: str) -> dict[Any, float]:
  """Per seed: log(time to the target with one pipelined worker / with ``key``'s), a ratio on a log scale."""
  return across_seeds(lambda one, many: math.log(one / many),
                      seed_values(summary, "pipe-M1", "time_to_target_bound"),
                      seed_values(summary, key, "time_to_target_bound"))


def _speedup(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  half = k["M"] / 2
  return ClaimResult.decide(
      compare(speedups(summary, k["many"]), claim="greater", margin=math.log(half),
              what=f"log speed-up of {k['many']} over {k['single']} (claimed > log {half:g})"),
      f"mean speed-up {summary[k['many']]['speedup']:.2f}x with {k['M']} pipelined workers")


def _faster_than_sync(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  return ClaimResult.decide(
      paired(summary, k["many"], k["sync"], "time_to_target_bound",
             what=f"seconds to the target loss {k['many']} - {k['sync']}"),
      f"speed-up over one pipelined worker: asynchronous {summary[k['many']]['speedup']:.2f}x, synchronous "
      f"{summary[k['sync']]['speedup']:.2f}x")


def _more_clients(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  return ClaimResult.decide(paired(summary, k["many"], k["few"], "time_to_target_bound",
                                   what=f"seconds to the target loss {k['many']} - {k['few']}"))


def _comparable(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  return ClaimResult.decide(paired(summary, k["many"], k["single"], "test_error_pct", margin=1.0,
                                   what=f"test error {k['many']} - {k['single']} (points; claimed < 1)"))


CLAIMS = [
    Claim("gpu-asgd-speedup", "M asynchronous pipelined workers reach the target training loss more than M/2 times "
          "sooner in simulated time than one pipelined worker", _speedup),
    Claim("gpu-asgd-faster-than-sync", "M asynchronous pipelined workers reach the target training loss sooner "
          "than M synchronous ones (BSP) on the same pipelines", _faster_than_sync),
    Claim("gpu-asgd-more-clients", "more asynchronous pipelined workers reach the target sooner: M against M/2",
          _more_clients),
    Claim("gpu-asgd-comparable", "after the same number of gradients, M asynchronous pipelined workers end about "
          "as accurate as one (less than 1 point more test error)", _comparable),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  del config, rows
  return [_plots.curves(records, out, "loss_curves", y="train_loss", ylabel="training loss", log_y=True,
                        label=lambda spec: spec["key"], xs=("update", "time"))]


# No paper_numbers: only the abstract was readable, and its system figures are machine speeds.
REPRODUCTION = Reproduction(
    name="gpu_asgd",
    paper="Paine, Jin, Yang, Lin, Huang: GPU Asynchronous Stochastic Gradient Descent to Speed Up Neural Network "
          "Training, arXiv 1312.6186 (2013)",
    description="Workers that are each a GPipe pipeline (K = 4, m = 4): one, 2 and 4 asynchronous, 4 synchronous; "
                "simulated time to a target loss, speed-up, final accuracy.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "train_loss", "test_error_pct", "time_to_target", "speedup", "simulated_time",
             "mean_staleness", "max_staleness"),
    smoke=dict(steps=40, seeds=1, eval_every=10),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
