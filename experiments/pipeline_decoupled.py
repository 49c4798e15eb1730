"""Decoupled (asynchronous) pipeline training and two remedies: ADL's accumulation, DSP's compensation.

In decoupled learning a network is split depth-wise into ``K`` modules that
train asynchronously, each on a different device: module ``k``'s forward pass
reads weights ``K - 1 - k`` updates older than the ones its gradient is applied
to, and its backward pass recomputes the module's forward pass at its current
weights (``dj.cluster.pipeline("1f1b", ..., weights="latest")`` with
``dj.simulate_pipeline``'s ``backward="recompute"``). No flush: after the fill
every device is busy, where a synchronous pipeline (GPipe) idles
:math:`(K - 1)/(M + K - 1)` of its time. Two remedies:

- **ADL** (Zhuang, Lin, Toh: Accumulated Decoupled Learning): each module
  accumulates the gradients of ``M`` micro-batches before it updates, so the
  same delay in micro-batches is about ``M`` times fewer updates; here the
  ``"1f1b"`` schedule with ``num_microbatches = M``:

  .. math::  w_k^{(u+1)} = w_k^{(u)} - \\eta\\, \\frac{1}{M} \\sum_{n = uM}^{uM + M - 1}
             g_k\\big(w^{f}_{n}, w_k^{(u)}; \\xi_n\\big),

  ``w^f_n`` the (older) weights the forward passes of micro-batch ``n`` read.
- **DSP** (Xu, Huo, Huang: Diversely Stale Parameters): modules with
  layer-wise staleness, the lower ones staler, recomputing their forward pass;
  here the stale gradient is corrected towards the current weights with the
  first-order term of ``dj.delay_compensation`` (fed the module's forward
  weights as ``stale_params``),

  .. math::  \\tilde g_k = g_k + \\lambda\\, g_k \\odot g_k \\odot (w_k - w_k^{f}), \\qquad
             w_k \\leftarrow w_k - \\eta\\, \\tilde g_k.

The comparison, on the staged MLP on digits (``K = 4`` modules): every method
sees ``M b`` examples per update for the same number of updates; the plain
decoupled pipeline and DSP take them as one micro-batch of ``M b`` (delay
``K - 1 - k`` updates), ADL as ``M`` micro-batches of ``b``, GPipe (the
synchronous reference, no staleness) as ``M`` micro-batches of ``b`` with a
flush. A pass's time is proportional to its micro-batch's examples (gamma
distributed, a backward pass twice a forward pass on average). Claims: each
remedy closes most (at least half) of the gap in final training loss between
the decoupled pipeline and the synchronous one; ADL's staleness, counted in
updates, is about ``1/M`` of the plain decoupled pipeline's; and decoupling
keeps its speed-up: ADL and the plain decoupled pipeline process more examples
per simulated second than GPipe.

**Only the papers' abstracts could be read here** (ADL: arXiv 2012.03747 and its
ICML 2021 version's abstract; DSP: arXiv 1909.02625, the abstract and the
opening of the full text on ar5iv, up to Figure 2's caption, "DSP(1,1,0;4,2,0)
with Layer-wise Staleness of {4,2,0}"). ADL's rule above is the abstract's
"gradient accumulation to mitigate the stale gradient effect" written on
delayjax's pipeline; DSP's abstract names layer-wise staleness and
recomputation and no compensation term: the compensation used here is
DC-ASGD's first-order term (``dj.delay_compensation``), delayjax's
construction, not checked against the paper. Neither abstract gives a number
to compare with, so there are no ``paper_numbers``.

    python -m experiments run pipeline_decoupled
"""

from __future__ import annotations

import math
from typing import Any

import optax

import delayjax as dj
from . import _plots
from . import pipeline_common as pc
from ._framework import Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows, seed_values

