"""Gradient compression against dense pushes, by bandwidth, synchronous and asynchronous (Agarwal et al., MLSys 2022).

**Only the abstract and the introduction of the paper were reachable here.** Its claim: gradient compression
(PowerSGD, top-k, signSGD, ...) rarely shortens synchronous data-parallel training in a data center, because on a
fast network the communication it saves is small against what it costs (encoding and decoding, and the extra
iterations a lossy gradient needs), while on a slow network the saved communication dominates. The paper's own
study is of synchronous all-reduce; this reproduction asks the same of a parameter server, under BSP and under ASP.

Each of ``M`` workers computes a minibatch gradient (gamma compute times, mean 1 s) and pushes it over a
``dj.cluster.link``: the push takes ``latency + bytes / bandwidth``, the bytes those of the dense gradient
(``dj.message_bytes(params)``) or of its compressed message (``dj.message_bytes(params, compressor)``).
Compressing costs ``encode_time`` seconds per push (the link's latency; 0 for dense pushes). Each worker
compresses its own push with its own error-feedback memory,
``dj.per_contribution(dj.error_feedback(C, num_workers=M))``, and the server averages the decoded pushes of
an update and takes an SGD step:

  dense     no compression
  topk      top-k, 1% of each leaf, with error feedback (Stich et al. 2018)
  powersgd  PowerSGD rank 2, per-worker warm start, with error feedback (Vogels et al. 2019)

at a high bandwidth (the dense push takes about a tenth of a gradient's compute) and a low one (about ten
gradients' compute). Reported: simulated seconds to a target test accuracy (a run that never reaches it counts
the time budget where the budget cut it, its last update where max_updates ended it: a lower bound), updates,
message bytes.

    python -m experiments run compression
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import COUNT, POSITIVE, Claim, ClaimResult, Reproduction, Summary, mean_rows, paired
from ._training import shared_chunk_size, simulate_record, task_for, time_horizon, with_time_to_target, within_time

# Config, fixed before the first run. The MLP on digits has 9,610 float32 parameters, 38,440 bytes a dense
# push; bandwidths 4e5 and 4e3 bytes/s make that push 0.096 s and 9.6 s against a 1 s mean compute. Top-k
# keeps 1% of each leaf (784 bytes with its indices), PowerSGD rank 2 sends 3,192 bytes. encode_time 0.05 s
# (5% of a gradient's compute) stands for the compression's own cost, which the paper measures on GPUs and
# which cannot be measured in a simulation. Learning rates: SGD 0.2 on BSP's averaged 8 minibatches, 0.05 on
# ASP's single stale ones. Each run stops at its bandwidth's time budget or at max_updates, whichever comes
# first (a run cut before the target counts its simulated time, the conservative side for every claim).
# The first quick run (seeds 0-4, max_updates 200 and 1500) held sync-low-gain (top-k -219 s [-272, -166],
# PowerSGD -228 [-281, -175]) and async-low-gain (-193 [-225, -160], -179 [-216, -142]); the two high-bandwidth
# claims were inconclusive: top-k took longer than dense pushes (+25.9 s [+15.1, +36.6] BSP, +9.5 [+2.0, +17.1]
# ASP), PowerSGD's excess was within the noise (+6.6 [-0.1, +13.2] BSP, +4.7 [-4.5, +14.0] ASP). Every run of
# it had reached the target before update 60 (BSP) and 400 (ASP), so max_updates was then cut to 120 and 800
# for speed (nothing else changed; evaluations come at other updates, so the times move within their spacing).
# That run (the recorded one) gave the same verdicts: sync-low-gain held (top-k -228 s [-278, -179], PowerSGD
# -224 [-282, -166]), async-low-gain held (-197 [-234, -159], -184 [-225, -143]); sync-high-no-gain and
# async-high-no-gain inconclusive: top-k slower (+25.9 [+15.1, +36.6] BSP, +9.7 [+6.8, +12.5] ASP), PowerSGD
# within the noise (+6.6 [-0.1, +13.2], +1.9 [-5.0, +8.7]). Its cost is compilation: six programs (paradigm x
# method) of about 12 s each, then about 1 s per run; 2 min 53 s of CPU in all (10 min 46 s on a loaded machine).
# Seeds: 8 (were 5). PowerSGD's BSP excess at high bandwidth had a per-seed standard deviation of 5.4 s around
# +6.6 s; 8 is the fewest at which a t interval excludes zero for a difference of that size, fixed before seeds
# 5-7 ran. Nothing else changed. With 8, sync-high-no-gain is held (top-k +26.8 [+20.1, +33.5], PowerSGD +9.9
# [+4.0, +15.8]); async-high-no-gain stays inconclusive (PowerSGD +2.8 [-0.9, +6.6]); the low-bandwidth claims
# are held as before.
# Compiled programs (speed only; records identical bit for bit, all 96, and so every verdict): the chunk length
# follows max_updates (128 steps BSP, 256 ASP) rather than each run's length, which the time budget sets seed by
# seed, and ASP computes 2 gradients per step (lanes; the planner chose 4 to 8 by seed and bandwidth, each with
# its own gradient buffer). The seeds of a spec, and for BSP and ASP top-k both bandwidths, then share programs:
# 8 compilations instead of 17, 168 s of CPU instead of 270.
# Seeds at quick scale: 16 (issue 28; were 8), fixed before seeds 8-15 ran, nothing else changed: in the 8-seed run
# async-high-no-gain hung on PowerSGD's ASP excess at high bandwidth, +2.8 s [-0.9, +6.6], per-seed standard
# deviation 4.5 s; t_{N-1} 4.5 / sqrt(N) falls under the 2.8 s of that mean from 13 seeds (2.70), 2.38 at 16, which
# leaves room for the mean to move. The seeds apply to every spec; 8 more cost about 40 s of CPU (111 s at 8).
# Issue 28: a target never reached counts the budget where the budget cut the run, its last update where max_updates
# ended it first (see _training.with_time_to_target). No run of the quick scale missed the 90% target: the rerun's
# records (bit for bit) and verdicts are unchanged. It took 167 CPU s (134 s wall).
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, workers=8, compute="gamma", batch=32,
                  lr_sync=0.2, lr_async=0.05, bandwidths={"high": 4e5, "low": 4e3},
                  time_budgets={"high": 150.0, "low": 500.0}, max_updates={"bsp": 120, "asp": 800},
                  compressors=["topk", "powersgd"], topk_fraction=0.01, rank=2, encode_time=0.05,
                  target_accuracy=0.9, seeds=16, eval_points=30, steps=0, lanes=2),
}
PARADIGMS = ("bsp", "asp")
BANDWIDTHS = ("high", "low")


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"{p}-{b}-{m}", "paradigm": p, "bandwidth": b, "method": m}
          for p in PARADIGMS for b in BANDWIDTHS for m in ["dense"] + list(config["compressors"])]


def compressor(config: dict[str, Any], method: str) -> dj.Compressor | None:
  """The method's compressor with each worker's error-feedback memory (``None``: dense)."""
  m = config["workers"]
  if method == "dense":
    return None
  if method == "topk":
    return dj.error_feedback(dj.top_k(config["topk_fraction"]), num_workers=m)
  if method == "powersgd":
    return dj.error_feedback(dj.powersgd(config["rank"], num_workers=m), num_workers=m)
  raise ValueError(f"compressors must name topk or powersgd, got {method!r}.")


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  task = task_for(config)
  comp = compressor(config, spec["method"])
  nbytes = dj.message_bytes(task.init(seed), comp)
  bandwidth = config["bandwidths"][spec["bandwidth"]]
  latency = 0.0 if comp is None else config["encode_time"]
  workers = dj.cluster.workers(config["workers"], compute=config["compute"],
                               comm=dj.cluster.link(bandwidth, nbytes, latency=latency))
  sync = spec["paradigm"] == "bsp"
  most = config["steps"] or config["max_updates"][spec["paradigm"]]
  budget = config["time_budgets"][spec["bandwidth"]]
  full = dj.cluster.simulate(dj.cluster.bsp() if sync else dj.cluster.asp(), workers, most, seed=seed)
  sched = within_time(full, budget)
  lr = config["lr_sync"] if sync else config["lr_async"]
  tx = optax.sgd(lr) if comp is None else optax.chain(dj.per_contribution(comp), optax.sgd(lr))
  # The chunk length follows the run's bound, not its length (which the time budget sets seed by seed), and ASP
  # fixes its gradients per step: the seeds and both bandwidths of a method then share compiled programs.
  record = simulate_record(task, tx, sched, seed=seed, batch_size=config["batch"],
                           eval_every=max(1, sched.num_updates // config["eval_points"]), progress=progress,
                           chunk_size=shared_chunk_size(most), lanes=None if sync else config.get("lanes"))
  record["metrics"]["message_bytes"] = nbytes
  # A miss counts the budget where the budget cut the run (BSP at high bandwidth, dense pushes at low), its last
  # update where max_updates ended it first (ASP at high bandwidth, compressed pushes at low).
  return with_time_to_target(record, config["target_accuracy"], time_horizon(full, budget))


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("paradigm", "bandwidth", "method"))
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
  return rows


def _versus_dense(summary: Summary, paradigm: str, bandwidth: str, claim: str) -> ClaimResult:
  """Each compressor's seconds to the target against dense pushes, seed by seed, on one paradigm and bandwidth."""
  dense = f"{paradigm}-{bandwidth}-dense"
  methods = [k.rsplit("-", 1)[1] for k in summary if k.startswith(f"{paradigm}-{bandwidth}-") and k != dense]
  return ClaimResult.decide([
      paired(summary, f"{paradigm}-{bandwidth}-{m}", dense, "time_to_target_bound", claim=claim,
             what=f"seconds to the target, {m} - dense ({paradigm.upper()}, {bandwidth} bandwidth)")
      for m in methods])


