"""Sketch-and-project as SGD on Richtarik and Takac's stochastic reformulation of a linear system, asynchronous.

Richtarik and Takac reformulate a consistent linear system :math:`Ax = b` as the stochastic problem
:math:`\\min_x f(x) = \\mathbb E_S f_S(x)`, :math:`f_S(x) = \\frac12 \\|Ax - b\\|_{H_S}^2`, :math:`H_S = S
(S^\\top A B^{-1} A^\\top S)^\\dagger S^\\top`, for a norm matrix :math:`B` and a distribution of sketches
:math:`S`; their basic method, SGD with a fixed step (relaxation) :math:`\\omega` on it, is sketch-and-project,
and they prove, for :math:`0 < \\omega < 2` and :math:`x^\\star` the projection of :math:`x_0` onto the solution
set, :math:`\\mathbb E[x_k - x^\\star] = (I - \\omega W)^k (x_0 - x^\\star)` and :math:`\\mathbb E \\|x_k -
x^\\star\\|_B^2 \\le (1 - \\omega(2 - \\omega) \\lambda_{\\min}^+(W))^k \\|x_0 - x^\\star\\|_B^2`, :math:`W =
B^{-1/2} \\mathbb E[A^\\top H_S A] B^{-1/2}` (their abstract and the statement of their basic method's theorem,
as quoted in the literature that builds on it; the full text's numbering could not be checked). **No source
on an asynchronous sketch-and-project method with its own convergence claim could be read**; the asynchronous
part here is this library's stale read applied to their basic method, checked against the delayed recursion of
the mean, which is exact for it.

The problem and the transformation: a consistent overdetermined Gaussian system (``rows`` x ``dim``, planted
:math:`x^\\star`, full column rank so :math:`x^\\star` is unique), :math:`B = I` and :math:`S = e_i` with
:math:`i` uniform after each row is scaled to unit norm (the same solution set): :math:`f_S(x) = \\frac12
(\\hat a_i^\\top x - \\hat b_i)^2`, whose SGD step is the randomized Kaczmarz projection, and :math:`W = \\frac1n
\\hat A^\\top \\hat A`. That is ``dj.problems.FiniteSum("least_squares", lam=0)`` on the scaled rows with
``optax.sgd(omega)`` and one row per update. Asynchronous: ``dj.delays.constant(tau)`` stale reads,
:math:`x_{k+1} = x_k - \\omega \\nabla f_{S_k}(x_{k - \\tau})`; the mean then follows :math:`m_{k+1} = m_k -
\\omega W m_{k-\\tau}` (the sketch is independent of the stale iterate), which converges iff :math:`\\omega
\\lambda_{\\max}(W) < 2 \\sin(\\pi / (2(2\\tau + 1)))` (``dj.analysis.stable_learning_rate``).

Claims, written before the run, on each seed's :math:`\\log_{10}(\\|x_K - x^\\star\\|^2 / \\|x_0 -
x^\\star\\|^2)` after ``steps`` updates, by the framework's 95% t-intervals over seeds (a seed draws the starting
point and the sketches; the system is fixed): (1) synchronous (:math:`\\tau = 0`) sketch-and-project is at or
below the paper's bound :math:`K \\log_{10}(1 - \\omega(2-\\omega)\\lambda_{\\min}^+)`; (2) every asynchronous run
within the delay bound converges linearly: its error falls by more than ``min_decades`` decades; (3) beyond the
bound (``omega = 1`` at the largest delay) it does not converge: the error grows; (4) a delay costs rate: at
``omega = 1`` the error after ``steps`` updates is larger at the middle delay than synchronously.

    python -m experiments run sketch_project
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from delayjax import analysis
from . import _plots
from ._framework import COUNT, POSITIVE, Claim, ClaimResult, Range, Reproduction, Summary, mean_rows, paired

SCALES = {
    "quick": dict(rows=64, dim=8, taus=[0, 4, 16, 16], omegas=[1.0, 1.0, 1.0, 0.25], steps=200, eval_every=5,
                  min_decades=1.0, seeds=6),
    "paper": dict(rows=1000, dim=100, taus=[0, 4, 16, 16, 64], omegas=[1.0, 1.0, 1.0, 0.25, 0.05], steps=20_000,
                  eval_every=100, min_decades=2.0, seeds=10),
}
# One fixed system for every scale's seed: the seeds draw the starting points and the sketches, not the problem.
SYSTEM_SEED = 20170604
LANES = 4
CHUNK = 256


def system(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The scaled rows :math:`\\hat A`, :math:`\\hat b = \\hat A x^\\star` and the planted :math:`x^\\star`."""
  rng = np.random.default_rng(SYSTEM_SEED)
  a = rng.standard_normal((int(config["rows"]), int(config["dim"])))
  a /= np.linalg.norm(a, axis=1, keepdims=True)
  x_star = rng.standard_normal(int(config["dim"]))
  return a, a @ x_star, x_star