# Config: chosen on pilot seeds (100, 101) that the claims never use; the claims are decided on seeds 0-4. The
# training setting is pipeline_bubbles' (SGD, lr 0.05, momentum 0.9), at which the pilot's synchronous pipeline
# trained (final loss 0.054) and the decoupled one lagged (0.64 +- 0.38): a gap to close. ADL closed it on the pilot
# (0.072). DSP's lambda: 0.04 (MXNet's DC-ASGD default) ended at 0.77, 1.0 at 0.53 +- 0.04, 4.0 at 0.52 +- 0.23,
# DC-ASGD-a with lambda 2 at 0.54 +- 0.28; chosen 1.0 (the lowest spread; none came near the synchronous loss).
# A timing run on pilot seeds 100-104 (300 updates) took 61 CPU s, so the quick scale runs 250 updates (evaluated
# every 125), fixed before seeds 0-4 ran.
# Result (seeds 0-4): final training loss 0.069 (GPipe), 1.15 +- 0.52 (decoupled), 0.116 (ADL), 0.92 +- 0.33 (DSP's
# compensation). ADL closed 0.95 [0.89, 1.01] of the gap (held); DSP 0.10 [-0.39, +0.60] (inconclusive); ADL's
# staleness in updates is 1/M + 0.0007 of the decoupled one's (held); ADL and the decoupled pipeline process 1.56x
# GPipe's examples per simulated second (held).
# Seeds at quick scale: 12 (issue 28; was 5). DSP's closed fraction had sd 0.40 over the 5 seeds around a mean of
# 0.10, 0.40 below its 0.5 margin: at 12 seeds the half-width is near 0.25 (t_11 0.40 / sqrt(12)), enough to decide
# the claim if the mean stays where it is (10 seeds: 0.29). About 1.6 CPU s a seed (4 runs).
# Result (12 seeds, 67 CPU s): DSP's compensation closes -0.16 [-0.53, +0.21] of the gap (not held); ADL 0.96 [0.91,
# 1.01] (held); the staleness and speed-up claims held as before.
SCALES = {
    "quick": dict(stages=4, layers=4, width=32, accumulate=4, steps=250, batch=8, lr=0.05, momentum=0.9, lam=1.0,
                  adaptive=False, eval_every=125, seeds=12),
    "paper": dict(stages=8, layers=8, width=256, accumulate=8, steps=3000, batch=16, lr=0.05, momentum=0.9,
                  lam=1.0, adaptive=False, eval_every=250, seeds=3),
}
GAP_CLOSED, STALENESS_BAND = 0.5, 0.05
# Seconds of a forward pass per example of a micro-batch on one module (a backward pass takes twice as long).
FORWARD_PER_EXAMPLE, SHAPE = 0.125, 4.0

