r"""Torn reads (Alistarh, De Sa, Konstantinov 2018) and elastic consistency (Nadiradze et al. 2021) on a quadratic.

**Only the two papers' abstracts could be read here** (the full texts were not reachable); the statements checked
are the library's derivations in the form the abstracts describe, written out below, with every constant measured
or known. Alistarh et al. bound the convergence of lock-free SGD in asynchronous shared memory, where a read's
coordinates come from different versions, and find a trade-off between the maximum delay :math:`\tau` and the
rate. Nadiradze et al. bound SGD by one number, the elastic-consistency constant :math:`B` with
:math:`\mathbb E\|x_t - v_t\|^2 \le \eta^2 B^2` (:math:`x_t` the true parameters, :math:`v_t` the read), and
say it re-derives the shared-memory and message-passing bounds; a delay bound :math:`\tau` and
:math:`\mathbb E\|\tilde g\|^2 \le M^2` give :math:`B \le \tau M`, for torn reads too (each coordinate of
:math:`x_t - v_t` is at most :math:`\tau` steps). Two theorems are checked, both derived here for
:math:`L`-smooth :math:`f` and unbiased gradients of variance :math:`\sigma^2`:

* **strongly convex** (:math:`\mu`), :math:`\eta \le \mu / (4L^2)`, :math:`e_t = \mathbb E\|x_t - x^*\|^2`:

  .. math::

    e_t \le \rho^t e_0 + \frac{1 - \rho^t}{1 - \rho}\Big(\eta^2\sigma^2 + \eta^3 L^2 B^2 \big(\tfrac1\mu + 2\eta\big)\Big),
    \qquad \rho = 1 - \eta\mu + 2\eta^2 L^2 \le 1 - \eta\mu/2

  (from :math:`e_{t+1} \le (1 - 2\eta\mu) e_t + 2\eta L \|v_t - x_t\| \sqrt{e_t} + \eta^2(\sigma^2 + 2L^2 e_t +
  2L^2\|v_t - x_t\|^2)`): the delay term grows as :math:`\tau^2`, so a fixed target needs :math:`\eta \propto
  1/\tau`, the linear price of asynchrony;
* **non-convex form**, :math:`\eta \le 1/L`:
  :math:`\frac1T \sum_{t<T} \mathbb E\|\nabla f(x_t)\|^2 \le \frac{2(f(x_0) - f^*)}{\eta T} + L\eta\sigma^2 +
  L^2\eta^2 B^2`, where the time-averaged :math:`B_\text{rms}^2` suffices.

The problem: :math:`f(x) = \tfrac12 x^\top A x` in :math:`d = 16` dimensions, :math:`A = Q\,\mathrm{diag}(h)\,Q^\top`
with :math:`h` evenly spaced in :math:`[\mu, L] = [0.5, 1]` and a fixed random rotation :math:`Q` (so a torn read
mixes versions across the eigen-directions), :math:`x^* = 0`; a gradient is :math:`A v - z` with :math:`z` one of
256 centered vectors of mean square :math:`\sigma^2 = 0.5` (``dj.Sampling(batch_size=1)``). Every run is
``dj.simulate`` with ``optax.sgd(eta)``; the read :math:`v_t` of each update is its ``stale_params``, kept by a
one-line transformation and evaluated at every version, and :func:`dj.analysis.elastic_consistency` measures
:math:`B`. :math:`M^2` is measured as :math:`\max_t \|A v_t\|^2 + \sigma^2`.

  torn-tau{t}   dj.delays.torn(params, uniform(t)): each coordinate read t' ~ U{0..t} updates old (eta 0.1)
  stale-tau{t}  dj.delays.uniform(t): the consistent read with the same delays (eta 0.1)
  asp-M{m}      dj.cluster.asp() with m gamma-time workers (eta = 1 / sqrt(T))
  ssp-M{m}-s{s} dj.cluster.ssp(s), the same workers
  pull-H{h}     communication-reduced: a worker pulls the parameters every h updates and pushes a gradient
                every update (dj.delays.trace(range(h)): update t reads version h floor(t / h))

    python -m experiments run consistency
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from . import _plots
from ._framework import Claim, ClaimResult, Reproduction, Summary, across_seeds, compare, mean_rows, seed_values
from ._training import schedule_once, seeds_like

# Config, fixed before the first run. The quadratic's constants are the theorems' (mu, L, sigma^2); eta 0.1 for
# the torn runs satisfies eta <= mu / (4 L^2) = 0.125; the schedules' eta = 1 / sqrt(T) is the non-convex
# theorem's. Five seeds; the cluster's gamma compute times give ASP's heavy-tailed staleness.
# Measured on seeds 0-4 (the first quick run; nothing was changed after it; 40 runs, 47 s of CPU, 2.4 min of wall
# time on 2 cores shared with other jobs, mostly compiling: each cluster schedule plans to its own program sizes).
# Held: torn-within-bound (the bound is loose: late E||x - x*||^2 0.038-0.048 against 0.17-40), torn-delay-costs
# (tau 8 - tau 0: +0.010 [+0.003, +0.017]), torn-like-consistent (log ratio torn / stale at tau 8: +0.035 [+0.008,
# +0.061]), b-grows-with-asynchrony (B_rms 11.1 at M = 16, 2.5 at M = 4), nonconvex-bound-holds (bound - measured
# +0.33 to +0.66). Inconclusive: b-within-tau-m, because periodic pulls sit on the bound (tau M - B_max = +0.15
# [-0.41, +0.70]: early in the run seven aligned gradients make the gap's realized maximum reach tau M, while the
# bound is on the expectation); ssp-caps-b (B_max SSP - ASP at M = 16: -2.0 [-4.2, +0.2]; SSP's s = 2 cuts the
# largest staleness from 64 to 46 but not the largest gap).
# Seeds: 10 (were 5): at 5, ssp-caps-b's per-seed standard deviation was 1.8 around -2.0, and 10 is about the
# fewest at which a t interval excludes zero for a difference of that size, fixed before seeds 5-9 ran. Nothing
# else changed. With 10, ssp-caps-b is held (-2.37 [-3.46, -1.28]) and b-within-tau-m stays inconclusive
# (periodic pulls: +0.31 [-0.02, +0.64]); the other claims are held as before.
# Seeds: 16 (issue 28; were 10). b-within-tau-m's figure is tau_max M - B_max per seed (> 0: the bound holds), and
# the claim holds only if it holds for every paradigm, so the worst one decides: periodic pulls, +0.311 with a
# per-seed sd of 0.46 (the other five are +4.5 or more). The metric is kept: the per-seed realized maximum B_max is
# at least the expectation's constant, so it can only make the claim harder. At 16 seeds that sd gives a half-width
# near 0.25, enough to decide from a mean of 0.31; fixed before seeds 10-15 ran. Nothing else changed.
SCALES = {
    "quick": dict(dim=16, mu=0.5, L=1.0, noise=0.5, examples=256, x0=1.0, steps=400, torn_lr=0.1,
                  taus=[0, 4, 8], asp_workers=[4, 16], ssp=[16, 2], pull=8, seeds=16, late=0.25),
    "paper": dict(dim=64, mu=0.5, L=1.0, noise=0.5, examples=1024, x0=1.0, steps=4000, torn_lr=0.1,
                  taus=[0, 2, 4, 8, 16], asp_workers=[4, 16, 64], ssp=[64, 2], pull=16, seeds=10, late=0.25),
}


class _KeptRead(NamedTuple):
  read: Any  # like params: the stale_params (the read) of the last update


def keep_read() -> optax.GradientTransformationExtraArgs:
  """Passes the update through and keeps the read it was computed at (``stale_params``) in its state."""
  def init_fn(params):
    return _KeptRead(jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None, *, stale_params, **extra):
    del params, extra, state
    return updates, _KeptRead(stale_params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class Problem(NamedTuple):
  hessian: np.ndarray  # float32 [d, d]
  data: dict[str, np.ndarray]  # {"z": [examples, d]}, centered, mean square noise
  x0: np.ndarray  # float32 [d]


def problem(config: dict[str, Any]) -> Problem:
  """The quadratic (fixed: the same for every run and seed; seeds vary the minibatches and the delays)."""
  rng = np.random.default_rng(12345)
  d = config["dim"]
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  h = np.linspace(config["mu"], config["L"], d)
  z = rng.normal(size=(config["examples"], d))
  z -= z.mean(axis=0)
  z *= math.sqrt(config["noise"] / np.mean(np.sum(z ** 2, axis=1)))
  x0 = np.full(d, config["x0"], np.float32)
  return Problem(((q * h) @ q.T).astype(np.float32), {"z": z.astype(np.float32)}, x0)


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  out = [{"key": f"torn-tau{t}", "part": "torn", "read": "torn", "tau": t} for t in config["taus"]]
  out.append({"key": f"stale-tau{config['taus'][-1]}", "part": "torn", "read": "stale", "tau": config["taus"][-1]})
  out += [{"key": f"asp-M{m}", "part": "elastic", "scheme": "asp", "workers": m} for m in config["asp_workers"]]
  m, s = config["ssp"]
  out.append({"key": f"ssp-M{m}-s{s}", "part": "elastic", "scheme": "ssp", "workers": m, "bound": s})
  out.append({"key": f"pull-H{config['pull']}", "part": "elastic", "scheme": "pull", "period": config["pull"]})
  return out


def _source(config: dict[str, Any], spec: dict[str, Any], x0: Any, seed: int) -> Any:
  if spec["part"] == "torn":
    model = dj.delays.uniform(spec["tau"])
    return dj.delays.torn(x0, model) if spec["read"] == "torn" else model
  if spec["scheme"] == "pull":
    return dj.delays.trace(list(range(spec["period"])))
  paradigm = dj.cluster.asp() if spec["scheme"] == "asp" else dj.cluster.ssp(spec["bound"])
  # Simulated once per process: the schedule is also the ``like`` of the other seeds' runs (:func:`_like`).
  return schedule_once(lambda: dj.cluster.simulate(paradigm, dj.cluster.workers(spec["workers"], compute="gamma"),
                                                   config["steps"], seed=seed),
                       "consistency", spec["key"], config["steps"], seed)


def _like(config: dict[str, Any], spec: dict[str, Any], seed: int) -> list[dj.cluster.Schedule] | None:
  """Every seed's schedule of the spec, so that its seeds share one compiled program (their plans' sizes differ);
  none for torn reads, whose blocks are read at versions of their own (``like`` is not defined for them), nor for
  the pull trace, the same for every seed."""
  if spec["part"] == "torn" and spec["read"] == "stale":
    def schedule_of(s: int) -> dj.cluster.Schedule:
      return schedule_once(lambda: dj.runtime.schedule_from_delays(dj.delays.uniform(spec["tau"]), config["steps"], s),
                           "consistency", spec["key"], config["steps"], s)
  elif spec["part"] == "elastic" and spec["scheme"] != "pull":
    def schedule_of(s: int) -> dj.cluster.Schedule:
      return _source(config, spec, None, s)
  else:
    return None
  return seeds_like(config, seed, schedule_of)


def learning_rate(config: dict[str, Any], spec: dict[str, Any]) -> float:
  return config["torn_lr"] if spec["part"] == "torn" else 1.0 / math.sqrt(config["steps"])


def strongly_convex_bound(config: dict[str, Any], lr: float, b: float, e0: float, t: int) -> float:
  """The strongly convex bound on E||x_t - x*||^2 (module docstring) with constant B = ``b``."""
  mu, lip, s2 = config["mu"], config["L"], config["noise"]
  rho = 1.0 - lr * mu + 2.0 * lr ** 2 * lip ** 2
  drift = lr ** 2 * s2 + lr ** 3 * lip ** 2 * b ** 2 * (1.0 / mu + 2.0 * lr)
  return rho ** t * e0 + (1.0 - rho ** t) / (1.0 - rho) * drift


def nonconvex_bound(config: dict[str, Any], lr: float, b: float, f0: float) -> float:
  """The non-convex bound on the mean squared gradient norm over the run (module docstring)."""
  lip, s2, steps = config["L"], config["noise"], config["steps"]
  return 2.0 * f0 / (lr * steps) + lip * lr * s2 + lip ** 2 * lr ** 2 * b ** 2


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  prob = problem(config)
  hessian = jnp.asarray(prob.hessian)
  steps, lr = config["steps"], learning_rate(config, spec)

  def loss_fn(w, batch):
    return 0.5 * w @ (hessian @ w) - jnp.mean(batch["z"] @ w)

  source = _source(config, spec, jnp.asarray(prob.x0), seed)
  result = dj.simulate(
      loss_fn, optax.chain(keep_read(), optax.sgd(lr)), jnp.asarray(prob.x0), prob.data, source,
      num_updates=steps, seed=seed, sampling=dj.Sampling(batch_size=1),
      record=dj.Record(every=1, eval_fn=lambda p, s: (p, s[0].read), eval_state=True,
                       callback=lambda info: progress(info["updates_done"], info["num_updates"])),
      execution=dj.Execution(like=_like(config, spec, seed)))
  versions, reads = (np.asarray(x, np.float64) for x in result.history.eval_metrics)
  x, v = versions[:-1], reads[1:]  # evaluation k follows update k - 1: its read is that update's
  a = prob.hessian.astype(np.float64)
  measured = dj.analysis.elastic_consistency(x, v, lr)
  tau = int(result.history.staleness.max())
  m2 = float(np.max(np.sum((v @ a) ** 2, axis=1)) + config["noise"])
  err = np.sum(versions ** 2, axis=1)  # ||x_t - x*||^2, x* = 0
  grad2 = np.sum((x @ a) ** 2, axis=1)
  f0 = float(0.5 * versions[0] @ a @ versions[0])
  late = int(round(steps * (1.0 - config["late"])))
  b_prior = tau * math.sqrt(m2)
  metrics = {
      "b_max": measured.b_max, "b_rms": measured.b_rms, "tau_max": tau, "m": math.sqrt(m2), "b_prior": b_prior,
      "late_error": float(err[late:].mean()), "mean_grad2": float(grad2.mean()),
      "mean_staleness": float(result.history.staleness.mean()),
  }
  if spec["part"] == "torn":
    metrics["sc_bound"] = strongly_convex_bound(config, lr, b_prior, float(err[0]), late)
  metrics["nc_bound"] = nonconvex_bound(config, lr, measured.b_rms, f0)
  every = max(1, steps // 100)
  return {
      "metrics": metrics,
      "curves": {"update": np.arange(0, steps + 1, every), "error": err[::every],
                 "gap_steps": np.concatenate([measured.gap, measured.gap[-1:]])[::every] / lr},
      "staleness_hist": np.bincount(np.asarray(result.history.staleness)),
      "diverged": not bool(np.all(np.isfinite(versions))),
  }


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  return mean_rows(records, fields=("part",))


def _keys(summary: Summary, prefix: str) -> list[str]:
  return [k for k in summary if k.startswith(prefix)]


def _margin(summary: Summary, key: str, bound: str, value: str, what: str):
  """Per seed, bound - value (> 0: the bound holds)."""
  return compare(across_seeds(lambda b, v: b - v, seed_values(summary, key, bound), seed_values(summary, key, value)),
                 claim="greater", what=f"{what} {key}")


def _torn_within_bound(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([_margin(summary, k, "sc_bound", "late_error", "strongly convex bound (B = tau M) - "
                                     "late ||x - x*||^2,") for k in _keys(summary, "torn-tau")])


def _torn_delay_costs(summary: Summary) -> ClaimResult:
  keys = sorted(_keys(summary, "torn-tau"), key=lambda k: int(k[len("torn-tau"):]))
  return ClaimResult.decide(compare(seed_values(summary, keys[-1], "late_error"),
                                    seed_values(summary, keys[0], "late_error"), claim="greater",
                                    what=f"late ||x - x*||^2 {keys[-1]} - {keys[0]}"))


def _torn_like_consistent(summary: Summary) -> ClaimResult:
  stale = _keys(summary, "stale-tau")[0]
  torn = "torn" + stale[len("stale"):]
  ratio = across_seeds(lambda a, b: math.log(a / b), seed_values(summary, torn, "late_error"),
                       seed_values(summary, stale, "late_error"))
  return ClaimResult.decide(compare(ratio, claim="within", margin=math.log(1.25),
                                    what=f"log(late ||x - x*||^2 {torn} / {stale}), within log 1.25"))


def _b_within_tau_m(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([_margin(summary, k, "b_prior", "b_max", "tau_max M - B_max,")
                             for k in summary if summary[k]["part"] == "elastic" or k.startswith("torn-tau")
                             and not k.endswith("tau0")])


def _b_grows_with_asynchrony(summary: Summary) -> ClaimResult:
  keys = sorted(_keys(summary, "asp-M"), key=lambda k: int(k[len("asp-M"):]))
  return ClaimResult.decide(compare(seed_values(summary, keys[-1], "b_rms"), seed_values(summary, keys[0], "b_rms"),
                                    claim="greater", what=f"B_rms {keys[-1]} - {keys[0]}"))


def _ssp_caps_b(summary: Summary) -> ClaimResult:
  ssp = _keys(summary, "ssp-M")[0]
  asp = "asp-M" + ssp[len("ssp-M"):].split("-")[0]
  return ClaimResult.decide(compare(seed_values(summary, ssp, "b_max"), seed_values(summary, asp, "b_max"),
                                    claim="less", what=f"B_max {ssp} - {asp}"))


def _nonconvex_bound_holds(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([_margin(summary, k, "nc_bound", "mean_grad2", "non-convex bound (measured B_rms) - "
                                     "mean ||grad f||^2,") for k in summary if summary[k]["part"] == "elastic"])


CLAIMS = [
    Claim("torn-within-bound", "under torn reads with every max delay tau, SGD's late E||x - x*||^2 stays below the "
          "strongly convex bound with B = tau M", _torn_within_bound),
    Claim("torn-delay-costs", "the largest tau ends with a larger E||x - x*||^2 than tau = 0 (the delay term of the "
          "bound grows with tau)", _torn_delay_costs),
    Claim("torn-like-consistent", "torn reads converge like consistent stale reads with the same delays (late "
          "E||x - x*||^2 within 25%)", _torn_like_consistent),
    Claim("b-within-tau-m", "the measured elastic-consistency constant B is at most tau_max M for torn reads, ASP, "
          "SSP and periodic pulls", _b_within_tau_m),
    Claim("b-grows-with-asynchrony", "ASP with more workers has a larger B", _b_grows_with_asynchrony),
    Claim("ssp-caps-b", "SSP's staleness bound makes B smaller than ASP's on the same workers", _ssp_caps_b),
    Claim("nonconvex-bound-holds", "for ASP, SSP and periodic pulls the mean squared gradient norm stays below the "
          "non-convex bound with the measured B", _nonconvex_bound_holds),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  torn = [r for r in records if r["spec"]["part"] == "torn"]
  elastic = [r for r in records if r["spec"]["part"] == "elastic"]
  colors = _plots.palette([s["key"] for s in specs(config)])
  return [
      _plots.curves(torn, out, "torn_error", y="error", ylabel="||x - x*||^2", xs=("update",), log_y=True,
                    colors=colors),
      _plots.curves(elastic, out, "elastic_gap", y="gap_steps", ylabel="||x_t - v_t|| / eta", xs=("update",),
                    colors=colors),
  ]


# No paper_numbers: only the two abstracts were reachable; both papers are theory and state no measured figure.
REPRODUCTION = Reproduction(
    name="consistency",
    paper="Alistarh, De Sa, Konstantinov: The Convergence of Stochastic Gradient Descent in Asynchronous Shared "
          "Memory, PODC 2018; Nadiradze, Markov, Chatterjee, Kungurtsev, Alistarh: Elastic Consistency, AAAI 2021",
    description="SGD on a rotated quadratic under torn reads (tau = 0, 4, 8) against the strongly convex bound; the "
                "elastic-consistency constant B of ASP, SSP and periodic pulls against tau M and the non-convex "
                "bound.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "late_error", "sc_bound", "b_max", "b_rms", "b_prior", "tau_max", "mean_grad2", "nc_bound"),
    smoke=dict(steps=40, seeds=1, taus=[0, 2], asp_workers=[2, 4], ssp=[4, 1], pull=4),
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
