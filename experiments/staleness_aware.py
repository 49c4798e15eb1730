"""Staleness-aware ASGD (Zhang et al. 2016): n-softsync with 30 learners, fixed step against alpha_0 / tau.

n-softsync: the server averages every ``c = floor(lambda / n)`` gradients
into one update, and learners never wait, so the staleness grows with ``n``
(the paper measures a mean of about ``n``). With a fixed step, large ``n``
stalls; dividing the step by the staleness (``dj.scale_by_staleness("inverse")``)
lets every ``n`` train. Every run processes the same number of gradients
(``steps``), so ``n``-softsync applies ``steps / c`` updates.

The step is set per gradient, as the paper does: each of the ``c`` averaged
gradients gets its own ``alpha_0 / tau_l`` (``dj.per_contribution`` at the head
of the chain hands ``dj.scale_by_staleness("inverse")`` each contribution's
own staleness) before they are averaged. ``lr_tau_per="update"`` instead
scales the averaged gradient by ``alpha_0 / tau_max``, the staleness of its
stalest contribution (what ``dj.simulate`` passes an update), for comparison.

    python -m experiments run staleness_aware
"""

from __future__ import annotations

from typing import Any

import optax

import delayjax as dj
from . import _plots
from ._framework import (Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows,
                                    paired, seed_values)
from ._training import learning_rate, schedule_once, seeds_like, simulate_record, task_for

# Config. The paper: CIFAR-10, 30 learners, minibatch 4 (lambda = 30, mu = 4), one alpha_0 for all n.
# alpha_0 = 0.5 suits 1-softsync, whose updates average 30 minibatches (with 0.1, a fixed step is too
# small for staleness to matter on digits, and 1-softsync too slow). Three values of n and (first) three seeds: the
# effects are tens of points, far above the seed-to-seed spread (a first run had n = 1, 2, 5, 15, 30, one seed).
# Seeds at quick scale: 6 (issue 28; was 3). The 3-seed run's lr-tau-robust spreads (alpha0/tau error, largest
# minus smallest over n) were 4.46, 0.27 and 1.39 points: mean 2.04, sd 2.17, 2.96 below the 5-point margin; the
# half-width t s / sqrt(N) is 3.45 at 4 seeds, 2.69 at 5 and 2.28 at 6, which would decide the margin if the mean
# stayed near 2 and leaves it some room to move. The seeds' runs now share compiled programs (``like`` in run; the
# same results bit for bit: 1-softsync's seeds 0-2 matched the 3-seed run's), most of a run's CPU time, so 6 seeds
# are expected near the 3-seed run's 144 s.
# Result (6 seeds, 116 CPU s; all 18 runs of seeds 0-2 the same, bit for bit, as the 3-seed run's): staleness about
# n (held), fixed step n = 30 +85.4 points worse than n = 1 (held), alpha0/tau beats the fixed step at n = 30 by 85.8
# points (held); alpha0/tau spread over n +3.06 points [+0.51, +5.62]: still inconclusive (1-softsync's seeds 3 and
# 4 ended at 8.6% and 9.5%, spreads of 4.2 and 6.7 points).
# Seeds at quick scale: 20 (issue 28, second raise; was 6). The 6-seed run's lr-tau-robust spreads were 4.46, 0.28,
# 1.39, 4.18, 6.69 and 1.39 points: mean 3.06, sd 2.43, 1.94 below the 5-point margin; the half-width t s / sqrt(N) is
# 1.74 at 10 seeds, 1.55 at 12, 1.30 at 16 and 1.14 at 20, so 20 would decide the margin if the mean stayed near 3.06
# and leaves room for the mean or the sd to rise (six spreads, skewed, say little about the sd). The count fits the
# budget because added seeds cost far less than the first ones: a run reuses its spec's compiled program unless its
# schedule needs a new one (two or three per spec), and a cost probe on exploration seeds 1000-1015 (none of them
# reported) ran 16 seeds in 190 CPU s, 0.3-1.3 s per run that reused a program against 7-17 s per run that compiled
# one; the 6-seed run took 144 CPU s on the same machine. 20 seeds are expected near 220 CPU s.
# Result (20 seeds, 205 CPU s user; seeds 0-5 as before): the alpha0/tau spread over n +2.63 points [+1.53, +3.74],
# under the 5-point margin: held; the other three claims held as at 6 seeds.
SCALES = {
    "quick": dict(data="digits", model="mlp", hidden=128, steps=3000, batch=4, lr=0.5, momentum=0.0,
                  learners=30, ns=[1, 5, 30], compute="gamma", lr_tau_per="gradient", seeds=20, eval_every=100),
    "paper": dict(data="cifar10", model="resnet20", steps=3_000_000, batch=4, lr=0.1, momentum=0.0,
                  lr_decay_at=[0.5, 0.75], learners=30, ns=[1, 2, 4, 15, 30], compute="gamma", lr_tau_per="gradient",
                  seeds=1, eval_every=50_000),
}
RULES = ("fixed", "lrtau")
# Test error (%) on CIFAR-10 with 30 learners and minibatch 4, from the paper (see the References page of the
# documentation): with a fixed step 30-softsync (and 15-softsync) stays at about 90%; with alpha_0 / tau every n
# reaches about 18%. Approximate figures; the others (n = 5, a fixed step at n = 1) are not recorded. The paper's model and
# data are not the digits MLP here: only the pattern compares, not the levels.
PAPER_ERROR = {"fixed-n30": 90.0, "lrtau-n1": 18.0, "lrtau-n30": 18.0}
LIMITS = {"lr_tau_per": ("gradient", "update")}


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"{rule}-n{n}", "rule": rule, "n": n} for n in config["ns"] for rule in RULES]


