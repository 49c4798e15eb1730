"""APAM (asynchronous parallel AMSGrad) against synchronous AMSGrad and asynchronous SGD (Xu et al. 2020).

Eight workers with exponential compute times (mean 1 s) train an MLP on the
digits. APAM's master (``dj.apam``) applies each pushed gradient as it
arrives, whatever parameters it was computed at (ASP); synchronous AMSGrad
(the same rule, staleness 0) waits for all eight and averages them (BSP, a
batch eight times larger per update); asynchronous SGD (the paper's
non-adaptive baseline) and asynchronous Adam (``dj.async_adam``, the same
master without AMSGrad's running maximum) run on the same ASP schedules;
one worker running AMSGrad is the sequential reference for the speed-up.
Every run computes the same number of gradients. Reported: the simulated
time to a target training loss, the speed-up over one worker, the final
training loss and test error.

Reachable were the abstract and the authors' project page, not the
experiments section: the abstract says the numerical results "demonstrate
its clear advantages over the sync counterpart and the async-parallel
nonadaptive SGM"; the project page, that the sync-parallel adaptive method
"achieves very low parallelization speed-up, while APAM can achieve
significantly higher speed-up" and that APAM "can yield higher prediction
accuracy than the async-parallel non-adaptive SGM" (LeNet5 on MNIST against
async SGD; AllCNN on CIFAR-10 against sync AMSGrad). Neither gives a number.

    python -m experiments run apam
"""

from __future__ import annotations

import math
from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import (COUNT, POSITIVE, Claim, ClaimResult, Reproduction, Summary, across_seeds, compare,
                         mean_rows, paired, seed_values)
from ._training import first_reach, shared_chunk_size, simulate_record, task_for

# Config: M = 8 workers with exponential compute times, so that a synchronous step waits for the slowest of eight
# (about 2.7x the mean). lr 0.003 for the three adaptive masters and 0.1 for SGD: usual values for an MLP of this
# size, set before any run and not tuned. hidden 32, 480 gradients and an evaluation every 30 (first tried: 64,
# 800 and 20, which kept every verdict on exploration seeds 100-102 but cost twice the CPU time). target_loss 0.3: a
# training loss that one worker and the asynchronous runs passed on the exploration seeds (one worker at about 320
# simulated s of its 509; sync AMSGrad, with 60 averaged updates, ended at 0.87). Seeds: 4 (0-3), fixed, with every
# other setting here, before they ran. On the exploration seeds "lower test error than async SGD" was -0.37 points
# [-7.6, +6.9] (async SGD's loss ranged 0.19 to 0.36 across seeds): 4 seeds are not expected to decide it.
# Result (4 seeds): APAM reached the target 128 s [118, 138] sooner than sync AMSGrad (which never reached it in
# its 60 updates; its speed-up, 1.77x, is a bound); APAM's speed-up over one worker was 6.1x, log 1.81 [1.67,
# 1.94] > log 4 (held); lower test error than async SGD: -3.2 points [-9.9, +3.5], inconclusive. Asynchronous
# Adam, with no claim of its own, reached the target in 45.6 s against APAM's 52.4 s.
# Seeds at quick scale: 16 (issue 28; was 4). The 4-seed run's apam-beats-async-sgd differences (APAM - async SGD
# test error) had a mean of -3.2 points and sd 4.2, 3.2 below the margin 0; the half-width t s / sqrt(N) is 3.0 at
# 10 seeds, 2.7 at 12 and 2.25 at 16. 16, as the sd comes from 4 seeds, one of them an async SGD run at 13% error,
# and the exploration seeds' mean was nearer 0 (-0.37): if the mean stayed near -3.2, 16 seeds would decide it. A
# seed costs about 2 CPU s after the first (the programs are shared), so 16 seeds stay near 75 s.
# Result (16 seeds, 70 CPU s; seeds 0-3 the same, bit for bit, as the 4-seed run's): faster than sync AMSGrad,
# -126 s [-129, -123] (held); speed-up 6.16x, log 1.82 [1.78, 1.86] (held); lower test error than async SGD, -0.52
# points [-2.36, +1.31]: still inconclusive, near the exploration seeds' -0.37 (seed 3's 13% was the outlier).
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=32, steps=480, batch=16, lr=0.003, sgd_lr=0.1, workers=8,
                  compute="exponential", target_loss=0.3, seeds=16, eval_every=30, lanes=8),
}
LIMITS = {"sgd_lr": POSITIVE, "lanes": COUNT, "target_loss": POSITIVE}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  m = config["workers"]
  return [{"key": "amsgrad-M1", "method": "apam", "paradigm": "asp", "workers": 1},
          {"key": f"sync-amsgrad-M{m}", "method": "apam", "paradigm": "bsp", "workers": m},
          {"key": f"apam-M{m}", "method": "apam", "paradigm": "asp", "workers": m},
          {"key": f"async-adam-M{m}", "method": "async_adam", "paradigm": "asp", "workers": m},
          {"key": f"async-sgd-M{m}", "method": "sgd", "paradigm": "asp", "workers": m}]


