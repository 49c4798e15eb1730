"""GBA against synchronous training and ASP with the synchronous hyper-parameters (Su et al., NeurIPS 2022).

Eight workers train the same model three ways, every run on the same number of
gradients (``steps``) with the hyper-parameters tuned for synchronous training
(local batch, learning rate, momentum), as a job switched from all-reduce to a
parameter server without retuning would keep them:

- BSP, the synchronous (all-reduce) job: each update averages one gradient of
  each of the ``M`` workers, a global batch of ``M`` local batches;
- GBA (``dj.cluster.gba(M)``): the server averages every ``M`` gradients
  pushed, from whichever workers pushed them (a worker waits only under the
  exactness restriction of ``dj.cluster.GBA``, not for every straggler), and
  decays the gradients staler than ``iota`` updates
  (``dj.per_contribution(dj.scale_by_staleness("hinge", a=1, b=iota))``);
- ASP: every pushed gradient is an update of its own.

Each gradient straggles (is 10x slower) with a small probability, the shared
cluster of the paper's motivation. Reported: the final test accuracy, the
simulated time the ``steps`` gradients took, the time workers spent blocked and
the staleness.

Only the paper's abstract, a figure caption and a paragraph of its appendix
were reachable (see ``dj.cluster.GBA``). The claims below are the abstract's
at this scale: switching to GBA needs no retuning (it matches the synchronous
accuracy), it is faster than synchronous training when there are stragglers,
and plain asynchronous training with the same hyper-parameters is the one that
loses accuracy.

    python -m experiments run gba
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import COUNT, FRACTION, Claim, ClaimResult, Range, Reproduction, Summary, mean_rows, paired
from ._training import schedule_once, seeds_like, shared_chunk_size, simulate_record, task_for

# Config: M = 8 workers with gamma compute times (mean 1 s); each gradient straggles (10x slower) with
# probability 0.05. The synchronous hyper-parameters: local batch 32, SGD with learning rate 0.5 and momentum 0.5
# (global batch 256), used unchanged by all three. iota = 2: on these schedules GBA's mean staleness is about 1.
# Before any training run, the schedules alone (1200 gradients, seeds 0-1) took BSP 592 and 710 s, GBA 305 and
# 360 s, ASP 193 and 217 s; GBA's largest staleness was 9-11, ASP's 133-189.
# Pilots on seeds outside the reported ones (100, 101; 1200 gradients), before the reported seeds ran: with
# learning rate 0.5 and momentum 0.9 GBA diverged as well as ASP (the stale momentum is too much at that step);
# with 0.2 and 0.5 all three ended at the same accuracy (95.8%: no retuning needed by anyone, nothing to show);
# with 0.5 and 0.5 (kept) BSP ended at 96.1%, GBA 96.5%, ASP at chance. steps = 960 (was 1200) to fit the
# minute of the quick scale.
# lanes: gradients per step (dj.Execution's), fixed so that the seeds of each asynchronous spec share compiled
# programs; BSP keeps the planner's (M gradients per update).
# Result (5 seeds, 960 gradients): two claims held, one inconclusive. GBA computed the gradients 290 s [245, 334]
# sooner than BSP (286 s against 575 s, 2.0x; the paper reports at least 2.4x under strained resources); ASP at the
# synchronous step ended at chance, 87.6 points [86.2, 88.9] more test error than BSP. GBA ended at 92.6% against
# BSP's 96.4%: +3.8 points of test error [-0.2, +7.8], not within the 1.5 claimed, and not clearly worse either.
# Its staleness of about 1 under momentum 0.5 at this step costs accuracy that the synchronous job does not pay
# (pilot seeds 100-101 at 1200 gradients: 96.5% against 96.1%); the paper's "tuning-free" is not shown here.
# Seeds at quick scale: 12 (issue 28; were 5), fixed before seeds 5-11 ran, nothing else changed: the 5-seed run's
# GBA - BSP test error had a per-seed standard deviation of 3.2 points around +3.8; deciding the 1.5-point margin
# from there takes a half-width under 2.3, which t_{N-1} 3.2 / sqrt(N) gives from 11 seeds (2.15) and 12 (2.03).
# The mean sits above the margin, so if it stays there gba-tuning-free becomes "not held" rather than held.
# Result (12 seeds, 62 CPU s): GBA - BSP test error +2.41 points [+0.86, +3.97], inconclusive; the other two held.
# Seeds at quick scale: 32 (issue 28, the second raise of this count; were 12), fixed before seeds 12-31 ran, nothing
# else changed: the 12-seed run's GBA - BSP test error had a per-seed standard deviation of 2.45 points around +2.41;
# deciding the 1.5-point margin from there takes a half-width under 0.91, which t_{N-1} 2.45 / sqrt(N) gives from 31
# seeds (0.90) and 32 (0.88). The mean sits above the margin, so if it stays there gba-tuning-free becomes "not
# held". Seeds past the first few took under a CPU second for the three specs, so 32 seeds should stay near 100 s.
# Result (32 seeds, 107 CPU s; seeds 0-11 as before): GBA - BSP test error +3.63 points [+1.68, +5.58], not held:
# GBA ended at 93.0% against BSP's 96.7%, with two of the new seeds far behind (+14.8 and +28.1 points). GBA was
# 297 s sooner [281, 314] (2.0x) and ASP ended at chance (+86.7 points [+86.0, +87.3]): both held.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=32, steps=960, batch=32, lr=0.5, momentum=0.5, workers=8,
                  compute="gamma", straggle_probability=0.05, straggle_slowdown=10.0, iota=2, seeds=32,
                  eval_every=40, lanes=8),
    "paper": dict(data="cifar10", model="resnet20", steps=62_500, batch=128, lr=0.1, momentum=0.9, workers=8,
                  compute="gamma", straggle_probability=0.05, straggle_slowdown=10.0, iota=2, seeds=1,
                  eval_every=1000, lanes=8),
}

LIMITS = {"straggle_probability": FRACTION, "straggle_slowdown": Range(1.0), "iota": Range(0.0, integer=True),
          "lanes": COUNT}

# The paper's own numbers (abstract): under strained resources GBA is at least 2.4x faster than synchronous training
# (shown beside our speedup, a lower bound there), and against the derived asynchronous training it gains up to 0.2%
# AUC on industrial recommendation tasks (no counterpart on this task).
PAPER_NUMBERS = {"gba-iota2": {"speedup_vs_bsp": 2.4}}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": "bsp", "paradigm": "bsp"}, {"key": f"gba-iota{config['iota']}", "paradigm": "gba"},
          {"key": "asp", "paradigm": "asp"}]


def schedule(config: dict[str, Any], spec: dict[str, Any], seed: int) -> dj.cluster.Schedule:
  """The paradigm's cluster run (simulated once per process: it is also the ``like`` of the other seeds' runs)."""
  def simulate() -> dj.cluster.Schedule:
    m = config["workers"]
    workers = dj.cluster.workers(m, compute=config["compute"], stragglers=dj.cluster.random_stragglers(
        config["straggle_probability"], config["straggle_slowdown"]))
    rule = {"bsp": dj.cluster.bsp(), "gba": dj.cluster.gba(m), "asp": dj.cluster.asp()}[spec["paradigm"]]
    updates = config["steps"] if spec["paradigm"] == "asp" else config["steps"] // m
    return dj.cluster.simulate(rule, workers, max(1, updates), seed=seed)

  return schedule_once(simulate, "gba", spec["paradigm"], config["workers"], config["compute"],
                       config["straggle_probability"], config["straggle_slowdown"], config["steps"], seed)


def optimizer(config: dict[str, Any], spec: dict[str, Any]) -> optax.GradientTransformation:
  sgd = optax.sgd(config["lr"], momentum=config["momentum"])
  if spec["paradigm"] != "gba":
    return sgd
  # GBA's decay of badly stale gradients, per gradient before the buffer is averaged (a fresh one keeps weight 1).
  decay = dj.scale_by_staleness("hinge", a=1.0, b=float(config["iota"]))
  return optax.chain(dj.per_contribution(decay), sgd)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  sched = schedule(config, spec, seed)
  every = max(1, config["eval_every"] * sched.num_updates // config["steps"])
  # BSP's lanes follow its plan; the others' are fixed, so their runs are sized for every seed's plan (which differ
  # in their buffers) and the seeds share one compiled program.
  fixed = spec["paradigm"] != "bsp"
  like = seeds_like(config, seed, lambda s: schedule(config, spec, s)) if fixed else None
  return simulate_record(task_for(config), optimizer(config, spec), sched, seed=seed, batch_size=config["batch"],
                         eval_every=every, progress=progress, chunk_size=shared_chunk_size(sched.num_updates),
                         lanes=config["lanes"] if fixed else None, like=like)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("paradigm",))
  bsp_time = next((r["simulated_time"] for r in rows if r["paradigm"] == "bsp"), float("nan"))
  for r in rows:
    r["accuracy_pct"] = 100 * (1 - r["test_error"])
    r["speedup_vs_bsp"] = bsp_time / r["simulated_time"]   # of the mean times, for the table beside the paper's
  return rows


def _key(summary: Summary, paradigm: str) -> str:
  return next(k for k, r in summary.items() if r["paradigm"] == paradigm)


def _as_accurate(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, _key(summary, "gba"), _key(summary, "bsp"), "test_error", scale=100.0,
                                   margin=1.5, what="test error GBA - BSP (points; claimed < 1.5)"))


def _sooner(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, _key(summary, "gba"), _key(summary, "bsp"), "simulated_time",
                                   what="simulated seconds for the same gradients, GBA - BSP"))


def _asp_loses(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, _key(summary, "asp"), _key(summary, "bsp"), "test_error", scale=100.0,
                                   claim="greater", margin=1.5,
                                   what="test error ASP - BSP (points; claimed > 1.5)"))


CLAIMS = [
    Claim("gba-tuning-free", "with the synchronous hyper-parameters unchanged, GBA ends as accurate as synchronous "
          "training (less than 1.5 points more test error)", _as_accurate),
    Claim("gba-faster", "with stragglers, GBA computes the same gradients in less simulated time than synchronous "
          "training (the paper: at least 2.4x under strained resources)", _sooner),
    Claim("asp-needs-retuning", "ASP with the same hyper-parameters loses accuracy: more than 1.5 points more test "
          "error than synchronous training", _asp_loses),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["key"].upper()  # noqa: E731
  colors = _plots.palette([s["key"].upper() for s in specs(config)])
  return [_plots.curves(records, out, "error_vs_time", label=label, xs=("time",), colors=colors),
          _plots.curves(records, out, "loss_vs_time", y="train_loss", ylabel="training loss", log_y=True,
                        label=label, xs=("time", "update"), colors=colors),
          _plots.staleness_histograms(records, out, label=label, colors=colors)]


REPRODUCTION = Reproduction(
    name="gba",
    paper="Su et al.: GBA, a tuning-free approach to switch between synchronous and asynchronous training, "
          "NeurIPS 2022",
    description="BSP, GBA and ASP with the same (synchronous) hyper-parameters on 8 workers whose gradients "
                "straggle at random: accuracy, simulated time, waiting and staleness.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "accuracy_pct", "train_loss", "simulated_time", "speedup_vs_bsp", "total_wait",
             "max_staleness", "mean_staleness"),
    paper_numbers=PAPER_NUMBERS,
    smoke=dict(steps=64, eval_every=16, seeds=1),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