def optimizer(config: dict[str, Any], rule: str, num_updates: int) -> optax.GradientTransformation:
  sgd = optax.sgd(learning_rate(config, num_updates), momentum=config["momentum"] or None)
  if rule == "fixed":
    return sgd
  inverse = dj.scale_by_staleness("inverse")
  return optax.chain(dj.per_contribution(inverse) if config["lr_tau_per"] == "gradient" else inverse, sgd)


def schedule(n: int, learners: int, compute: Any, updates: int, seed: int) -> dj.cluster.Schedule:
  """n-softsync's schedule (simulated once per process: it is also the ``like`` of the other seeds' runs)."""
  def simulate() -> dj.cluster.Schedule:
    return dj.cluster.simulate(dj.cluster.softsync(n), dj.cluster.workers(learners, compute=compute), updates,
                               seed=seed)

  return schedule_once(simulate, "staleness_aware", n, learners, compute, updates, seed)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  per_update = config["learners"] // spec["n"]
  updates = max(1, config["steps"] // per_update)
  cluster = (spec["n"], config["learners"], config["compute"], updates)
  sched = schedule(*cluster, seed)
  # Each seed's schedule has its own staleness, so its own gradient buffer and compiled program (most of a run's
  # CPU time); the schedules of the configured seeds as ``like`` give them one program, one per largest number of
  # minibatches in a contribution (which a shared program must not change). The sizes only pad: the result is the
  # same, bit for bit, as without ``like``.
  like = seeds_like(config, seed, lambda s: schedule(*cluster, s))
  every = max(1, config["eval_every"] * updates // config["steps"])
  return simulate_record(task_for(config), optimizer(config, spec["rule"], updates), sched, seed=seed,
                         batch_size=config["batch"], eval_every=every, progress=progress, like=like)


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("rule", "n"))
  for r in rows:
    r["error_pct"] = 100 * r["test_error"]
    r["error_pct_std"] = 100 * r["test_error_std"]
  return rows


def _ns(summary: Summary) -> list[int]:
  return sorted({r["n"] for r in summary.values()})


def _staleness_tracks_n(summary: Summary) -> ClaimResult:
  comparisons = []
  for n in _ns(summary):
    if n > 1:
      stale = seed_values(summary, f"fixed-n{n}", "mean_staleness")
      comparisons.append(compare({s: (v - n) / n for s, v in stale.items()}, claim="within", margin=0.3,
                                 what=f"(mean staleness - n) / n at n={n}"))
  return ClaimResult.decide(comparisons)


def _fixed_fails(summary: Summary) -> ClaimResult:
  ns = _ns(summary)
  return ClaimResult.decide(paired(summary, f"fixed-n{ns[-1]}", f"fixed-n{ns[0]}", "test_error", scale=100.0,
                                   claim="greater", margin=10.0,
                                   what=f"fixed-step error n={ns[-1]} - n={ns[0]} (points; claimed > 10)"))


def _lrtau_robust(summary: Summary) -> ClaimResult:
  errors = [seed_values(summary, f"lrtau-n{n}", "test_error", scale=100.0) for n in _ns(summary)]
  spread = across_seeds(lambda *e: max(e) - min(e), *errors)
  return ClaimResult.decide(compare(spread, claim="less", margin=5.0,
                                    what="alpha0/tau error spread over n (points; claimed < 5)"))


def _lrtau_beats_fixed(summary: Summary) -> ClaimResult:
  n = _ns(summary)[-1]
  return ClaimResult.decide(paired(summary, f"lrtau-n{n}", f"fixed-n{n}", "test_error", scale=100.0,
                                   what=f"error alpha0/tau - fixed at n={n} (points)"))


CLAIMS = [
    Claim("staleness-about-n", "n-softsync's measured mean staleness is about n (within 30% for n > 1)",
          _staleness_tracks_n),
    Claim("fixed-step-fails", "with a fixed step, the largest n ends more than 10 points worse than n = 1",
          _fixed_fails),
    Claim("lr-tau-robust", "with alpha0/tau, every n reaches about the same error (spread < 5 points)",
          _lrtau_robust),
    Claim("lr-tau-beats-fixed", "at the largest n, alpha0/tau ends with lower error than the fixed step",
          _lrtau_beats_fixed),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: f"{spec['n']}-softsync"  # noqa: E731
  panels = lambda spec: "fixed step" if spec["rule"] == "fixed" else "alpha0 / tau"  # noqa: E731
  colors = _plots.palette([f"{n}-softsync" for n in config["ns"]])
  plt = _plots.pyplot()
  fig, ax = plt.subplots(figsize=(4.5, 3.5))
  fixed = [r for r in rows if r["rule"] == "fixed"]
  ax.errorbar([r["n"] for r in fixed], [r["mean_staleness"] for r in fixed],
              yerr=[r["mean_staleness_std"] for r in fixed], fmt="o-", capsize=3, label="measured mean")
  ax.plot([r["n"] for r in fixed], [r["n"] for r in fixed], "k--", label="tau = n")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("n (softsync)")
  ax.set_ylabel("mean staleness (updates)")
  seeds = max((r["seeds"] for r in rows), default=1)
  ax.set_title(f"Mean staleness, {config['learners']} learners\n(mean of {seeds} seeds; whiskers: ± one std)",
               fontsize=9)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  _plots.legend_outside(fig, ax)
  path = _plots.save(fig, out, "staleness_vs_n")
  return [_plots.curves(records, out, "error_curves", panels=panels, label=label, xs=("update",), colors=colors,
                        log_y=True),
          _plots.staleness_histograms([r for r in records if r["spec"]["rule"] == "fixed"], out, label=label,
                                      colors=colors),
          path]


REPRODUCTION = Reproduction(
    name="staleness_aware",
    paper="Zhang, Gupta, Lian, Liu: Staleness-aware Async-SGD for Distributed Deep Learning, IJCAI 2016",
    description="n-softsync with 30 learners, fixed step against alpha0/tau; equal number of gradients for all.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots, limits=LIMITS,
    columns=("key", "error_pct", "train_loss", "updates", "mean_staleness", "max_staleness"),
    paper_numbers={k: {"error_pct": v} for k, v in PAPER_ERROR.items()},
    smoke=dict(steps=120, ns=[1, 30], eval_every=40, seeds=1),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
