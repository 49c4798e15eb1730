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
initialization and minibatches at every :math:`\\tau`), by the framework's
paired t-intervals (``experiments._framework.paired``): held if the
interval of the gap's change from :math:`\\tau = 0` lies below zero, not
held if above, inconclusive if it contains zero.

    python -m experiments run generalization
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import Claim, ClaimResult, Reproduction, Summary, mean_rows, paired
from ._training import Task, digits_split, simulate_record
from .data import Split
from .delayed_digits import init_mlp, mlp

# Seeds: 15 (were 5). At 5 both claims were inconclusive (tau 32 - tau 0: +0.0023 [-0.0047, +0.0093] nats,
# per-seed std 0.0056); 15 is about the fewest at which a t interval excludes zero for a difference of that
# size, fixed before seeds 5-14 ran. Nothing else changed. With 15 both are not held: the gap at tau = 32 is
# larger than the synchronous one, +0.0046 [+0.0010, +0.0082] nats.
SCALES = {
    "quick": dict(data="digits", n_train=300, hidden=[], steps=3000, batch=8, lr=0.1, taus=[0, 4, 16, 32],
                  seeds=15, eval_every=300),
    "paper": dict(data="digits", n_train=300, hidden=[], steps=20_000, batch=8, lr=0.1, taus=[0, 2, 4, 8, 16, 32, 64],
                  seeds=10, eval_every=1000),
}


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
  base = min(rows, key=lambda r: r["tau"])
  for r in rows:
    r["gap_change"] = r["gap"] - base["gap"]
  return rows


def _by_delay(summary: Summary) -> list[str]:
  return sorted(summary, key=lambda k: summary[k]["tau"])


def _largest_delay_shrinks_gap(summary: Summary) -> ClaimResult:
  keys = _by_delay(summary)
  return ClaimResult.decide(paired(summary, keys[-1], keys[0], "gap", claim="less",
                                   what=f"gap {keys[-1]} - {keys[0]} (nats)"))


def _every_delay_shrinks_gap(summary: Summary) -> ClaimResult:
  keys = _by_delay(summary)
  return ClaimResult.decide([paired(summary, k, keys[0], "gap", claim="less", what=f"gap {k} - {keys[0]} (nats)")
                             for k in keys[1:]])


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


# No paper_numbers: only the abstract and the introduction (arXiv 2308.09430) were reachable; they give the bounds in
# order only and no measured gap.
REPRODUCTION = Reproduction(
    name="generalization",
    paper="Deng, Shen, Li, Sun, Li, Tao: Towards Understanding the Generalizability of Delayed Stochastic "
          "Gradient Descent, arXiv 2308.09430, 2023",
    description="The train-test gap of SGD with a constant delay against the delay, on a small digits subset, "
                "paired over seeds.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "gap", "gap_change", "train_loss", "test_loss",
             "test_error"),
    smoke=dict(steps=20, seeds=1, taus=[0, 4], eval_every=10, n_train=100),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
