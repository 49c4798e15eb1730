"""The impact of staleness (Dai et al. 2019): batches to reach a target accuracy, normalized to s = 0.

The paper simulates staleness by computing each gradient at parameters up to
``s`` updates old, and counts the minibatches needed to reach a target
accuracy, divided by the count without staleness, for models of growing depth
and for SGD, momentum, Adam and RMSProp. Here update ``t`` reads the
parameters of version ``t - d_t``, ``d_t`` uniform on ``{0..s}`` (the model
of ``dj.simulate`` with ``dj.delays.uniform(s)``), in one compiled loop per
optimizer and depth whose seed and ``s`` are arguments (:func:`train_fn`:
compilation, not computation, is the cost of these short runs, and this way
every seed is affordable); the models are MLPs with 1 and 3 hidden layers on
digits (quick) or MNIST (paper).

Claims are decided per seed on the logarithm of the slowdown (batches at
``s`` over batches at ``s = 0``); a run that never reached the target counts
as reaching it at the end of the run, a lower bound, and the plot marks it.

    python -m experiments run dai_staleness
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _plots
from ._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                                    seed_values)
from ._training import first_reach, task_for

# Config: one learning rate per optimizer, the usual defaults for each.
SCALES = {
    "quick": dict(data="digits", model="mlp", width=64, depths=[1, 3], staleness=[0, 4, 8, 16], steps=800,
                  batch=32, target_accuracy=0.92, seeds=5, eval_every=20,
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


_TRAIN_FNS: dict[tuple[Any, ...], Any] = {}
_DRAW_FNS: dict[tuple[Any, ...], Any] = {}


def draws_fn(steps: int, batch: int, num_examples: int):
  """The compiled draws ``(seed, s) -> (d, rows)`` of a run: per update ``t``, the delay bound's draw ``d_t``
  uniform on ``{0, ..., s}`` (before the cap at ``t``) and the ``batch`` example indices, from the key
  ``split(fold_in(key(seed), 1), steps)[t]``.

  Apart from the training loop, and shared by every optimizer and depth: drawn inside the loop's step, the
  random bits made most of each loop's compilation (8.7 s of CPU for Adam at depth 3, 3.7 s without them),
  and they do not depend on the model. The draws are the same, bit for bit, either way.
  """
  key = (steps, batch, num_examples)
  if key not in _DRAW_FNS:
    def draws(seed, s):
      keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), 1), steps)

      def draw(k):
        k_delay, k_batch = jax.random.split(k)
        return jax.random.randint(k_delay, (), 0, s + 1), jax.random.randint(k_batch, (batch,), 0, num_examples)

      return jax.vmap(draw)(keys)

    _DRAW_FNS[key] = jax.jit(draws)
  return _DRAW_FNS[key]


def train_fn(config: dict[str, Any], opt: str, depth: int):
  """The run ``(seed, s) -> (test_error, train_loss, delays)`` of one optimizer and depth.

  The stale-read model of ``dj.simulate`` with ``dj.delays.uniform(s)``: update
  ``t`` computes its minibatch gradient at the parameters of version
  ``t - d_t``, ``d_t`` uniform on ``{0, ..., s}`` and capped at ``t``, and
  applies it to version ``t``. Written as one ``lax.scan`` over a ring of the
  last ``max(staleness) + 1`` versions, whose initial parameters and draws
  (:func:`draws_fn`) are arguments, so that every seed and every ``s`` of an
  (optimizer, depth) pair share one compilation: the quick scale's 160 runs
  compile 8 training loops, 2 initializations and 1 draw, where a
  ``dj.simulate`` call per run compiles 160 times (compilation dominates these
  short runs). Test error and training loss are evaluated every
  ``eval_every`` updates.
  """
  key = (opt, config["optimizers"][opt], depth, config["width"], max(config["staleness"]), config["steps"],
         config["batch"], config["eval_every"], config["data"], config.get("data_dir"))
  if key not in _TRAIN_FNS:
    task = task_for(dict(config, hidden=[config["width"]] * depth))
    tx = optimizer(opt, config["optimizers"][opt])
    ring, batch, every = max(config["staleness"]) + 1, config["batch"], config["eval_every"]
    num_examples = task.data["y"].shape[0]
    data = jax.tree.map(jnp.asarray, task.data)
    init, draws = jax.jit(task.init), draws_fn(config["steps"], batch, num_examples)

    def loop(params, bounds, rows):
      buf = jax.tree.map(lambda p: jnp.zeros((ring,) + p.shape, p.dtype).at[0].set(p), params)

      def step(carry, inputs):
        params, opt_state, buf = carry
        t, bound, rows = inputs
        delay = jnp.minimum(bound, t)
        read = jax.tree.map(lambda b: b[(t - delay) % ring], buf)
        grads = jax.grad(task.loss_fn)(read, jax.tree.map(lambda x: x[rows], data))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        buf = jax.tree.map(lambda b, p: b.at[(t + 1) % ring].set(p), buf, params)
        return (params, opt_state, buf), delay

      def chunk(carry, inputs):
        carry, delays = jax.lax.scan(step, carry, inputs)
        return carry, (task.eval_fn(carry[0]), delays)

      inputs = (jnp.arange(config["steps"], dtype=jnp.int32), bounds, rows)
      _, (metrics, delays) = jax.lax.scan(chunk, (params, tx.init(params), buf),
                                          jax.tree.map(lambda x: x.reshape((-1, every) + x.shape[1:]), inputs))
      first = task.eval_fn(params)
      return ({k: jnp.concatenate([first[k][None], v]) for k, v in metrics.items()}, delays.reshape(-1))

    loop = jax.jit(loop)
    _TRAIN_FNS[key] = lambda seed, s: loop(init(seed), *draws(seed, s))
  return _TRAIN_FNS[key]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  if config["steps"] % config["eval_every"]:
    raise ValueError(f"steps ({config['steps']}) must be a multiple of eval_every ({config['eval_every']}).")
  metrics, delays = train_fn(config, spec["optimizer"], spec["depth"])(jnp.int32(seed), jnp.int32(spec["s"]))
  progress(config["steps"], config["steps"])
  metrics = {k: np.asarray(v, np.float64) for k, v in metrics.items()}
  delays = np.asarray(delays)
  updates = np.arange(metrics["test_error"].shape[0]) * config["eval_every"]
  batches = first_reach(updates, metrics["test_error"], 1.0 - config["target_accuracy"])
  return {
      "metrics": {
          "test_error": float(metrics["test_error"][-1]), "train_loss": float(metrics["train_loss"][-1]),
          "updates": config["steps"], "mean_staleness": float(delays.mean()), "max_staleness": int(delays.max()),
          "batches_to_target": batches if math.isfinite(batches) else None,
          # Never reached: at least the whole run (a lower bound, which the claims use).
          "batches_bound": batches if math.isfinite(batches) else float(config["steps"]),
      },
      "curves": {"update": updates, **metrics},
      "staleness_hist": np.bincount(delays),
      "diverged": not bool(np.isfinite(metrics["train_loss"][-1])),
  }


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("optimizer", "depth", "s"))
  for r in rows:
    r["nonfinite_batches"] = sum(v is None for v in r["per_seed"]["batches_to_target"].values())
  summary = {r["key"]: r for r in rows}
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
    # The geometric mean over seeds of batches at s / batches at s = 0 (never reached: the whole run).
    logs = list(_log_slowdown(summary, r["optimizer"], r["depth"], r["s"]).values()) if r["s"] in summary_s(
        summary, r) else []
    r["normalized"] = float(np.exp(np.mean(logs))) if logs else float("nan")
  return rows


def summary_s(summary: Summary, row: dict[str, Any]) -> set[int]:
  """The staleness values run for the row's optimizer and depth, when its s = 0 run is there too."""
  ss = {r["s"] for r in summary.values() if r["optimizer"] == row["optimizer"] and r["depth"] == row["depth"]}
  return ss if 0 in ss else set()


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
  colors = _plots.palette([f"{d} hidden" for d in depths])
  fig, axes = plt.subplots(1, len(opts), figsize=(3.4 * len(opts), 3.2), squeeze=False, sharey=True)
  for ax, opt in zip(axes[0], opts):
    for depth in depths:
      sel = [r for r in rows if r["optimizer"] == opt and r["depth"] == depth]
      ss = [r["s"] for r in sel]
      # The slowdown of each seed (a run that never reached the target: at least the whole run).
      per_seed = [list(_log_slowdown({r["key"]: r for r in rows}, opt, depth, s).values()) for s in ss]
      mean = np.array([np.exp(np.mean(v)) if v else np.nan for v in per_seed], np.float64)
      low = np.array([np.exp(min(v)) if v else np.nan for v in per_seed], np.float64)
      high = np.array([np.exp(max(v)) if v else np.nan for v in per_seed], np.float64)
      color = colors[f"{depth} hidden"]
      ax.plot(ss, mean, "o-", color=color, label=f"{depth} hidden")
      ax.fill_between(ss, low, high, color=color, alpha=0.15, linewidth=0)
      never = [r["s"] for r in sel if r["nonfinite_batches"]]
      ax.plot(never, [mean[ss.index(s)] for s in never], "x", color=color, markersize=9, mew=2,
              label="_never")
    if any(line.get_ydata().size and np.isfinite(line.get_ydata()).any() for line in ax.lines):
      ax.set_yscale("log")
    ax.set_title(opt)
    ax.set_xlabel("staleness s")
    ax.grid(alpha=0.3, which="both")
  axes[0, 0].set_ylabel("batches to target / s = 0")
  axes[0, -1].plot([], [], "kx", mew=2, label="a seed never reached\nthe target (counted as\nthe whole run)")
  seeds = max((r["seeds"] for r in rows), default=0)
  fig.suptitle(f"geometric mean of {seeds} seeds; band: lowest to highest seed", fontsize=9)
  fig.tight_layout()
  _plots.legend_outside(fig, axes[0, -1])
  path = _plots.save(fig, out, "normalized_batches")
  deepest = [r for r in records if r["spec"]["depth"] == depths[-1]]
  s_colors = _plots.palette([f"s={s}" for s in config["staleness"]])
  return [path, _plots.curves(deepest, out, "error_curves_deepest", panels=lambda spec: spec["optimizer"],
                              label=lambda spec: f"s={spec['s']}", xs=("update",), colors=s_colors, log_y=True)]


REPRODUCTION = Reproduction(
    name="dai_staleness",
    paper="Dai, Zhou, Dai, Ho, Xing: Toward Understanding the Impact of Staleness in Distributed Machine "
          "Learning, ICLR 2019",
    description="Batches to reach a target accuracy under stale reads (uniform delays in 0..s), normalized to "
                "s = 0, by depth and optimizer.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "batches_to_target", "nonfinite_batches", "normalized", "error_pct", "mean_staleness"),
    smoke=dict(steps=40, staleness=[0, 4], depths=[1], eval_every=10, optimizers={"sgd": 0.1, "adam": 0.001},
               seeds=2),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
