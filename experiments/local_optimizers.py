"""Delayed updates with local optimizers (Bogoychev et al., EMNLP 2018) against asynchronous Adam.

**Only the abstract (and a secondary review) of the paper was reachable**: the construction below is the closest
faithful one to what it states. Asynchronous SGD is sped up by *delayed updates*, each worker summing the
gradients of ``k`` minibatches before it pushes (a ``k`` times larger effective minibatch, one push instead of
``k``), which worsens the stale-gradient problem; *local optimizers*, run on each worker, mitigate it. Here:

  asgd           ASP, one minibatch per push, the server's Adam on each stale gradient
  delayed        ASP, ``k`` minibatches per push (one ``k``-times larger minibatch, ``k`` times the compute
                 time), the server's Adam
  delayed-local  the same pushes, but each worker runs its own Adam on its gradients (state kept between
                 pushes) and pushes that Adam step; the server adds it (``optax.sgd(1.0)``):
                 :func:`local_optimizers`

Every push also pays a constant communication time, which delayed updates pay once per ``k`` minibatches:
that is where their speed comes from. Every method runs for the same simulated time.

    python -m experiments run local_optimizers
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import Claim, ClaimResult, Reproduction, Summary, mean_rows, paired
from ._training import schedule_once, seeds_like, shared_chunk_size, simulate_record, task_for, within_time


def local_optimizers(optimizer: optax.GradientTransformation) -> tuple[optax.GradientTransformation,
                                                                       dj.workers.LocalSteps]:
  """The recipe: ``(server tx, worker plug-in)`` for workers that each run their own ``optimizer``.

  Each worker applies ``optimizer`` (its state kept from one push to the next) to its gradient at the
  parameters it read and pushes the negated step; the server adds it unscaled. Pass both to
  ``dj.simulate(..., tx, ..., worker=worker)``. Delayed updates are the minibatch a push sums: a
  ``dj.Sampling(batch_size=k * b)`` and workers ``k`` times slower.
  """
  return optax.sgd(1.0), dj.workers.LocalSteps(1, optimizer, keep_state=True)


# Config, fixed before the first run: Adam at lr 1e-3 (the paper's NMT optimizer, at its usual rate), 8
# workers, minibatch 16 summed k = 4 at a time (delayed), gamma compute times of mean 1 s per minibatch and
# a constant 0.5 s per push. Six seeds, as the other quick reproductions.
# Measured on seeds 0-5 (the first run; nothing was tuned after it): in 150 s asgd applies 802 pushes (802
# minibatches), delayed 267 (1067 minibatches), yet delayed with the server's Adam ends worse (training loss
# 0.31, 7.9% test error, against 0.15 and 3.8%). local-beats-delayed held (-0.084 [-0.143, -0.026]);
# negligible-penalty inconclusive (+0.56 [-1.19, +2.30] points; training loss 0.23 against asgd's 0.15).
# Seeds at quick scale: still 6 (issue 28): negligible-penalty's mean, +0.557 points, sits on its 0.5-point margin;
# with the per-seed standard deviation of 1.66 points a 95% interval would have to be narrower than 0.057 on
# either side, some 3,000 seeds, so more seeds cannot decide it and none were added. It stays inconclusive.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, batch=16, delay=4, lr=1e-3, workers=8,
                  compute="gamma", comm=0.5, time_budget=150.0, seeds=6, eval_points=20, steps=0),
}
METHODS = ("asgd", "delayed", "delayed-local")
# The paper's own figure, from its abstract (the full text, with its tables, was not reachable): delayed updates
# with local optimizers and tuned momentum train a shallow NMT system 27% faster than an optimized baseline
# (asynchronous SGD, in the abstract's context), with negligible BLEU penalty. Written as training speed relative
# to that baseline (asgd = 1, delayed-local = 1.27); the abstract gives no figure for delayed updates alone. Not
# comparable one-to-one with this quick scale, where every method runs for the same simulated time.
PAPER_SPEEDUP = {"asgd": 1.0, "delayed-local": 1.27}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": m, "method": m} for m in METHODS]


def _budget(config: dict[str, Any]) -> float:
  return config["time_budget"] if not config["steps"] else config["steps"] / 100 * config["time_budget"]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  k = 1 if spec["method"] == "asgd" else config["delay"]
  workers = dj.cluster.workers(config["workers"], compute=config["compute"], comm=config["comm"], speed=1.0 / k)
  budget = _budget(config)
  longest = int(budget * config["workers"] / (k + config["comm"])) * 2 + 10

  def schedule(s: int) -> dj.cluster.Schedule:
    return within_time(schedule_once(lambda: dj.cluster.simulate(dj.cluster.asp(), workers, longest, seed=s),
                                     "local_optimizers", k, config["workers"], config["compute"], config["comm"],
                                     longest, s), budget)

  sched = schedule(seed)
  # One program's sizes and chunk length for every seed (their runs within the budget differ in both), so that the
  # seeds share a compiled program.
  like = seeds_like(config, seed, schedule)
  worker = None
  tx = optax.adam(config["lr"])
  if spec["method"] == "delayed-local":
    tx, worker = local_optimizers(optax.adam(config["lr"]))
  return simulate_record(task_for(config), tx, sched, seed=seed, batch_size=k * config["batch"],
                         eval_every=max(1, sched.num_updates // config["eval_points"]), progress=progress,
                         worker=worker, chunk_size=shared_chunk_size(max(s.num_updates for s in like)), like=like)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("method",))
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
  return rows


def _local_beats_delayed(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, "delayed-local", "delayed", "train_loss",
                                   what="training loss delayed-local - delayed"))


def _negligible_penalty(summary: Summary) -> ClaimResult:
  return ClaimResult.decide(paired(summary, "delayed-local", "asgd", "test_error", scale=100.0, margin=0.5,
                                   what="test error delayed-local - asgd (points; claimed < 0.5)"))


CLAIMS = [
    Claim("local-beats-delayed", "With delayed updates, local optimizers end with a lower training loss than "
          "the server's optimizer (same simulated time)", _local_beats_delayed),
    Claim("negligible-penalty", "Delayed updates with local optimizers end within 0.5 points of asynchronous "
          "Adam's test error (same simulated time)", _negligible_penalty),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["method"]  # noqa: E731
  colors = _plots.palette(METHODS)
  return [_plots.curves(records, out, "loss_vs_time", y="train_loss", ylabel="training loss", log_y=True,
                        xs=("time", "update"), label=label, colors=colors)]


REPRODUCTION = Reproduction(
    name="local_optimizers",
    paper="Bogoychev, Junczys-Dowmunt, Heafield, Aji: Accelerating Asynchronous Stochastic Gradient Descent "
          "for Neural Machine Translation, EMNLP 2018",
    description="Asynchronous Adam, delayed updates (k = 4 minibatches per push) with the server's Adam and "
                "with local optimizers, 8 workers, same simulated time.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "train_loss", "error_pct", "updates", "mean_staleness"),
    paper_numbers={k: {"speedup_vs_asgd": v} for k, v in PAPER_SPEEDUP.items()},
    smoke=dict(steps=10, eval_points=3, seeds=1),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
