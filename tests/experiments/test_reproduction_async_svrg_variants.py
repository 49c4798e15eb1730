"""experiments.async_svrg_variants: its runs are the stale-read loops of the module docstring (checked against
float64 NumPy re-implementations), and its metrics are what they claim to be."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import async_svrg_variants as asv
from experiments import variance_reduction as vr

import delayjax as dj

CONFIG = dict(asv.SCALES["quick"], taus=[0, 3], lsq_n=30, lsq_d=4, epochs=2, cd_epochs=2, nc_epochs=1)
TAU, SEED = 3, 2


def _picks_and_reads(num_updates, n, batch, epoch):
  workers = max(CONFIG["taus"]) + 1
  with jax.enable_x64(True):
    schedule = vr.stale_reads(dj.delays.uniform(TAU), num_updates, SEED, workers, epoch=epoch)
  t = np.arange(num_updates)
  picks = [np.asarray(dj.runtime.minibatch_indices(SEED, u, u % workers, u // workers, num_examples=n,
                                                   batch_size=batch)) for u in t]
  return picks, schedule.read_version.max(axis=1)


def lasso_reference(method, finite_sum, epochs, eta, l1):
  """Prox-SGD / Async-ProxSVRG on the lasso problem, batches of one, in float64 NumPy: the iterates at epoch ends."""
  x, y, lam = np.asarray(finite_sum.features), np.asarray(finite_sum.targets), finite_sum.lam
  n, d = x.shape
  picks, reads = _picks_and_reads(epochs * n, n, 1, n if method == "prox_svrg" else None)

  def grad(w, i):
    return (x[i] @ w - y[i]) @ x[i] / len(i) + lam * w

  versions = [np.zeros(d)]
  for t in range(epochs * n):
    w = versions[-1]
    v = grad(versions[reads[t]], picks[t])
    if method == "prox_svrg":
      if t % n == 0:
        snap, mu = w, finite_sum.gradient(w)
      v = v - grad(snap, picks[t]) + mu
    z = w - eta * v
    versions.append(np.sign(z) * np.maximum(np.abs(z) - eta * l1, 0.0))
  return np.stack(versions[::n])


@pytest.mark.parametrize("method", ["prox_sgd", "prox_svrg"])
def test_a_lasso_run_is_the_numpy_reference(method):
  spec = {"key": f"lasso/{method}/tau={TAU}", "problem": "lasso", "method": method, "tau": TAU}
  record = asv.run(CONFIG, spec, SEED, lambda done, total: None)
  fs, p_star, l_max = asv.lasso_facts(CONFIG)
  ws = lasso_reference(method, fs, CONFIG["epochs"], CONFIG["step_scale"] / l_max, CONFIG["l1"])
  want = np.maximum([asv.lasso_value(fs, CONFIG["l1"], w) - p_star for w in ws], asv.FLOOR)
  np.testing.assert_allclose(record["curves"]["suboptimality"], want, rtol=1e-9, atol=1e-14)
  assert want[-1] < 0.5 * want[0]  # the run went somewhere


def test_a_nonconvex_svrg_run_is_the_numpy_reference():
  spec = {"key": f"nonconvex/svrg/tau={TAU}", "problem": "nonconvex", "method": "svrg", "tau": TAU}
  record = asv.run(CONFIG, spec, SEED, lambda done, total: None)
  fs, alpha = asv.nonconvex_problem(CONFIG)
  x, y = np.asarray(fs.features, np.float64), np.asarray(fs.targets, np.float64)
  n, d = x.shape
  batch = CONFIG["batch"]
  epoch = n // batch
  eta = CONFIG["nc_step_scale"] / (0.25 + 2 * alpha)
  picks, reads = _picks_and_reads(epoch, n, batch, epoch)

  def grad(w, i):
    s = -y[i] / (1.0 + np.exp(y[i] * (x[i] @ w)))
    return x[i].T @ s / len(i) + alpha * 2 * w / (1 + w * w) ** 2

  versions = [np.zeros(d)]
  mu = grad(versions[0], np.arange(n))
  for t in range(epoch):
    v = grad(versions[reads[t]], picks[t]) - grad(versions[0], picks[t]) + mu
    versions.append(versions[-1] - eta * v)
  want = [asv.nonconvex_grad_norm2(fs, alpha, w) for w in (versions[0], versions[-1])]
  np.testing.assert_allclose(record["curves"]["suboptimality"], want, rtol=1e-8)
  assert want[1] < want[0]


def test_the_metrics_are_the_gradient_norm_and_a_prox_fixed_point():
  fs, alpha = asv.nonconvex_problem(CONFIG)
  w = np.linspace(-1.0, 1.0, int(fs.num_features))
  with jax.enable_x64(True):
    g = np.asarray(jax.grad(asv.nonconvex_loss(alpha))(jnp.asarray(w), fs.data(jnp.float64)), np.float64)
  np.testing.assert_allclose(asv.nonconvex_grad_norm2(fs, alpha, w), g @ g, rtol=1e-10)
  lasso, p_star, l_max = asv.lasso_facts(CONFIG)
  # Recover the minimizer from P* by proximal gradient steps: P* is a fixed point's value (no step lowers it).
  w, step = np.zeros(CONFIG["lsq_d"]), 0.5 / l_max
  for _ in range(5000):
    z = w - step * lasso.gradient(w)
    w = np.sign(z) * np.maximum(np.abs(z) - step * CONFIG["l1"], 0.0)
  assert abs(asv.lasso_value(lasso, CONFIG["l1"], w) - p_star) < 1e-12
  assert asv.lasso_value(lasso, CONFIG["l1"], w + 1e-3) > p_star


def test_specs_and_claims_cover_both_problems():
  keys = [s["key"] for s in asv.specs(asv.SCALES["quick"])]
  assert len(keys) == len(set(keys)) == 10
  assert {c.name for c in asv.CLAIMS} == {"nonconvex-vr-beats-sgd", "nonconvex-speedup", "prox-vr-linear",
                                          "prox-sgd-floor", "prox-svrcd-linear"}
