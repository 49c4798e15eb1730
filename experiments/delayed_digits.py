"""What does staleness do to an MLP on digits, and do lr/tau or delay compensation fix it?

Trains a 64-128-10 MLP on scikit-learn's bundled digits with SGD + momentum
wrapped in ``dj.delayed`` at several constant delays tau, with and without the
remedies, over several seeds at once (``jax.vmap``), and prints a table of the
final training loss and test accuracy (mean and standard deviation over
seeds). Writes ``results.json`` and ``accuracy_vs_delay.png`` to ``--out``.

    python -m experiments.delayed_digits            # about a minute on 2 CPU cores
    python -m experiments.delayed_digits --delays 0 2 4 8 16 32 --seeds 5

Methods (each a one-line change of the optimizer):
  asgd       dj.delayed(sgd)                                   plain stale SGD
  lr/tau     dj.delayed(chain(scale_by_staleness("inverse"), sgd))   Zhang et al. 2016
  dc-asgd-c  dj.delayed(chain(delay_compensation(lam), sgd))         Zheng et al. 2017
  dc-asgd-a  dj.delayed(chain(delay_compensation(adaptive=True), sgd))
At tau = 0 all four are the same optimizer, which the table shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from .data import digits

# Config: the defaults finish in about a minute on 2 CPU cores.
DELAYS = (0, 4, 8, 16)
SEEDS = 3
STEPS = 1500
BATCH = 32
HIDDEN = 128
LR = 0.05
MOMENTUM = 0.5
DC_LAMBDA = 0.04  # DC-ASGD-c; MXNet's default
DC_LAMBDA0 = 2.0  # DC-ASGD-a; the paper's lambda_0

METHODS: dict[str, Callable[[float, float], optax.GradientTransformation]] = {
    "asgd": lambda lr, mom: optax.sgd(lr, momentum=mom),
    "lr/tau": lambda lr, mom: optax.chain(dj.scale_by_staleness("inverse"), optax.sgd(lr, momentum=mom)),
    "dc-asgd-c": lambda lr, mom: optax.chain(dj.delay_compensation(DC_LAMBDA), optax.sgd(lr, momentum=mom)),
    "dc-asgd-a": lambda lr, mom: optax.chain(dj.delay_compensation(DC_LAMBDA0, adaptive=True),
                                             optax.sgd(lr, momentum=mom)),
}


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, Any]:
  params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {"w": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
                           "b": jnp.zeros(n_out)}
  return params


def mlp(params: dict[str, Any], x: jax.Array) -> jax.Array:
  layers = [params[k] for k in sorted(params)]
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def accuracy(params, x, y):
  return jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y)


def make_run(tx: optax.GradientTransformation, data, steps: int, batch: int):
  """A jitted function seed -> (loss curve, final train loss, test accuracy), vmappable over seeds."""
  x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
  x_test, y_test = jnp.asarray(data.x_test), jnp.asarray(data.y_test)
  sizes = (x_train.shape[1], HIDDEN, 10)

  def run(seed):
    key = jax.random.PRNGKey(seed)
    params = init_mlp(jax.random.fold_in(key, 0), sizes)

    def step(carry, t):
      params, state = carry
      idx = jax.random.randint(jax.random.fold_in(key, t + 1), (batch,), 0, x_train.shape[0])
      loss, grads = jax.value_and_grad(loss_fn)(params, x_train[idx], y_train[idx])
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, _), curve = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
    return curve, loss_fn(params, x_train, y_train), accuracy(params, x_test, y_test)

  return jax.jit(jax.vmap(run))


def smooth(curve: np.ndarray, window: int = 50) -> np.ndarray:
  kernel = np.ones(window) / window
  return np.convolve(curve, kernel, mode="valid")


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--delays", type=int, nargs="+", default=list(DELAYS))
  parser.add_argument("--seeds", type=int, default=SEEDS)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--batch", type=int, default=BATCH)
  parser.add_argument("--lr", type=float, default=LR)
  parser.add_argument("--momentum", type=float, default=MOMENTUM)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument("--out", default=os.path.join("results", "delayed_digits"))
  parser.add_argument("--no-plot", action="store_true")
  args = parser.parse_args(argv)

  from tqdm.auto import tqdm

  data = digits()
  seeds = jnp.arange(args.seeds)
  rows, curves = [], {}
  jobs = [(tau, m) for tau in args.delays for m in args.methods]
  start = time.perf_counter()
  for tau, method in tqdm(jobs, desc="runs", file=sys.stderr):
    tx = dj.delayed(METHODS[method](args.lr, args.momentum), dj.delays.constant(tau))
    curve, final_loss, test_acc = jax.device_get(make_run(tx, data, args.steps, args.batch)(seeds))
    finite = np.isfinite(final_loss)
    rows.append({
        "delay": tau, "method": method,
        "train_loss_mean": float(np.mean(final_loss)), "train_loss_std": float(np.std(final_loss)),
        "test_acc_mean": float(np.mean(test_acc)), "test_acc_std": float(np.std(test_acc)),
        "diverged_seeds": int(np.sum(~finite)),
    })
    curves[(tau, method)] = np.nanmean(np.where(np.isfinite(curve), curve, np.nan), axis=0)
  elapsed = time.perf_counter() - start

  print(f"\nMLP 64-{HIDDEN}-10 on digits, SGD(lr={args.lr}, momentum={args.momentum}), batch {args.batch}, "
        f"{args.steps} steps, {args.seeds} seeds, constant delay tau (dj.delayed)\n")
  header = f"{'tau':>4}  {'method':<10} {'train loss':>17}  {'test accuracy':>17}  {'diverged':>8}"
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['delay']:>4}  {r['method']:<10} {r['train_loss_mean']:>9.4f} ± {r['train_loss_std']:<6.4f}"
          f"  {100 * r['test_acc_mean']:>8.2f}% ± {100 * r['test_acc_std']:<5.2f}"
          f"  {r['diverged_seeds']:>4}/{args.seeds}")
  print(f"\n{len(jobs)} configurations x {args.seeds} seeds in {elapsed:.1f} s")

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"config": vars(args), "rows": rows, "seconds": elapsed}, f, indent=2)
  if not args.no_plot:
    path = plot(rows, curves, args)
    print(f"wrote {path}")
  return {"rows": rows, "curves": curves}


def plot(rows, curves, args) -> str:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
  for method in args.methods:
    sel = [r for r in rows if r["method"] == method]
    ax_acc.errorbar([r["delay"] for r in sel], [100 * r["test_acc_mean"] for r in sel],
                    yerr=[100 * r["test_acc_std"] for r in sel], marker="o", capsize=3, label=method)
  ax_acc.set_xlabel("delay tau (updates)")
  ax_acc.set_ylabel("test accuracy (%)")
  ax_acc.set_title("Final test accuracy against staleness")
  ax_acc.legend()
  tau = max(args.delays)
  for method in args.methods:
    ax_loss.plot(smooth(curves[(tau, method)]), label=f"{method}, tau={tau}")
  if 0 in args.delays:
    ax_loss.plot(smooth(curves[(0, args.methods[0])]), "k--", label="synchronous (tau=0)")
  ax_loss.set_yscale("log")
  ax_loss.set_xlabel("update")
  ax_loss.set_ylabel("training minibatch loss (smoothed)")
  ax_loss.set_title(f"Training loss at tau={tau}")
  ax_loss.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(args.out, "accuracy_vs_delay.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  main()
