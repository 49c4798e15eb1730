"""Asynchronous SGD escaping a strict saddle (Wang, Shen, Zhao): how the number of workers bounds the speed-up.

**Only the paper's abstracts (arXiv 1910.06000, v3 and v6) could be read from a reachable source; the algorithm's
constants, the theorem's exact statement and the paper's experiments could not.** What the abstracts state:
asynchronous parallel SGD with consistent read (APSGD: every gradient is computed at one earlier server version,
staleness proportional to the number of workers) near a strict saddle may come back after escaping, but after
staying near it for a time of the order of the delay bound it leaves for good (v3); if the number of workers is
:math:`\\widetilde O(K^{1/3} b^{-1/3})` (:math:`K` updates, minibatch :math:`b`; :math:`K^{1/2} b^{-1/2}` in v4),
APSGD reaches an :math:`\\epsilon`-second-order stationary point, :math:`\\|\\nabla f\\| \\le \\epsilon`,
:math:`\\nabla^2 f \\succeq -\\sqrt\\epsilon I`, and the linear speed-up is achieved (v6). Beyond that bound the
delay, not the work, sets the pace.

The closest faithful construction: ``dj.problems.strict_saddle``, :math:`f(x) = \\frac12 x^\\top H x +
\\frac\\lambda4 \\|x\\|^4` with :math:`H = \\mathrm{diag}(-1, h_1..h_{d-1})` (a strict saddle at the origin,
minima :math:`\\pm e_0`), started at the saddle itself, where the gradient is zero and only the noise moves the
iterate. The stochastic gradient is :math:`\\nabla f(x) + \\sigma \\bar z`, :math:`\\bar z` the mean of a
minibatch of rows of a table of standardized Gaussian rows (the paper's minibatch noise; no added perturbation,
which v6 does not use). :math:`M` asynchronous workers, each taking one time unit per gradient, round-robin, are
``dj.delays.constant(M - 1)`` stale reads (``dj.simulate``); with ``optax.sgd(lr)`` this is APSGD. An update is
applied every :math:`1/M` time units, so the simulated time to a second-order stationary point is :math:`U_M / M`
for :math:`U_M` updates, and the speed-up over one worker is :math:`M\\,U_1 / U_M`: linear while :math:`U_M`
stays near :math:`U_1`. The bound on :math:`M` that the abstract gives in order only is, on this problem, the
exact stability limit of delayed gradient descent on its largest curvature :math:`L` (``dj.analysis``:
:math:`\\eta L < 2\\sin(\\pi / (2(2\\tau + 1)))`), reported as ``tau_stable`` beside the abstract's order
:math:`K^{1/3} b^{-1/3}` (``paper_order``, constants unknown).

Measured per run: ``updates_to_escape``, the first update at which :math:`x_0^2 \\ge r^2/4` (left the saddle's
neighbourhood), and ``updates_to_sosp``, the first at which :math:`\\|\\nabla f(x_u)\\| \\le \\epsilon` and
:math:`\\lambda_{\\min}(\\nabla^2 f(x_u)) \\ge -\\sqrt\\epsilon` (the exact gradient and Hessian; ``None`` when
not reached in ``steps`` updates). Claims, written before the run, decided per seed by the framework's 95%
t-intervals (paired on the seed, which fixes the noise table and the minibatches for every :math:`M`): (1) for
every :math:`M` within the stability bound, the run reaches a second-order stationary point within the budget;
(2) up to ``linear_up_to`` workers the updates needed grow by less than a factor ``1 / efficiency`` over one
worker (near-linear speed-up in simulated time); (3) the updates needed grow with :math:`M` (largest stable
:math:`M` against ``linear_up_to``); (4) beyond the bound (the largest :math:`M`) the run does not reach a
second-order stationary point within the budget: no speed-up at all (a seed that never reaches counts as
infinitely many updates; an exact sign test decides, which takes 6 seeds or more).

    python -m experiments run saddle_escape
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from delayjax import analysis
from . import _plots
from ._framework import COUNT, POSITIVE, Claim, ClaimResult, Range, Reproduction, Summary, mean_rows, paired

SCALES = {
    "quick": dict(dim=8, h_max=3.0, lam=1.0, lr=0.02, sigma=0.1, batch=1, workers=[1, 2, 4, 8, 16, 32],
                  linear_up_to=8, efficiency=0.75, epsilon=0.05, steps=1000, examples=2048, seeds=10),
    "paper": dict(dim=32, h_max=3.0, lam=1.0, lr=0.02, sigma=0.1, batch=1, workers=[1, 2, 4, 8, 12, 16, 24, 32, 48],
                  linear_up_to=8, efficiency=0.75, epsilon=0.05, steps=4000, examples=8192, seeds=10),
}
# Gradients per compiled step and steps per chunk, the same for every M: one compiled program serves the sweep.
LANES = 4
CHUNK = 256


def problem(config: dict[str, Any]) -> dj.problems.StrictSaddle:
  """Eigenvalues ``-1`` (the escape direction) and ``d - 1`` evenly spaced in ``[h_max / (d - 1), h_max]``."""
  d = int(config["dim"])
  return dj.problems.strict_saddle(np.concatenate([[-1.0], np.linspace(config["h_max"] / max(d - 1, 1),
                                                                        config["h_max"], d - 1)]), lam=config["lam"])


def tau_stable(config: dict[str, Any]) -> int:
  """The largest constant delay at which delayed gradient descent with ``lr`` is stable on the largest curvature."""
  lipschitz, tau = problem(config).smoothness, 0
  while analysis.stable_learning_rate(lipschitz, tau + 1) > float(config["lr"]):
    tau += 1
  return tau if analysis.stable_learning_rate(lipschitz, 0) > float(config["lr"]) else -1


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"M={m}", "workers": int(m)} for m in config["workers"]]


def _first(mask: np.ndarray, updates: np.ndarray) -> int | None:
  hits = np.flatnonzero(mask)
  return int(updates[hits[0]]) if hits.size else None


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  prob, m, sigma = problem(config), spec["workers"], float(config["sigma"])
  # The noise table depends on the seed alone, so every M at a seed sees the same rows in the same order.
  z = np.random.default_rng(seed).standard_normal((int(config["examples"]), prob.dim))
  z = (z - z.mean(0)) / z.std(0)

  def loss_fn(x, batch):
    return prob.value(x) - sigma * jnp.vdot(jnp.mean(batch["z"], axis=0), x)

  def eval_fn(x):
    return {"grad_norm": jnp.linalg.norm(prob.grad(x)), "lam_min": jnp.linalg.eigvalsh(prob.hessian(x))[0],
            "x0_sq": x[0] * x[0], "loss": prob.value(x)}

  def callback(info: dict[str, Any]) -> None:
    progress(info["updates_done"], info["num_updates"])

  steps = int(config["steps"])
  with warnings.catch_warnings():
    # Beyond the stability bound the iterates blow up; the history reports it and the record says "diverged".
    warnings.simplefilter("ignore", RuntimeWarning)
    result = dj.simulate(loss_fn, optax.sgd(float(config["lr"])), jnp.zeros(prob.dim, jnp.float32),
                         {"z": jnp.asarray(z, jnp.float32)}, dj.delays.constant(m - 1), num_updates=steps, seed=seed,
                         sampling=dj.Sampling(batch_size=int(config["batch"])),
                         record=dj.Record(eval_fn=eval_fn, every=1, callback=callback),
                         execution=dj.Execution(lanes=LANES, chunk_size=CHUNK))
  h = result.history
  updates = np.asarray(h.eval_update)
  ev = {k: np.asarray(v, np.float64) for k, v in h.eval_metrics.items()}
  eps = float(config["epsilon"])
  escape = _first(ev["x0_sq"] >= prob.radius ** 2 / 4, updates)
  sosp = _first((ev["grad_norm"] <= eps) & (ev["lam_min"] >= -math.sqrt(eps)), updates)
  finite = bool(np.all(np.isfinite(ev["loss"])))
  metrics = {"updates_to_escape": escape, "updates_to_sosp": sosp,
             "log_updates_to_sosp": None if sosp is None else math.log(max(sosp, 1)),
             "time_to_sosp": None if sosp is None else sosp / m, "reached": float(sosp is not None),
             "final_suboptimality": float(ev["loss"][-1] - prob.min_value) if finite else None,
             "mean_staleness": float(m - 1)}
  return {"metrics": metrics, "diverged": not finite,
          "curves": {"update": updates.tolist(), "suboptimality": (ev["loss"] - prob.min_value).tolist()}}


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("workers",))
  bound = tau_stable(config)
  order = (int(config["steps"]) / int(config["batch"])) ** (1 / 3)
  for r in rows:
    r.update(tau_stable=bound, paper_order=order, linear_up_to=int(config["linear_up_to"]),
             efficiency=float(config["efficiency"]), steps=int(config["steps"]))
  return rows


def _keys(summary: Summary) -> list[str]:
  return sorted(summary, key=lambda k: summary[k]["workers"])


def _stable(summary: Summary) -> list[str]:
  return [k for k in _keys(summary) if summary[k]["workers"] - 1 <= summary[k]["tau_stable"]]


def _reaches(summary: Summary) -> ClaimResult:
  # A seed that never reached counts as infinitely many updates: the claim is then decided by a sign test.
  return ClaimResult.decide([paired(summary, k, None, "log_updates_to_sosp", claim="less",
                                    margin=math.log(summary[k]["steps"]),
                                    what=f"log updates to a second-order stationary point, {k}, < log steps")
                             for k in _stable(summary)])


def _near_linear(summary: Summary) -> ClaimResult:
  keys = [k for k in _stable(summary) if 1 < summary[k]["workers"] <= summary[k]["linear_up_to"]]
  base = next(k for k in _keys(summary) if summary[k]["workers"] == 1)
  return ClaimResult.decide([paired(summary, k, base, "log_updates_to_sosp", claim="less",
                                    margin=-math.log(summary[k]["efficiency"]),
                                    what=f"log(U_M / U_1), {k}, < log(1/efficiency)") for k in keys])


def _grows(summary: Summary) -> ClaimResult:
  stable = _stable(summary)
  linear = [k for k in stable if summary[k]["workers"] == summary[k]["linear_up_to"]]
  if not linear or summary[stable[-1]]["workers"] <= summary[linear[0]]["workers"]:
    return ClaimResult(None, "not evaluated: needs a stable M above linear_up_to")
  return ClaimResult.decide(paired(summary, stable[-1], linear[0], "log_updates_to_sosp", claim="greater",
                                   what=f"log updates to SOSP, {stable[-1]} - {linear[0]}"))


def _no_sosp_beyond(summary: Summary) -> ClaimResult:
  last = _keys(summary)[-1]
  if summary[last]["workers"] - 1 <= summary[last]["tau_stable"]:
    return ClaimResult(None, "not evaluated: needs an M beyond the stability bound")
  # A diverged or never-converged seed is infinitely many updates: an exact sign test decides (6 seeds or more).
  return ClaimResult.decide(paired(summary, last, None, "log_updates_to_sosp", claim="greater",
                                   margin=math.log(summary[last]["steps"]),
                                   what=f"log updates to a second-order stationary point, {last}, > log steps"))


CLAIMS = [
    Claim("sosp-for-every-stable-M", "Started at the strict saddle, asynchronous SGD escapes and reaches an "
          "epsilon-second-order stationary point within the budget for every M within the delay bound",
          _reaches),
    Claim("near-linear-speedup", "Up to linear_up_to workers the updates to a second-order stationary point grow by "
          "less than 1/efficiency over one worker: near-linear speed-up in simulated time", _near_linear),
    Claim("updates-grow-with-M", "The updates needed grow with M: the largest stable M needs more updates than "
          "M = linear_up_to", _grows),
    Claim("no-sosp-beyond-the-bound", "Beyond the delay bound (the largest M) asynchronous SGD does not reach a "
          "second-order stationary point within the budget (the stale gradients destabilize it): no speed-up",
          _no_sosp_beyond),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["key"]  # noqa: E731
  paths = [_plots.curves(records, out, "suboptimality", y="suboptimality", ylabel="f(x) - f*", log_y=True,
                         label=label, xs=("update",))]
  plt = _plots.pyplot()
  fig, ax = plt.subplots(figsize=(5.0, 3.6))
  ms = [r["workers"] for r in rows]
  base = next((r["time_to_sosp"] for r in rows if r["workers"] == 1), None)
  if base:
    ax.plot(ms, [base / r["time_to_sosp"] if r.get("time_to_sosp") else np.nan for r in rows], marker="o",
            label="measured")
  ax.plot(ms, ms, linestyle=":", color="gray", label="linear")
  ax.axvline(tau_stable(config) + 1, color="red", linewidth=0.8, label="delay bound")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("workers M")
  ax.set_ylabel("speed-up in simulated time")
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, "saddle_escape_speedup.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return paths + [path]


# No paper_numbers: only the abstracts (arXiv 1910.06000) were reachable; they give the bound on the number of
# workers in order only (shown as paper_order), no figure.
REPRODUCTION = Reproduction(
    name="saddle_escape",
    paper="Wang, Shen, Zhao: Second-Order Convergence of Asynchronous Parallel Stochastic Gradient Descent: When Is "
          "the Linear Speedup Achieved? arXiv 1910.06000, 2019 (abstracts only)",
    description="Asynchronous SGD started at a strict saddle: updates and simulated time to a second-order "
                "stationary point against the number of workers, up to and beyond the delay bound.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "updates_to_escape", "updates_to_sosp", "time_to_sosp", "reached", "final_suboptimality",
             "tau_stable", "paper_order"),
    smoke=dict(steps=300, seeds=1, workers=[1, 8, 32], examples=256),
    limits={"dim": Range(2, integer=True), "h_max": POSITIVE, "lam": POSITIVE, "sigma": Range(0.0),
            "linear_up_to": COUNT, "efficiency": Range(0.0, 1.0, low_open=True), "epsilon": POSITIVE,
            "examples": COUNT},
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
