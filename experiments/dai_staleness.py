"""The impact of staleness (Dai et al. 2019): batches to reach a target accuracy, normalized to s = 0.

The paper simulates staleness by computing each gradient at parameters up to
``s`` updates old, and counts the minibatches needed to reach a target
accuracy, divided by the count without staleness, for models of growing depth
and for SGD, momentum, Adam and RMSProp. Here the stale reads come from
``dj.delays.uniform(s)`` (delay drawn uniformly from {0..s} per update) and
are replayed exactly by ``dj.simulate``; the models are MLPs with 1 to 3
hidden layers on digits (quick) or MNIST (paper).

    python -m experiments run dai_staleness
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import optax

import delayjax as dj
from experiments import _plots
from experiments._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                                    seed_values)
from experiments._training import first_reach, simulate_record, task_for

# Config: one learning rate per optimizer, the usual defaults for each.
SCALES = {
    "quick": dict(data="digits", model="mlp", width=64, depths=[1, 3], staleness=[0, 4, 8, 16], steps=800,
                  batch=32, target_accuracy=0.92, seeds=1, eval_every=20,
                  optimizers={"sgd": 0.1, "momentum": 0.01, "adam": 0.001, "rmsprop": 0.001}),
    "paper": dict(data="mnist", model="mlp", width=256, depths=[1, 2, 3], staleness=[0, 4, 8, 16],
                  steps=20_000, batch=32, target_accuracy=0.97, seeds=3, eval_every=100,
                  optimizers={"sgd": 0.1, "momentum": 0.01, "adam": 0.001, "rmsprop": 0.001}),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"{opt}-d{depth}-s{s}", "optimizer": opt, "depth": depth, "s": s}
          for opt in config["optimizers"] for depth in config["depths"] for s in config["staleness"]]


def optimizer(name: str, lr: float) -> optax.GradientTransformation:
  return {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
          "adam": lambda: optax.adam(lr), "rmsprop": lambda: optax.rmsprop(lr)}[name]()


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  task = task_for(dict(config, hidden=[config["width"]] * spec["depth"]))
  tx = optimizer(spec["optimizer"], config["optimizers"][spec["optimizer"]])
  record = simulate_record(task, tx, dj.delays.uniform(spec["s"]), num_updates=config["steps"], seed=seed,
                           batch_size=config["batch"], eval_every=config["eval_every"], progress=progress)
  curves = record["curves"]
  batches = first_reach(curves["update"], curves["test_error"], 1.0 - config["target_accuracy"])
  record["metrics"]["batches_to_target"] = batches if math.isfinite(batches) else None
  # Never reached: at least the whole run (a lower bound, which the claims use).
  record["metrics"]["batches_bound"] = batches if math.isfinite(batches) else float(config["steps"])
  return record


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("optimizer", "depth", "s"))
  base = {(r["optimizer"], r["depth"]): r["batches_to_target"] for r in rows if r["s"] == 0}
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
    b0 = base.get((r["optimizer"], r["depth"]), float("nan"))
    # Not reaching the target within the run counts as infinitely many batches.
    b = r["batches_to_target"] if math.isfinite(r["batches_to_target"]) else float("inf")
    r["normalized"] = b / b0 if math.isfinite(b0) and b0 > 0 else float("nan")
  return rows


def _axes(summary: Summary) -> tuple[list[str], list[int], list[int]]:
  rows = list(summary.values())
  return (list(dict.fromkeys(r["optimizer"] for r in rows)), sorted({r["depth"] for r in rows}),
          sorted({r["s"] for r in rows}))


def _log_slowdown(summary: Summary, opt: str, depth: int, s: int) -> dict[Any, float]:
  """Per seed, log(batches to target at s / batches at s = 0). A run that never reached the target counts as
  reaching it at the end of the run (a lower bound); a seed whose s = 0 run never reached it is left out."""
  key = f"{opt}-d{depth}-s{{}}"
  bound = seed_values(summary, key.format(s), "batches_bound")
  base = seed_values(summary, key.format(0), "batches_to_target", missing=math.nan)
  return across_seeds(lambda b, b0: math.log(b / b0), bound, base)


def _mean_log(summary: Summary, cells: list[tuple[str, int]], s: int) -> dict[Any, float]:
  """Per seed, the mean log slowdown over the (optimizer, depth) cells: the log of their geometric mean."""
  return across_seeds(lambda *v: float(np.mean(v)), *[_log_slowdown(summary, o, d, s) for o, d in cells])


def _grows_with_s(summary: Summary) -> ClaimResult:
  opts, depths, ss = _axes(summary)
  cells = [(o, d) for o in opts for d in depths]
  means = {s: _mean_log(summary, cells, s) for s in ss}
  comparisons = [compare(means[b], means[a], claim="greater", what=f"log slowdown s={b} - s={a}")
                 for a, b in zip(ss[1:], ss[2:])]
  comparisons.insert(0, compare(means[ss[1]], claim="greater", what=f"log slowdown at s={ss[1]}"))
  return ClaimResult.decide(comparisons)


def _deeper_worse(summary: Summary) -> ClaimResult:
  opts, depths, ss = _axes(summary)
  deep, shallow = (_mean_log(summary, [(o, d) for o in opts], ss[-1]) for d in (depths[-1], depths[0]))
  return ClaimResult.decide(compare(deep, shallow, claim="greater",
                                    what=f"log slowdown at s={ss[-1]}, depth {depths[-1]} - depth {depths[0]}"))


def _sgd_least_hurt(summary: Summary) -> ClaimResult:
  opts, depths, ss = _axes(summary)
  sgd = _mean_log(summary, [("sgd", d) for d in depths], ss[-1])
  return ClaimResult.decide([compare(sgd, _mean_log(summary, [(o, d) for d in depths], ss[-1]), claim="less",
                                     what=f"log slowdown at s={ss[-1]}, sgd - {o}") for o in opts if o != "sgd"])


CLAIMS = [
    Claim("batches-grow-with-s", "staleness raises the batches needed to reach the target, more with larger s "
          "(geometric mean over models and optimizers)", _grows_with_s),
    Claim("deeper-hurt-more", "deeper models need relatively more batches under staleness", _deeper_worse),
    Claim("sgd-least-hurt", "momentum, Adam and RMSProp slow down more under staleness than plain SGD",
          _sgd_least_hurt),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  opts, depths = list(config["optimizers"]), config["depths"]
  fig, axes = plt.subplots(1, len(opts), figsize=(3.4 * len(opts), 3.2), squeeze=False)
  for ax, opt in zip(axes[0], opts):
    for depth in depths:
      sel = [r for r in rows if r["optimizer"] == opt and r["depth"] == depth]
      ax.plot([r["s"] for r in sel], [r["normalized"] for r in sel], "o-", label=f"{depth} hidden")
    ax.set_title(opt)
    ax.set_xlabel("staleness s")
    ax.set_ylabel("batches to target / s = 0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  path = f"{out}/normalized_batches.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  deepest = [r for r in records if r["spec"]["depth"] == depths[-1]]
  return [path, _plots.curves(deepest, out, "error_curves_deepest", panels=lambda spec: spec["optimizer"],
                              label=lambda spec: f"s={spec['s']}", xs=("update",))]


REPRODUCTION = Reproduction(
    name="dai_staleness",
    paper="Dai, Zhou, Dai, Ho, Xing: Toward Understanding the Impact of Staleness in Distributed Machine "
          "Learning, ICLR 2019",
    description="Batches to reach a target accuracy under stale reads (uniform delays in 0..s), normalized to "
                "s = 0, by depth and optimizer.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "batches_to_target", "normalized", "error_pct"),
    smoke=dict(steps=40, staleness=[0, 4], depths=[1], eval_every=10, optimizers={"sgd": 0.1, "adam": 0.001}),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from experiments.__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
