"""Generalization of delayed SGD (Deng et al.): does the delay shrink the train-test gap?

Deng, Shen, Li, Sun, Li and Tao bound the generalization error of SGD with
a constant delay :math:`\\tau` by :math:`\\tilde O((T - \\tau)/(n\\tau))` on
quadratic convex problems and :math:`\\tilde O(1/n)` on strongly convex
ones, and state: "asynchronous delays reduce the generalization error of
the delayed SGD algorithm" (their abstract; the bounds and this sentence
are what could be confirmed from a reachable source).

Here: softmax regression (convex; ``hidden=[]``) or an MLP on a small
training subset of scikit-learn's digits (``n_train`` images, so that the
gap is measurable), trained by SGD with stale reads of constant delay
:math:`\\tau` (``dj.delays.constant``) for the same number of updates and
the same step at every :math:`\\tau`. The generalization gap is the test
loss minus the training loss (on the whole training subset) at the end;
the table also shows the training loss, since a delay that slows training
also shrinks the gap of an underfitted model: the paper's claim is about the
gap, whatever its cause.

Claims are decided per seed, paired (the same seed gives the same
initialization and minibatches at every :math:`\\tau`): the change of the
gap from :math:`\\tau = 0` has a 95% t-interval over seeds; a claim holds if
the interval lies on the claimed side of zero, fails if it lies on the other
side, and is inconclusive (``held = None``) if it contains zero.

    python -m experiments run generalization
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from experiments import _plots
from experiments._framework import Claim, ClaimResult, Reproduction, Summary, mean_rows
from experiments._training import Task, digits_split, simulate_record
from experiments.data import Split
from experiments.delayed_digits import init_mlp, mlp

SCALES = {
    "quick": dict(data="digits", n_train=300, hidden=[], steps=3000, batch=8, lr=0.1, taus=[0, 4, 16, 32],
                  seeds=5, eval_every=300),
    "paper": dict(data="digits", n_train=300, hidden=[], steps=20_000, batch=8, lr=0.1, taus=[0, 2, 4, 8, 16, 32, 64],
                  seeds=10, eval_every=1000),
}


def paired_interval(diffs: Any, level: float = 0.95) -> tuple[float, float, float]:
  """The mean of paired differences and its two-sided t-interval ``(mean, low, high)`` (NaN below 2 pairs)."""
  from scipy import stats

  d = np.asarray(diffs, np.float64)
  if d.size < 2 or not np.all(np.isfinite(d)):
    return float(np.mean(d)) if d.size else math.nan, math.nan, math.nan
  half = float(stats.t.ppf(0.5 + level / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
  return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def verdict(low: float, high: float, claimed_sign: int) -> bool | None:
  """Held if the interval lies on the claimed side of 0 (``claimed_sign`` -1 or +1), not held if on the other,
  ``None`` (inconclusive) if it contains 0 or is missing."""
  if not (math.isfinite(low) and math.isfinite(high)):
    return None
  if claimed_sign * low > 0 and claimed_sign * high > 0:
    return True
  if claimed_sign * low < 0 and claimed_sign * high < 0:
    return False
  return None


def decided(held: bool | None, figures: str) -> ClaimResult:
  """A claim's result; an undecided one says so (the table prints it as n/a)."""
  return ClaimResult(held, figures if held is not None
                     else "inconclusive (an interval straddles the claim's boundary, or is missing): " + figures)


