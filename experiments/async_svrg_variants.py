"""Asynchronous SVRG variants: mini-batch AsySVRG on a nonconvex problem, and Async-ProxSVRG / ProxSVRCD on L1.

Two problems, every run one ``dj.simulate`` call under stale reads with
delays ``dj.delays.uniform(tau)`` (i.i.d. on ``{0, ..., tau}``), made a
round-robin schedule of ``max tau + 1`` workers by
``variance_reduction.stale_reads`` (the same examples at every ``tau`` for a
seed); the SVRG methods meet at each epoch's full gradient (no read precedes
the epoch's snapshot, the stage barrier of the asynchronous SVRG papers).
Everything runs in float64 (``jax.enable_x64`` inside each run).

* ``nonconvex`` (Huo & Huang, AAAI 2017): logistic regression on the bundled
  digits (``dj.problems.digits``: unit-norm rows, labels digit < 5) with the
  nonconvex regularizer :math:`\\alpha \\sum_j w_j^2 / (1 + w_j^2)`,
  minibatches of ``batch`` examples, one constant step
  ``eta = step_scale / L`` (``L = 1/4 + 2 alpha`` bounds each term's
  smoothness). ``sgd`` is asynchronous mini-batch SGD; ``svrg`` is
  ``optax.chain(dj.svrg(), optax.sgd(eta))`` with epochs of ``n / batch``
  updates (``dj.workers.Gradient(snapshot_every=...)``, snapshot the last
  iterate), the paper's asynchronous mini-batch SVRG on its distributed-memory
  form (workers read the server's parameters, compute the minibatch's
  variance-reduced gradient there and push it). Cost in units of ``n``
  gradient evaluations per epoch: SGD 1, SVRG 3, so SGD runs three epochs per
  SVRG epoch and both end at the same gradient evaluations. The metric is
  :math:`\\|\\nabla F(w)\\|^2` of the whole objective (the stationarity
  measure of the paper's :math:`O(1/T)` rate), in NumPy at every epoch end.
* ``lasso`` (Meng et al., AAAI 2017): ``dj.problems.make_dense`` least squares
  (``lsq_n`` x ``lsq_d``, ridge ``lam``) plus ``l1 * ||w||_1``, batches of one,
  step ``eta = step_scale / L_max``. ``prox_sgd`` is
  ``optax.chain(optax.sgd(eta), dj.proximal(dj.prox_l1(l1), eta))``;
  ``prox_svrg`` is ``dj.prox_svrg`` (Async-ProxSVRG); ``prox_svrcd`` is
  ``dj.prox_svrcd`` on two blocks of coordinates (Async-ProxSVRCD, uniform
  blocks). The metric is :math:`P(w) - P^*`, with :math:`P^*` from 20000
  proximal gradient steps in NumPy, reported at least ``1e-16`` (float64's
  resolution of an objective of order 1).

Claims, written before the run (thresholds in the config) from the papers'
abstracts (only those could be read: Huo & Huang's O(1/T) rate for the
nonconvex asynchronous mini-batch SVRG against AsySGD's O(1/sqrt(T)), and
its linear speed-up in the number of workers; Meng et al.'s asynchronous
proximal VR methods and their near-linear speed-ups), each decided on the
logarithms of per-seed figures by the framework's 95% interval of the mean
over seeds:

1. ``nonconvex-vr-beats-sgd``: on the nonconvex problem, at the same gradient
   evaluations, AsySVRG's final squared gradient norm is below AsySGD's at
   every ``tau`` (the paper's O(1/T) against O(1/sqrt(T))).
2. ``nonconvex-speedup``: AsySVRG's final squared gradient norm at the largest
   ``tau`` is less than ``speedup_factor`` (4) times that at ``tau = 0``: the
   iterations needed barely grow with the number of workers, the paper's
   linear speed-up.
3. ``prox-vr-linear``: Async-ProxSVRG reaches ``P - P* < target`` (1e-8)
   within its epochs at every ``tau`` (linear convergence under delays).
4. ``prox-sgd-floor``: Prox-SGD with the same constant step stays above
   ``sgd_floor`` (1e-5) over the second half of its epochs at every ``tau``.
5. ``prox-svrcd-linear``: Async-ProxSVRCD reaches ``target`` too, within
   ``cd_epochs`` (it changes one of two blocks per update).

    python -m experiments run async_svrg_variants --jobs 2
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from . import variance_reduction as vr
from ._framework import Claim, ClaimResult, Reproduction, Summary, compare, mean_rows

SCALES = {
    "quick": dict(taus=[0, 8], delay="uniform", alpha=1e-2, batch=10, nc_epochs=6, nc_step_scale=0.5,
                  lsq_n=300, lsq_d=20, lam=1e-2, l1=0.05, epochs=10, cd_epochs=12, step_scale=0.2, target=1e-8,
                  sgd_floor=1e-5, speedup_factor=4.0, seeds=3),
    "paper": dict(taus=[0, 8, 32], delay="uniform", alpha=1e-2, batch=10, nc_epochs=20, nc_step_scale=0.5,
                  lsq_n=1000, lsq_d=50, lam=1e-2, l1=0.05, epochs=30, cd_epochs=40, step_scale=0.2, target=1e-8,
                  sgd_floor=1e-5, speedup_factor=4.0, seeds=5),
}
FLOOR = 1e-16  # P - P* is reported at least this (see run)
METHODS = {"nonconvex": ("sgd", "svrg"), "lasso": ("prox_sgd", "prox_svrg", "prox_svrcd")}
EVALS_PER_EPOCH = {"sgd": 1, "svrg": 3, "prox_sgd": 1, "prox_svrg": 3, "prox_svrcd": 3}  # units of n
LABELS = {"sgd": "AsySGD", "svrg": "AsySVRG (mini-batch)", "prox_sgd": "Prox-SGD", "prox_svrg": "Async-ProxSVRG",
          "prox_svrcd": "Async-ProxSVRCD"}
# One chunk length and one lane for every run: the runs of a method then share one compiled program across tau and
# seeds (the default lanes follow each schedule's waves, a program per tau).
CHUNK = 1024


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"key": f"{p}/{m}/tau={tau}", "problem": p, "method": m, "tau": int(tau)}
          for p, methods in METHODS.items() for m in methods for tau in config["taus"]]


# ---------------------------------------------------------------- problems (float64 NumPy for the metrics)

_FACTS: dict[tuple[Any, ...], Any] = {}


def nonconvex_problem(config: dict[str, Any]) -> tuple[dj.problems.FiniteSum, float]:
  """The digits data (as a logistic finite sum without L2) and ``alpha``."""
  return dj.problems.digits(lam=0.0), float(config["alpha"])


def nonconvex_loss(alpha: float):
  def loss_fn(w, batch):
    z = batch["y"] * (batch["x"] @ w)
    return jnp.mean(jnp.logaddexp(0.0, -z)) + alpha * jnp.sum(w * w / (1.0 + w * w))
  return loss_fn


def nonconvex_grad_norm2(finite_sum: dj.problems.FiniteSum, alpha: float, w: np.ndarray) -> float:
  """:math:`\\|\\nabla F(w)\\|^2` of the nonconvex objective, in float64 NumPy."""
  x, y = np.asarray(finite_sum.features, np.float64), np.asarray(finite_sum.targets, np.float64)
  s = -y / (1.0 + np.exp(y * (x @ w)))
  g = x.T @ s / len(y) + alpha * 2.0 * w / (1.0 + w * w) ** 2
  return float(g @ g)


def lasso_facts(config: dict[str, Any]) -> tuple[dj.problems.FiniteSum, float, float]:
  """``(finite_sum, P*, L_max)`` of the L1 problem, made once per process (P* by proximal gradient descent)."""
  key = tuple(config[k] for k in ("lsq_n", "lsq_d", "lam", "l1"))
  if key not in _FACTS:
    fs = dj.problems.make_dense("least_squares", config["lsq_n"], config["lsq_d"], lam=float(config["lam"]),
                                seed=20170204)
    step = 1.0 / float(np.linalg.eigvalsh(fs.hessian(np.zeros(config["lsq_d"])))[-1])
    w = np.zeros(config["lsq_d"])
    for _ in range(20000):
      z = w - step * fs.gradient(w)
      w = np.sign(z) * np.maximum(np.abs(z) - step * config["l1"], 0.0)
    _FACTS[key] = (fs, lasso_value(fs, config["l1"], w), fs.smoothness().l_max)
  return _FACTS[key]


def lasso_value(finite_sum: dj.problems.FiniteSum, l1: float, w: np.ndarray) -> float:
  return finite_sum.value(w) + l1 * float(np.sum(np.abs(w)))


# ---------------------------------------------------------------- one run


def _halves(w):
  return {"a": w[: w.shape[0] // 2], "b": w[w.shape[0] // 2:]}


def _joined(p):
  return jnp.concatenate([p["a"], p["b"]]) if isinstance(p, dict) else p


def optimizer(method: str, eta: float, l1: float, seed: int) -> optax.GradientTransformation:
  if method == "sgd":
    return optax.sgd(eta)
  if method == "svrg":
    return optax.chain(dj.svrg(), optax.sgd(eta))
  if method == "prox_sgd":
    return optax.chain(optax.sgd(eta), dj.proximal(dj.prox_l1(l1), eta))
  if method == "prox_svrg":
    return dj.prox_svrg(dj.prox_l1(l1), eta)
  if method == "prox_svrcd":
    return dj.prox_svrcd(dj.prox_l1(l1), eta, seed=seed)
  raise ValueError(f"method must be one of {sorted(EVALS_PER_EPOCH)}, got {method!r}.")


def iterates(config: dict[str, Any], loss_fn, finite_sum: dj.problems.FiniteSum, method: str, tau: int, seed: int,
             batch: int, epoch: int, epochs: int, eta: float, progress) -> np.ndarray:
  """The parameters at every epoch end (from epoch 0) of one ``dj.simulate`` run under stale reads."""
  blocks = method == "prox_svrcd"
  vr_method = method in ("svrg", "prox_svrg", "prox_svrcd")

  def callback(info: dict[str, Any]) -> None:
    progress(info["updates_done"], info["num_updates"])

  with jax.enable_x64(True):
    source = vr.stale_reads(vr.delay_model(config, tau), epochs * epoch, seed, workers=max(config["taus"]) + 1,
                            epoch=epoch if vr_method else None)
    w0 = jnp.zeros(int(finite_sum.num_features), jnp.float64)
    result = dj.simulate((lambda p, b: loss_fn(_joined(p), b)) if blocks else loss_fn,
                         optimizer(method, eta, float(config["l1"]), seed), _halves(w0) if blocks else w0,
                         finite_sum.data(jnp.float64),
                         source, seed=seed, sampling=dj.Sampling(batch_size=batch),
                         worker=dj.workers.Gradient(snapshot_every=epoch) if vr_method else None,
                         record=dj.Record(eval_fn=_joined, every=epoch, history="evaluations", callback=callback),
                         execution=dj.Execution(chunk_size=CHUNK, lanes=1))
    return np.asarray(result.history.eval_metrics, np.float64)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  problem, method, tau = spec["problem"], spec["method"], int(spec["tau"])
  if problem == "nonconvex":
    fs, alpha = nonconvex_problem(config)
    batch = int(config["batch"])
    epoch = fs.num_samples // batch
    eta = config["nc_step_scale"] / (0.25 + 2.0 * alpha)
    # Equal gradient evaluations: an SVRG epoch costs three of SGD's.
    epochs = int(config["nc_epochs"]) * (3 if method == "sgd" else 1)
    ws = iterates(config, nonconvex_loss(alpha), fs, method, tau, seed, batch, epoch, epochs, eta, progress)
    curve = np.array([nonconvex_grad_norm2(fs, alpha, w) for w in ws])
    curve = np.where(np.isfinite(curve), curve, np.nan)
    record = vr.curve_record(curve, float(config["target"]), EVALS_PER_EPOCH[method], step=eta)
    record["metrics"]["final_grad_norm2"] = record["metrics"]["final_subopt"]
    return record
  fs, p_star, l_max = lasso_facts(config)
  eta = config["step_scale"] / l_max
  epochs = int(config["cd_epochs" if method == "prox_svrcd" else "epochs"])
  ws = iterates(config, fs.loss_fn, fs, method, tau, seed, 1, fs.num_samples, epochs, eta, progress)
  curve = np.array([lasso_value(fs, float(config["l1"]), w) - p_star for w in ws])
  # Clamped at float64's resolution of an objective of order 1: rounding puts some runs' P - P* at 0 (or below),
  # whose logarithm would decide nothing.
  curve = np.where(np.isfinite(curve), np.maximum(curve, FLOOR), np.nan)
  return vr.curve_record(curve, float(config["target"]), EVALS_PER_EPOCH[method], step=eta, p_star=p_star,
                         nonzeros=int(np.count_nonzero(ws[-1])))


# ---------------------------------------------------------------- table, claims, plots


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("problem", "method", "tau"))
  for r in rows:
    r.update(target=config["target"], sgd_floor=config["sgd_floor"], speedup_factor=config["speedup_factor"])
  return rows


def _taus(summary: Summary) -> list[int]:
  return sorted({int(r["tau"]) for r in summary.values()})


def _has(summary: Summary, key: str) -> bool:
  return key in summary


def _vr_beats_sgd(summary: Summary) -> ClaimResult:
  keys = [(f"nonconvex/svrg/tau={t}", f"nonconvex/sgd/tau={t}") for t in _taus(summary)]
  if not all(_has(summary, a) and _has(summary, b) for a, b in keys):
    return ClaimResult(None, "not evaluated: this run lacks nonconvex svrg or sgd rows")
  return ClaimResult.decide([
      compare(vr.log10_values(summary, a, "final_subopt"), vr.log10_values(summary, b, "final_subopt"), claim="less",
              what=f"log10 final squared gradient norm, AsySVRG - AsySGD at equal gradient evaluations, "
                   f"{a.split('/')[-1]} (claimed < 0)")
      for a, b in keys])


def _speedup(default: float):
  def check(summary: Summary) -> ClaimResult:
    taus = _taus(summary)
    if len(taus) < 2 or taus[0] != 0 or not _has(summary, f"nonconvex/svrg/tau={taus[-1]}"):
      return ClaimResult(None, f"needs nonconvex svrg rows at tau = 0 and a larger tau; this run has taus {taus}")
    factor = vr.threshold(summary, "speedup_factor", default)
    return ClaimResult.decide([compare(
        vr.log10_values(summary, f"nonconvex/svrg/tau={taus[-1]}", "final_subopt"),
        vr.log10_values(summary, "nonconvex/svrg/tau=0", "final_subopt"), claim="less", margin=math.log10(factor),
        what=f"log10 final squared gradient norm of AsySVRG, tau={taus[-1]} - tau=0 (claimed < log10 {factor:g})")])
  return check


def _below(method: str, default: float):
  def check(summary: Summary) -> ClaimResult:
    keys = [f"lasso/{method}/tau={t}" for t in _taus(summary)]
    if not all(_has(summary, k) for k in keys):
      return ClaimResult(None, f"not evaluated: this run lacks lasso {method} rows")
    target = vr.threshold(summary, "target", default)
    return ClaimResult.decide([
        compare(vr.log10_values(summary, k, "final_subopt"), claim="less", margin=math.log10(target),
                what=f"log10 final P - P* {k} (claimed < {math.log10(target):g})") for k in keys])
  return check


def _floor(default: float):
  def check(summary: Summary) -> ClaimResult:
    keys = [f"lasso/prox_sgd/tau={t}" for t in _taus(summary)]
    if not all(_has(summary, k) for k in keys):
      return ClaimResult(None, "not evaluated: this run lacks lasso prox_sgd rows")
    floor = vr.threshold(summary, "sgd_floor", default)
    return ClaimResult.decide([
        compare(vr.log10_values(summary, k, "tail_min_subopt"), claim="greater", margin=math.log10(floor),
                what=f"log10 lowest P - P* of the second half {k} (claimed > {math.log10(floor):g})") for k in keys])
  return check


def claims_for(config: dict[str, Any]) -> list[Claim]:
  return [
      Claim("nonconvex-vr-beats-sgd", "on the nonconvex problem, at equal gradient evaluations, asynchronous "
            "mini-batch SVRG ends at a smaller squared gradient norm than asynchronous SGD at every tau",
            _vr_beats_sgd),
      Claim("nonconvex-speedup", f"AsySVRG's final squared gradient norm at the largest tau is less than "
            f"{config['speedup_factor']:g}x that at tau = 0", _speedup(config["speedup_factor"])),
      Claim("prox-vr-linear", f"Async-ProxSVRG reaches P - P* below {config['target']:g} at every tau",
            _below("prox_svrg", config["target"])),
      Claim("prox-sgd-floor", f"Prox-SGD with the same constant step stays above {config['sgd_floor']:g} at every tau",
            _floor(config["sgd_floor"])),
      Claim("prox-svrcd-linear", f"Async-ProxSVRCD (two blocks) reaches P - P* below {config['target']:g} at every "
            f"tau", _below("prox_svrcd", config["target"])),
  ]


CLAIMS = claims_for(SCALES["quick"])


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  """``suboptimality.png`` (``variance_reduction.suboptimality_plot``): the squared gradient norm (nonconvex) and
  P - P* (lasso) against epochs and gradient evaluations / n."""
  return vr.suboptimality_plot(
      config, records, out, colors={"sgd": "tab:gray", "svrg": "tab:blue", "prox_sgd": "tab:gray",
                                    "prox_svrg": "tab:blue", "prox_svrcd": "tab:green"},
      labels=LABELS, evals_per_epoch=EVALS_PER_EPOCH.__getitem__,
      title=lambda p: ("nonconvex logistic (digits): squared gradient norm" if p == "nonconvex"
                       else "l1 least squares: P(w) - P*") + f" ({config['delay']} delays on 0..tau)")


# No paper_numbers: only the three papers' abstracts could be read when this module was written, and they give no
# figure (Huo & Huang's experiments train neural networks on MNIST and CIFAR-10; Meng et al.'s a regularized
# logistic regression; both report speed-ups over thread counts on data sets and machines of their own).
REPRODUCTION = Reproduction(
    name="async_svrg_variants",
    paper="Huo, Huang: Asynchronous mini-batch gradient descent with variance reduction for non-convex "
          "optimization, AAAI 2017; Meng, Chen, Yu, Wang, Ma, Liu: Asynchronous stochastic proximal optimization "
          "algorithms with variance reduction, AAAI 2017",
    description="Asynchronous mini-batch SVRG against SGD on a nonconvex logistic regression (squared gradient norm "
                "at equal gradient evaluations), and Async-ProxSVRG / ProxSVRCD against Prox-SGD on L1 least "
                "squares, under stale reads (tau 0 and 8).",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "final_subopt", "tail_min_subopt", "epochs_to_target", "grad_evals_to_target", "step"),
    smoke=dict(nc_epochs=1, epochs=2, cd_epochs=2, taus=[0, 3], lsq_n=60, lsq_d=6, seeds=1),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
