"""Asynchrony begets momentum (Mitliagkas et al. 2016): the best explicit momentum falls as workers are added.

Asynchronous SGD with M workers behaves like SGD with an extra, implicit
momentum of about ``1 - 1/M``, so the explicit momentum that trains best
shrinks as M grows (and may turn negative). Here M workers with exponential
compute times (the paper's queueing model) run ASP; for each M a grid of
explicit momenta is trained for the same number of updates, and the best is
the one with the lowest final training loss. ``dj.explicit_momentum(mu_1, M)``
(``mu_1`` the best momentum with one worker) is the additive rule's
prediction, printed next to the measured best.

    python -m experiments run momentum
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                                    or_inf, seed_values)
from ._training import simulate_record, task_for

# Config: a small step, so that momentum matters; the grid reaches below zero. Quick: M = 1 and 16 (a first
# run also had M = 4, whose best momentum tied with M = 1's), three seeds, the best momentum found per seed.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, steps=600, batch=32, lr=0.02,
                  workers=[1, 16], momenta=[-0.3, 0.0, 0.3, 0.6, 0.9], compute="exponential", seeds=3,
                  eval_every=100),
    "paper": dict(data="cifar10", model="resnet20", steps=20_000, batch=128, lr=0.01,
                  workers=[1, 2, 4, 8, 16, 32], momenta=[-0.3, -0.1, 0.0, 0.3, 0.6, 0.8, 0.9], compute="exponential",
                  seeds=1, eval_every=2000),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"M{m}-mu{mu:+.2f}", "workers": m, "momentum": mu}
          for m in config["workers"] for mu in config["momenta"]]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  workers = dj.cluster.workers(spec["workers"], compute=config["compute"])
  sched = dj.cluster.simulate(dj.cluster.asp(), workers, config["steps"], seed=seed)
  # Every momentum, 0 and negative values included, is a heavy-ball trace (at 0 the trace is the gradient itself,
  # so the update is plain SGD's). The learning rate and the momentum are held in the optimizer state
  # (optax.inject_hyperparams), not in the program, so that the runs of one M share a compiled program.
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=config["lr"], momentum=spec["momentum"])
  return simulate_record(task_for(config), tx, sched, seed=seed, batch_size=config["batch"],
                         eval_every=config["eval_every"], progress=progress)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("workers", "momentum"))
  best = _best(rows)
  mu_1 = best.get(min(config["workers"]))
  for r in rows:
    r["best_for_M"] = best.get(r["workers"]) == r["momentum"]
    r["rule_prediction"] = (dj.explicit_momentum(max(mu_1, 0.0), num_workers=r["workers"])
                            if mu_1 is not None else float("nan"))
  return rows


def _loss(row: dict[str, Any]) -> float:
  return or_inf(row["train_loss"])


def _best(rows: Any) -> dict[int, float]:
  """The momentum with the lowest final training loss, per number of workers."""
  best: dict[int, tuple[float, float]] = {}
  for r in rows:
    if r["workers"] not in best or _loss(r) < best[r["workers"]][0]:
      best[r["workers"]] = (_loss(r), r["momentum"])
  return {m: mu for m, (_, mu) in best.items()}


def _best_per_seed(summary: Summary) -> dict[int, dict[Any, float]]:
  """Per number of workers, each seed's momentum with the lowest final training loss."""
  by_m: dict[int, list[tuple[float, dict[Any, float]]]] = {}
  for key, row in summary.items():
    by_m.setdefault(row["workers"], []).append((row["momentum"], seed_values(summary, key, "train_loss")))
  best = {}
  for m, grid in by_m.items():
    seeds = set.intersection(*(set(losses) for _, losses in grid))
    best[m] = {s: min(grid, key=lambda g: g[1][s])[0] for s in sorted(seeds)}
  return best


def _falls(summary: Summary) -> ClaimResult:
  best = _best_per_seed(summary)
  ms = sorted(best)
  return ClaimResult.decide(compare(best[ms[-1]], best[ms[0]], claim="less",
                                    what=f"best explicit momentum M={ms[-1]} - M={ms[0]}"))


def _rule(summary: Summary) -> ClaimResult:
  best = _best_per_seed(summary)
  ms = sorted(best)
  comparisons = []
  for m in ms[1:]:
    error = across_seeds(lambda b1, bm: bm - dj.explicit_momentum(max(b1, 0.0), num_workers=m), best[ms[0]], best[m])
    comparisons.append(compare(error, claim="within", margin=0.3 + 1e-9,
                               what=f"best momentum - mu_1 + (1 - 1/M) at M={m} (claimed within 0.3)"))
  return ClaimResult.decide(comparisons)


CLAIMS = [
    Claim("best-momentum-falls", "the best explicit momentum with the most workers is lower than with one",
          _falls),
    Claim("additive-rule", "mu_1 - (1 - 1/M) predicts the best explicit momentum within 0.3", _rule),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  colors = _plots.palette([f"M = {m}" for m in config["workers"]])
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for m in config["workers"]:
    sel = [r for r in rows if r["workers"] == m]
    losses = np.array([[v if v is not None else np.inf for v in r["per_seed"]["train_loss"].values()] for r in sel])
    mean = np.array([_loss(r) for r in sel])
    ax.plot([r["momentum"] for r in sel], mean, "o-", color=colors[f"M = {m}"], label=f"M = {m}")
    ax.fill_between([r["momentum"] for r in sel], losses.min(axis=1), losses.max(axis=1), color=colors[f"M = {m}"],
                    alpha=0.15, linewidth=0)
  ax.set_yscale("log")
  ax.set_xlabel("explicit momentum")
  ax.set_ylabel("final training loss")
  ax.set_title(f"Asynchrony begets momentum\n({_plots.aggregation(records)}; a diverged run is off the axis)",
               fontsize=9)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  _plots.legend_outside(fig, ax)
  path = _plots.save(fig, out, "loss_vs_momentum")
  best = [r for r in records if any(row["key"] == r["key"] and row["best_for_M"] for row in rows)]
  return [path, _plots.curves(best, out, "best_curves", y="train_loss", ylabel="training loss", log_y=True,
                              label=lambda spec: f"M={spec['workers']}, mu={spec['momentum']:+.1f}"),
          _plots.staleness_histograms([r for r in records if r["spec"]["momentum"] == 0.0], out,
                                      label=lambda spec: f"M = {spec['workers']}", colors=colors)]


# No paper_numbers: only the abstract and the introduction (arXiv 1605.09774) were reachable, and they state no
# figure.
REPRODUCTION = Reproduction(
    name="momentum",
    paper="Mitliagkas, Zhang, Hadjis, Re: Asynchrony begets Momentum, with an Application to Deep Learning, "
          "Allerton 2016",
    description="ASP with M = 1, 4, 16 exponential workers and a grid of explicit momenta: which momentum "
                "trains best at each M.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "train_loss", "test_error", "mean_staleness", "best_for_M", "rule_prediction"),
    smoke=dict(steps=40, workers=[1, 4], momenta=[0.0, 0.9], eval_every=20, seeds=1),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