def task(config: dict[str, Any]):
  """The subset of digits, the model and an evaluation of both losses and errors."""
  split = digits_split()
  n = int(config["n_train"])
  sub = Split(split.x_train[:n], split.y_train[:n], split.x_test, split.y_test)
  sizes = (sub.x_train.shape[1],) + tuple(int(h) for h in config["hidden"]) + (10,)
  x_tr, y_tr, x_te, y_te = (jnp.asarray(a) for a in sub)

  def loss_fn(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, batch["x"]), batch["y"]).mean()

  def eval_fn(params):
    train = loss_fn(params, {"x": x_tr, "y": y_tr})
    test = loss_fn(params, {"x": x_te, "y": y_te})
    return {"train_loss": train, "test_loss": test, "gap": test - train,
            "test_error": jnp.mean(jnp.argmax(mlp(params, x_te), -1) != y_te).astype(jnp.float32)}

  return Task({"x": sub.x_train, "y": sub.y_train}, loss_fn, eval_fn,
              lambda seed: init_mlp(jax.random.PRNGKey(seed), sizes))


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"tau={t}", "tau": int(t)} for t in config["taus"]]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  return simulate_record(task(config), optax.sgd(config["lr"]), dj.delays.constant(spec["tau"]), seed=seed,
                         batch_size=config["batch"], num_updates=config["steps"], eval_every=config["eval_every"],
                         progress=progress)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("tau",))
  gap = {(r["spec"]["tau"], r["seed"]): float(r["metrics"]["gap"]) for r in records}
  base = min(int(t) for t in config["taus"])
  for r in rows:
    seeds = sorted(s for (t, s) in gap if t == r["tau"] and (base, s) in gap)
    r["gap_change"], r["gap_change_low"], r["gap_change_high"] = paired_interval(
        [gap[(r["tau"], s)] - gap[(base, s)] for s in seeds])
  return rows


def _largest_delay_shrinks_gap(summary: Summary) -> ClaimResult:
  keys = sorted(summary, key=lambda k: summary[k]["tau"])
  low, high = summary[keys[-1]]["gap_change_low"], summary[keys[-1]]["gap_change_high"]
  return decided(verdict(low, high, -1), f"gap change from {keys[0]} to {keys[-1]}: "
                     f"{summary[keys[-1]]['gap_change']:+.4f}, 95% interval [{low:+.4f}, {high:+.4f}] "
                     f"(gaps {summary[keys[0]]['gap']:.4f} -> {summary[keys[-1]]['gap']:.4f})")


def _every_delay_shrinks_gap(summary: Summary) -> ClaimResult:
  keys = sorted(summary, key=lambda k: summary[k]["tau"])[1:]
  each = [verdict(summary[k]["gap_change_low"], summary[k]["gap_change_high"], -1) for k in keys]
  held = False if False in each else (True if all(v is True for v in each) else None)
  return decided(held, "gap change from tau=0 (95% interval): " + ", ".join(
      f"{k} {summary[k]['gap_change']:+.4f} [{summary[k]['gap_change_low']:+.4f}, "
      f"{summary[k]['gap_change_high']:+.4f}]" for k in keys))


CLAIMS = [
    Claim("delay-shrinks-gap", "Asynchronous delays reduce the generalization error (the gap at the largest "
          "delay is below the synchronous one)", _largest_delay_shrinks_gap),
    Claim("every-delay-shrinks-gap", "Every delay gives a smaller generalization gap than synchronous SGD (not "
          "held if any delay's gap is larger)", _every_delay_shrinks_gap),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  plt = _plots.pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.5))
  taus = [r["tau"] for r in rows]
  ax.errorbar(taus, [r["gap"] for r in rows], yerr=[r["gap_std"] for r in rows], marker="o", label="test - train loss")
  ax.errorbar(taus, [r["train_loss"] for r in rows], yerr=[r["train_loss_std"] for r in rows], marker="s",
              label="training loss")
  ax.set_xlabel("delay tau")
  ax.set_ylabel("loss")
  ax.legend()
  fig.tight_layout()
  path = os.path.join(out, "gap_vs_delay.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return [path, _plots.curves(records, out, "gap_curves", y="gap", ylabel="test - train loss",
                              label=lambda spec: spec["key"], xs=("update",))]


REPRODUCTION = Reproduction(
    name="generalization",
    paper="Deng, Shen, Li, Sun, Li, Tao: Towards Understanding the Generalizability of Delayed Stochastic "
          "Gradient Descent, arXiv 2308.09430, 2023",
    description="The train-test gap of SGD with a constant delay against the delay, on a small digits subset, "
                "paired over seeds.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "gap", "gap_change", "gap_change_low", "gap_change_high", "train_loss", "test_loss",
             "test_error"),
    smoke=dict(steps=20, seeds=2, taus=[0, 4], eval_every=10, n_train=100),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from experiments.__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
