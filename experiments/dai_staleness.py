"""The impact of staleness (Dai et al. 2019): batches to reach a target accuracy, normalized to s = 0.

The paper simulates staleness by computing each gradient at parameters up to
``s`` updates old, and counts the minibatches needed to reach a target
accuracy, divided by the count without staleness, for models of growing depth
and for SGD, momentum, Adam and RMSProp. Here update ``t`` reads the
parameters of version ``t - d_t``, ``d_t`` uniform on ``{0..s}`` (the model
of ``dj.simulate`` with ``dj.delays.uniform(s)``), run by ``dj.simulate`` on
that model's schedule (:func:`stale_reads`), one compiled program per
optimizer and depth for every ``s`` and seed (:func:`sweep`: compilation,
not computation, is the cost of these short runs); the models are MLPs with 1 and 3 hidden
layers on digits (quick) or MNIST (paper).

Claims are decided per seed on the logarithm of the slowdown (batches at
``s`` over batches at ``s = 0``); a run that never reached the target counts
as reaching it at the end of the run, a lower bound, and the plot marks it.

    python -m experiments run dai_staleness
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import (COUNT, Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                         seed_values)
from ._training import first_reach, grouped_side_by_side, simulate_record, simulate_records, task_for

# Config: one learning rate per optimizer, the usual defaults for each. lanes: gradients per step of
# dj.simulate, fixed so that every s shares one program (the results depend on it only through rounding). One: a
# run has one gradient per update, which wider steps compute a few at a time where the draws let them and
# otherwise leave lanes idle (at 5 seeds, 4 lanes took 43 s of runs and 1 lane 33 s on 2 cores; same verdicts).
SCALES = {
    "quick": dict(data="digits", model="mlp", width=64, depths=[1, 3], staleness=[0, 4, 8, 16], steps=800,
                  batch=32, target_accuracy=0.92, seeds=5, eval_every=20, lanes=1,
                  optimizers={"sgd": 0.1, "momentum": 0.01, "adam": 0.001, "rmsprop": 0.001}),
    "paper": dict(data="mnist", model="mlp", width=256, depths=[1, 2, 3], staleness=[0, 4, 8, 16],
                  steps=20_000, batch=32, target_accuracy=0.97, seeds=3, eval_every=100, lanes=1,
                  optimizers={"sgd": 0.1, "momentum": 0.01, "adam": 0.001, "rmsprop": 0.001}),
}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"{opt}-d{depth}-s{s}", "optimizer": opt, "depth": depth, "s": s}
          for opt in config["optimizers"] for depth in config["depths"] for s in config["staleness"]]


def optimizer(name: str, lr: float) -> optax.GradientTransformation:
  return {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
          "adam": lambda: optax.adam(lr), "rmsprop": lambda: optax.rmsprop(lr)}[name]()


def stale_reads(config: dict[str, Any], seed: int) -> dict[int, dj.cluster.Schedule]:
  """The stale-read schedule of every ``s`` for ``seed``: ``dj.delays.uniform(s)``'s (update ``t`` reads version
  ``max(0, t - d_t)``, ``d_t`` uniform on ``{0, ..., s}``), all over ``max(staleness) + 1`` round-robin workers,
  so that they have one shape."""
  return dict(zip(config["staleness"], _stale_reads(tuple(config["staleness"]), config["steps"], seed)))


@functools.lru_cache(maxsize=64)
def _stale_reads(staleness: tuple[int, ...], steps: int, seed: int) -> tuple[dj.cluster.Schedule, ...]:
  workers = max(staleness) + 1
  return tuple(dj.runtime.schedule_from_delays(dj.delays.uniform(s), steps, seed, num_workers=workers)
               for s in staleness)


def sweep(config: dict[str, Any], *seeds: int) -> list[dj.cluster.Schedule]:
  """Every schedule of the reproduction's sweep (each ``s`` of each configured seed, and of ``seeds``), the
  ``dj.Execution(like=...)`` of each run.

  Its program is then sized for all of them: every ``s`` and seed of an (optimizer, depth) pair runs one
  compiled program (8 at quick scale for 160 runs), where each ``s`` would compile its own, and seeds
  often again (the updates applied per step depend on the draws). Planning the 20 schedules costs about
  3 ms each.
  """
  seeds = sorted(set(range(config["seeds"])) | set(seeds))
  return [schedule for s in seeds for schedule in stale_reads(config, s).values()]


def batch(config: dict[str, Any], spec: dict[str, Any], seed: int) -> str:
  """The key of the runs computed together (:func:`run_batch`): at quick scale (runs of at most 1,000 steps)
  every pending run, whose programs (:func:`program`) are computed side by side; longer runs (paper scale) one
  program's, so that each program's records are saved before the next one starts."""
  return "every program" if _short(config) else program(config, spec)


def program(config: dict[str, Any], spec: dict[str, Any]) -> str:
  """The runs of one ``dj.simulate`` call: every ``s`` and seed of an (optimizer, depth) pair, the runs of one
  compiled program (see :func:`sweep`). One call pays the host's work of its runs once (preparing, tracing for
  the compile key, the results): at quick scale 8 calls, where a call per spec made 32 and a call per run 160.
  Each record equals the separate run's bit for bit.

  The runs of a call are computed one after the other for as many steps as the longest plan among them. With
  one lane per step (the scales' ``lanes``) every plan has one step per update, whatever ``s``; with wider
  steps a stale run's plan is shorter (``s = 0``'s four times ``s = 16``'s with four lanes), so a call takes
  the seeds of one ``s``.
  """
  if config["lanes"] == 1:
    return f"{spec['optimizer']}-d{spec['depth']}"
  return spec["key"]


def run_batch(config: dict[str, Any], members: list[tuple[dict[str, Any], int]], progress) -> list[dict[str, Any]]:
  """The records of ``members``, each equal to :func:`run`'s bit for bit: one ``dj.simulate`` call per
  :func:`program`, as many calls at a time as the process has CPUs (``_training.side_by_side``: at five seeds
  12.3 s of runs instead of 13.0 s on 2 cores, at one 7.4 s instead of 7.9 s; each program's compile and
  host work leave a CPU idle, which the next program's fill)."""
  for depth in sorted({spec["depth"] for spec, _ in members}):
    # Each depth's task (its data, loss and evaluation) made once, here, not by two threads at once.
    task_for(dict(config, hidden=[config["width"]] * depth))
  return grouped_side_by_side(members, lambda member: program(config, member[0]),
                              functools.partial(_program_records, config), progress)


def _program_records(config: dict[str, Any], members: list[tuple[dict[str, Any], int]],
                     progress) -> list[dict[str, Any]]:
  """The records of ``members``, the runs of one :func:`program`, by one ``dj.simulate`` call."""
  first = members[0][0]
  seeds = [seed for _, seed in members]
  _check_steps(config)
  task = task_for(dict(config, hidden=[config["width"]] * first["depth"]))
  records = simulate_records(task, optimizer(first["optimizer"], config["optimizers"][first["optimizer"]]),
                             [stale_reads(config, seed)[spec["s"]] for spec, seed in members], seeds=seeds,
                             batch_size=config["batch"], eval_every=config["eval_every"], progress=progress,
                             lanes=config["lanes"], like=sweep(config, *seeds), chunk_size=_chunk_size(config))
  return [_with_target(config, record) for record in records]


def _short(config: dict[str, Any]) -> bool:
  """Whether a run has at most 1,000 steps (one lane: one step per update), quick scale's 800."""
  return config["lanes"] == 1 and config["steps"] <= 1000


def _chunk_size(config: dict[str, Any]) -> int | None:
  """The steps per dispatch of a batch: at quick scale the whole run (one step per update with one lane), so that
  the host's work per chunk (its tables, each run's placement) is paid once: at five seeds 13.6 s of runs
  instead of 14.2 s with the default four chunks of 200 (2 cores). Longer runs (paper scale's 20,000 steps)
  keep the default chunks, whose host tables stay small. The records do not depend on it."""
  return config["steps"] if _short(config) else None


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  _check_steps(config)
  task = task_for(dict(config, hidden=[config["width"]] * spec["depth"]))
  record = simulate_record(task, optimizer(spec["optimizer"], config["optimizers"][spec["optimizer"]]),
                           stale_reads(config, seed)[spec["s"]], seed=seed, batch_size=config["batch"],
                           eval_every=config["eval_every"], progress=progress, lanes=config["lanes"],
                           like=sweep(config, seed))
  return _with_target(config, record)


def _check_steps(config: dict[str, Any]) -> None:
  if config["steps"] % config["eval_every"]:
    raise ValueError(f"steps ({config['steps']}) must be a multiple of eval_every ({config['eval_every']}).")


def _with_target(config: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
  """``record`` with the updates its run took to the target accuracy (``batches_to_target``, ``None`` if never)
  and their lower bound (the whole run if never)."""
  curves = record["curves"]
  batches = first_reach(curves["update"], curves["test_error"], 1.0 - config["target_accuracy"])
  record["metrics"].update(
      batches_to_target=batches if math.isfinite(batches) else None,
      # Never reached: at least the whole run (a lower bound, which the claims use).
      batches_bound=batches if math.isfinite(batches) else float(config["steps"]))
  return record


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


# No paper_numbers: only the abstract and the introduction (arXiv 1810.03264) were reachable; they state no figure,
# and the normalized batch counts by depth and optimizer could not be read.
REPRODUCTION = Reproduction(
    name="dai_staleness",
    paper="Dai, Zhou, Dai, Ho, Xing: Toward Understanding the Impact of Staleness in Distributed Machine "
          "Learning, ICLR 2019",
    description="Batches to reach a target accuracy under stale reads (uniform delays in 0..s), normalized to "
                "s = 0, by depth and optimizer.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    limits={"lanes": COUNT}, batch=batch, run_batch=run_batch,
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