VARIANTS = {  # schedule, micro-batches per update (1 or the config's M), delay compensation
    "sync": ("gpipe", "M", False),
    "decoupled": ("1f1b", 1, False),
    "adl": ("1f1b", "M", False),
    "dsp": ("1f1b", 1, True),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  out = []
  for key, (schedule, m, compensate) in VARIANTS.items():
    m = config["accumulate"] if m == "M" else m
    out.append({"key": key, "schedule": schedule, "microbatches": m, "compensate": compensate,
                "micro_batch": config["batch"] * config["accumulate"] // m})
  return out


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.PipelineSchedule:
  """The spec's schedule: ``steps`` updates of ``spec["microbatches"]`` micro-batches of ``spec["micro_batch"]``
  examples, each pass's mean time proportional to its examples."""
  mean = FORWARD_PER_EXAMPLE * spec["micro_batch"]
  weights = "latest" if spec["schedule"] == "1f1b" else "stash"
  return dj.cluster.pipeline(spec["schedule"], config["stages"], config["steps"],
                             num_microbatches=spec["microbatches"], weights=weights,
                             forward=dj.cluster.gamma(SHAPE, mean), backward=dj.cluster.gamma(SHAPE, 2 * mean),
                             seed=seed)


def _plan(config: dict[str, Any], spec: dict[str, Any], seed: int) -> pc.Training:
  tx = optax.sgd(config["lr"], momentum=config["momentum"] or None)
  if spec["compensate"]:
    tx = optax.chain(dj.delay_compensation(config["lam"], adaptive=config["adaptive"]), tx)
  return pc.Training({**config, "batch": spec["micro_batch"]}, schedule_for(config, spec, seed), tx)


def _finish(config: dict[str, Any], spec: dict[str, Any], sched: dj.cluster.PipelineSchedule,
            record: dict[str, Any]) -> dict[str, Any]:
  record["metrics"].update(
      examples_per_second=sched.num_passes * spec["micro_batch"] / sched.total_time,
      # The forward delay counted in updates, as ADL counts it: the mean over micro-batches and modules.
      staleness_updates=float(sched.forward_staleness.mean()))
  return record


run, run_batch = pc.runners(_plan, _finish)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("schedule", "microbatches", "compensate", "micro_batch"))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"]) if r.get("test_error") is not None else None
  return rows


def gap_closed(decoupled: float, remedy: float, sync: float) -> float:
  """The fraction of the decoupled pipeline's loss gap to the synchronous one that a remedy closes (NaN: no gap)."""
  return (decoupled - remedy) / (decoupled - sync) if decoupled != sync else math.nan


def _closes_gap(remedy: str):
  def check(summary: Summary) -> ClaimResult:
    values = [seed_values(summary, k, "train_loss") for k in ("decoupled", remedy, "sync")]
    closed = across_seeds(gap_closed, *values)
    return ClaimResult.decide(compare(closed, claim="greater", margin=GAP_CLOSED,
                                      what=f"fraction of the decoupled-to-synchronous loss gap {remedy} closes"))

  return check


def _staleness(summary: Summary) -> ClaimResult:
  M = summary["adl"]["microbatches"]
  ratio = across_seeds(lambda a, d: a / d - 1 / M, seed_values(summary, "adl", "staleness_updates"),
                       seed_values(summary, "decoupled", "staleness_updates"))
  return ClaimResult.decide(compare(ratio, claim="within", margin=STALENESS_BAND,
                                    what=f"ADL / decoupled staleness in updates - 1/M (M = {M})"))


def _speedup(summary: Summary) -> ClaimResult:
  def faster(key: str):
    ratio = across_seeds(lambda a, b: a / b, seed_values(summary, key, "examples_per_second"),
                         seed_values(summary, "sync", "examples_per_second"))
    return compare(ratio, claim="greater", margin=1.0, what=f"{key} / sync examples per simulated second")

  return ClaimResult.decide([faster("adl"), faster("decoupled")])


CLAIMS = [
    Claim("adl-closes-gap", f"ADL's accumulation closes at least {GAP_CLOSED:.0%} of the decoupled pipeline's gap to "
                            f"synchronous training (final training loss)", _closes_gap("adl")),
    Claim("dsp-closes-gap", f"DSP's compensation closes at least {GAP_CLOSED:.0%} of that gap", _closes_gap("dsp")),
    Claim("adl-staleness", "accumulating M micro-batches cuts the staleness, in updates, to about 1/M", _staleness),
    Claim("decoupling-speedup", "the decoupled pipelines (plain and ADL) process more examples per simulated "
                                "second than the synchronous one", _speedup),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  return [_plots.curves(records, out, "loss_vs_time", y="train_loss", ylabel="training loss", log_y=True,
                        xs=("update", "time"))]


# No paper_numbers: only the abstracts were reachable, and neither ADL's nor DSP's states a figure.
REPRODUCTION = Reproduction(
    name="pipeline_decoupled",
    paper="Zhuang, Lin, Toh: Accumulated Decoupled Learning: Mitigating Gradient Staleness in Inter-Layer Model "
          "Parallelization, arXiv 2020 (ICML 2021), https://arxiv.org/abs/2012.03747; Xu, Huo, Huang: On the "
          "Acceleration of Deep Learning Model Parallelism with Staleness, CVPR 2020, https://arxiv.org/abs/1909.02625",
    description="A 4-module decoupled pipeline with and without ADL's accumulation and DSP's compensation, against "
                "synchronous GPipe: final loss, staleness and throughput.",
    scales=SCALES, specs=specs, run=run, batch=pc.batch_key, run_batch=run_batch, summarize=summarize, claims=CLAIMS,
    plots=plots,
    columns=("key", "train_loss", "accuracy_pct", "examples_per_second", "staleness_updates", "bubble_fraction",
             "diverged"),
    smoke=dict(steps=8, eval_every=4, seeds=1, width=8, stages=2, layers=2, accumulate=2),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