def w_eigenvalues(config: dict[str, Any]) -> np.ndarray:
  """Eigenvalues of :math:`W = \\mathbb E[\\hat a_i \\hat a_i^\\top] = \\hat A^\\top \\hat A / n`, ascending."""
  a, _, _ = system(config)
  return np.linalg.eigvalsh(a.T @ a / a.shape[0])


def paper_bound(config: dict[str, Any], omega: float) -> float:
  """:math:`K \\log_{10}(1 - \\omega(2 - \\omega)\\lambda_{\\min}^+(W))`: the theorem's bound on the log10 ratio."""
  lam_min = float(w_eigenvalues(config)[0])
  return int(config["steps"]) * math.log10(1.0 - omega * (2.0 - omega) * lam_min)


def within_bound(config: dict[str, Any], tau: int, omega: float) -> bool:
  """Whether the mean recursion :math:`m_{k+1} = m_k - \\omega W m_{k-\\tau}` converges."""
  return omega < analysis.stable_learning_rate(float(w_eigenvalues(config)[-1]), tau)


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  """One run per pair ``(taus[j], omegas[j])``."""
  if len(config["taus"]) != len(config["omegas"]):
    raise ValueError(f"taus and omegas must have the same length (one run per pair), got {len(config['taus'])} "
                     f"and {len(config['omegas'])}.")
  return [{"key": f"tau={int(t)},omega={float(w):g}", "tau": int(t), "omega": float(w)}
          for t, w in zip(config["taus"], config["omegas"])]


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  a, b, x_star = system(config)
  problem = dj.problems.FiniteSum("least_squares", targets=b, lam=0.0, features=a)
  x0 = np.random.default_rng(seed).standard_normal(a.shape[1])
  target = jnp.asarray(x_star, jnp.float32)

  def eval_fn(x):
    return {"error_sq": jnp.sum((x - target) ** 2)}

  def callback(info: dict[str, Any]) -> None:
    progress(info["updates_done"], info["num_updates"])

  result = dj.simulate(problem.loss_fn, optax.sgd(spec["omega"]), jnp.asarray(x0, jnp.float32), problem.data(),
                       dj.delays.constant(spec["tau"]), num_updates=int(config["steps"]), seed=seed,
                       sampling=dj.Sampling(batch_size=1),
                       record=dj.Record(eval_fn=eval_fn, every=int(config["eval_every"]), callback=callback),
                       execution=dj.Execution(lanes=LANES, chunk_size=CHUNK))
  h = result.history
  err = np.asarray(h.eval_metrics["error_sq"], np.float64)
  e0 = float(np.sum((x0 - x_star) ** 2))
  finite = bool(np.isfinite(err[-1]))
  metrics = {"log10_error_ratio": float(np.log10(err[-1] / e0)) if finite and err[-1] > 0 else None,
             "paper_bound": paper_bound(config, spec["omega"]),
             "within_delay_bound": float(within_bound(config, spec["tau"], spec["omega"]))}
  return {"metrics": metrics, "diverged": not finite,
          "curves": {"update": np.asarray(h.eval_update).tolist(), "error_sq": err.tolist()}}


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("tau", "omega"))
  for r in rows:
    r.update(min_decades=float(config["min_decades"]), within_delay_bound=within_bound(config, r["tau"], r["omega"]),
             paper_bound=paper_bound(config, r["omega"]))
  return rows