def schedule(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.Schedule:
  workers = dj.cluster.workers(spec["workers"], compute=config["compute"])
  rule = dj.cluster.bsp() if spec["paradigm"] == "bsp" else dj.cluster.asp()
  # The same number of gradients for every run: BSP averages M of them per update.
  updates = config["steps"] // spec["workers"] if spec["paradigm"] == "bsp" else config["steps"]
  return dj.cluster.simulate(rule, workers, max(1, updates), seed=seed)


def optimizer(config: dict[str, Any], method: str) -> optax.GradientTransformation:
  if method == "apam":
    return dj.apam(config["lr"])
  if method == "async_adam":
    return dj.async_adam(config["lr"])
  return optax.sgd(config["sgd_lr"])


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  # One simulated cluster (schedule seed 0) for every seed: the seeds vary the initialization and the minibatches.
  # A schedule per seed would give each asynchronous run its own gradient buffer (its largest staleness), hence
  # its own compiled program; one schedule lets the seeds of a spec share one.
  sched = schedule(config, spec, 0)
  every = max(1, config["eval_every"] * sched.num_updates // config["steps"])
  record = simulate_record(task_for(config), optimizer(config, spec["method"]), sched, seed=seed,
                           batch_size=config["batch"], eval_every=every, progress=progress,
                           chunk_size=shared_chunk_size(sched.num_updates),
                           lanes=None if spec["paradigm"] == "bsp" else min(config["lanes"], spec["workers"]))
  curves = record["curves"]
  reach = first_reach(curves["time"], curves["train_loss"], config["target_loss"])
  # Never reached: the run's whole simulated time, a lower bound of the time it would take (conservative).
  record["metrics"]["time_to_target"] = reach if reach != math.inf else None
  record["metrics"]["time_to_target_bound"] = reach if reach != math.inf else float(curves["time"][-1])
  record["metrics"]["test_error_pct"] = 100 * record["metrics"]["test_error"]
  return record


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("method", "paradigm", "workers"))
  single = next((r for r in rows if r["workers"] == 1), None)
  for r in rows:
    r["speedup"] = single["time_to_target_bound"] / r["time_to_target_bound"] if single else math.nan
  return rows


def _keys(summary: Summary) -> dict[str, str]:
  m = max(r["workers"] for r in summary.values())
  return {"single": "amsgrad-M1", "sync": f"sync-amsgrad-M{m}", "apam": f"apam-M{m}", "adam": f"async-adam-M{m}",
          "sgd": f"async-sgd-M{m}", "M": m}


def _speedups(summary: Summary, key: str) -> dict[Any, float]:
  # Per seed: log(time to target with one worker / with M): a ratio, compared on a log scale.
  k = _keys(summary)
  return across_seeds(lambda one, many: math.log(one / many),
                      seed_values(summary, k["single"], "time_to_target_bound"),
                      seed_values(summary, key, "time_to_target_bound"))


def _faster_than_sync(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  a, s = summary[k["apam"]], summary[k["sync"]]
  return ClaimResult.decide(
      paired(summary, k["apam"], k["sync"], "time_to_target_bound",
             what=f"seconds to the target loss {k['apam']} - {k['sync']}"),
      f"speed-up over one worker: APAM {a['speedup']:.2f}x, sync AMSGrad {s['speedup']:.2f}x at M = {k['M']}")


def _speedup(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  half = k["M"] / 2
  return ClaimResult.decide(
      compare(_speedups(summary, k["apam"]), claim="greater", margin=math.log(half),
              what=f"log speed-up of {k['apam']} over {k['single']} (claimed > log {half:g})"),
      f"mean speed-up {summary[k['apam']]['speedup']:.2f}x with {k['M']} workers")


def _beats_sgd(summary: Summary) -> ClaimResult:
  k = _keys(summary)
  a, s = summary[k["apam"]], summary[k["sgd"]]
  return ClaimResult.decide(
      paired(summary, k["apam"], k["sgd"], "test_error_pct", what=f"test error {k['apam']} - {k['sgd']} (points)"),
      f"test error APAM {a['test_error_pct']:.2f}%, async SGD {s['test_error_pct']:.2f}%; training loss "
      f"{a['train_loss']:.4f} and {s['train_loss']:.4f}")


CLAIMS = [
    Claim("apam-faster-than-sync", "APAM reaches the target training loss sooner in simulated time than "
          "synchronous AMSGrad on the same workers", _faster_than_sync),
    Claim("apam-speedup", "APAM's speed-up over one worker is nearly linear: more than M/2 in simulated time to "
          "the target loss", _speedup),
    Claim("apam-beats-async-sgd", "APAM ends with a lower test error than asynchronous (non-adaptive) SGD after "
          "the same number of gradients", _beats_sgd),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  del config, rows
  return [_plots.curves(records, out, "loss_curves", y="train_loss", ylabel="training loss", log_y=True,
                        label=lambda spec: spec["key"], xs=("update", "time"))]


# No paper_numbers: the reachable texts (abstract, project page) give none.
REPRODUCTION = Reproduction(
    name="apam",
    paper="Xu, Xu, Yan, Sutcher-Shepard, Grinberg, Chen: Parallel and Distributed Asynchronous Adaptive "
          "Stochastic Gradient Methods, Mathematical Programming Computation (arXiv 2002.09095, 2020)",
    description="APAM, synchronous AMSGrad, asynchronous Adam and asynchronous SGD on 8 workers, and AMSGrad on "
                "one: simulated time to a target loss, speed-up, final accuracy.",
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