CLAIMS = [
    Claim("sync-high-no-gain", "At high bandwidth under BSP, no compressor reaches the target sooner than dense "
          "pushes (each takes longer)", lambda s: _versus_dense(s, "bsp", "high", "greater")),
    Claim("sync-low-gain", "At low bandwidth under BSP, every compressor reaches the target sooner than dense "
          "pushes", lambda s: _versus_dense(s, "bsp", "low", "less")),
    Claim("async-high-no-gain", "At high bandwidth under ASP, no compressor reaches the target sooner than dense "
          "pushes (each takes longer)", lambda s: _versus_dense(s, "asp", "high", "greater")),
    Claim("async-low-gain", "At low bandwidth under ASP, every compressor reaches the target sooner than dense "
          "pushes", lambda s: _versus_dense(s, "asp", "low", "less")),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  methods = ("dense",) + tuple(config["compressors"])
  panels = lambda spec: f"{spec['paradigm'].upper()}, {spec['bandwidth']} bandwidth"  # noqa: E731
  label = lambda spec: spec["method"]  # noqa: E731
  return [_plots.curves(records, out, "error_vs_time", panels=panels, label=label, xs=("time", "update"),
                        colors=_plots.palette(methods))]


# No paper_numbers: only abstract and introduction were reachable; their count (6 of 200+ setups) fits no row.
REPRODUCTION = Reproduction(
    name="compression",
    paper="Agarwal, Wang, Venkataraman, Papailiopoulos: On the Utility of Gradient Compression in Distributed "
          "Training Systems, MLSys 2022",
    description="Dense pushes, top-k (1%) and PowerSGD (rank 2), both with error feedback, 8 workers on a link "
                "of high and of low bandwidth, BSP and ASP: simulated time to 90% test accuracy.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "time_to_target", "updates", "message_bytes", "error_pct", "train_loss"),
    smoke=dict(steps=12, eval_points=3, seeds=1, compressors=["topk"], workers=2),
    limits={"lr_sync": POSITIVE, "lr_async": POSITIVE, "bandwidths": POSITIVE, "time_budgets": POSITIVE,
            "max_updates": POSITIVE, "compressors": ("topk", "powersgd"), "topk_fraction": POSITIVE,
            "rank": POSITIVE, "encode_time": POSITIVE, "lanes": COUNT},
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