def _synchronous_within_the_paper_bound(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([paired(summary, k, None, "log10_error_ratio", claim="less", margin=r["paper_bound"],
                                    what=f"log10 |x_K - x*|^2 / |x_0 - x*|^2, {k}, < the paper's bound "
                                         f"{r['paper_bound']:.3g}")
                             for k, r in summary.items() if r["tau"] == 0])


def _async_converges(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([paired(summary, k, None, "log10_error_ratio", claim="less", margin=-r["min_decades"],
                                    what=f"log10 error ratio, {k}, < -min_decades")
                             for k, r in summary.items() if r["tau"] > 0 and r["within_delay_bound"]])


def _diverges_beyond(summary: Summary) -> ClaimResult:
  # A diverged seed (non-finite error) counts as infinitely large: an exact sign test decides (6 seeds or more).
  return ClaimResult.decide([paired(summary, k, None, "log10_error_ratio", claim="greater", missing=math.inf,
                                    what=f"log10 error ratio, {k}, > 0")
                             for k, r in summary.items() if not r["within_delay_bound"]])


def _delay_costs_rate(summary: Summary) -> ClaimResult:
  stable = sorted((k for k, r in summary.items() if r["omega"] == 1.0 and r["within_delay_bound"]),
                  key=lambda k: summary[k]["tau"])
  if len(stable) < 2 or summary[stable[0]]["tau"] != 0:
    return ClaimResult(None, "not evaluated: needs omega = 1 at tau = 0 and at a stable tau > 0")
  return ClaimResult.decide(paired(summary, stable[-1], stable[0], "log10_error_ratio", claim="greater",
                                   what=f"log10 error ratio, {stable[-1]} - {stable[0]}"))


CLAIMS = [
    Claim("synchronous-within-the-paper-bound", "Synchronous sketch-and-project (tau = 0) ends at or below the "
          "theorem's bound K log10(1 - omega (2 - omega) lambda_min+(W))", _synchronous_within_the_paper_bound),
    Claim("async-converges-within-the-delay-bound", "Asynchronous sketch-and-project within the delay bound "
          "(omega lambda_max(W) < 2 sin(pi / (2 (2 tau + 1)))) converges linearly: the error falls by more than "
          "min_decades decades", _async_converges),
    Claim("async-diverges-beyond-the-delay-bound", "Beyond the delay bound the error grows instead",
          _diverges_beyond),
    Claim("delay-costs-rate", "At omega = 1 a stable delay leaves a larger error after the same updates than "
          "tau = 0", _delay_costs_rate),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  return [_plots.curves(records, out, "error", y="error_sq", ylabel="|x - x*|^2", log_y=True,
                        label=lambda spec: spec["key"], xs=("update",))]


# No paper_numbers: only the abstract and the theorem's statement were reachable; the paper's figure for these rows
# is its rate bound, computed here for this system (paper_bound), and the paper has no asynchronous counterpart.
REPRODUCTION = Reproduction(
    name="sketch_project",
    paper="Richtarik, Takac: Stochastic Reformulations of Linear Systems: Algorithms and Convergence Theory, SIAM "
          "J. Matrix Anal. Appl. 2020 (arXiv 1706.01108), run asynchronously",
    description="Randomized Kaczmarz as SGD on the stochastic reformulation of a consistent system, with stale "
                "reads: the paper's rate bound, and where the delay bound of the mean recursion holds.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "log10_error_ratio", "paper_bound", "within_delay_bound"),
    smoke=dict(steps=40, seeds=1, taus=[0, 16], omegas=[1.0, 1.0]),
    limits={"rows": COUNT, "dim": COUNT, "min_decades": POSITIVE,
            "omegas": Range(0.0, 2.0, low_open=True, high_open=True)},
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
