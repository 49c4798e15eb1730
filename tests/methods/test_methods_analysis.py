"""dj.analysis: exact discrete-time moments of delayed SGD on a quadratic and its continuous-time model's."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import linalg, optimize, special

import delayjax as dj
from delayjax import analysis

TAU, LR, SIGMA = 4, 0.25, 1.0
CURVATURES = (0.1, 1.2)  # eta h tau = 0.1 (small step) and 1.2 (where the continuous model breaks)
PER_GROUP = 256


def lyapunov_variance(h, s2, eta, tau):
  """The stationary variance from the discrete Lyapunov equation of the companion form (scipy)."""
  a = np.zeros((tau + 1, tau + 1))
  a[0, 0] = 1.0
  a[0, tau] -= eta * h
  a[np.arange(1, tau + 1), np.arange(tau)] = 1.0
  b = np.zeros((tau + 1, 1))
  b[0, 0] = -eta
  return linalg.solve_discrete_lyapunov(a, s2 * b @ b.T)[0, 0]


@pytest.mark.parametrize("tau", [0, 1, 3, 8])
@pytest.mark.parametrize("eta", [0.01, 0.1, 0.15])
def test_exact_variance_and_contraction_match_independent_computations(tau, eta):
  h, s2 = 1.3, 0.7
  rho = analysis.contraction(h, eta, tau)
  np.testing.assert_allclose(rho, np.max(np.abs(np.roots([1.0, -1.0] + [0.0] * (tau - 1) + [eta * h])))
                             if tau else abs(1 - eta * h), rtol=1e-9)
  if rho < 1:
    np.testing.assert_allclose(analysis.stationary_variance(h, s2, eta, tau), lyapunov_variance(h, s2, eta, tau),
                               rtol=1e-9)
  else:
    assert analysis.stationary_variance(h, s2, eta, tau) == math.inf
  assert (rho < 1) == (eta < analysis.stable_learning_rate(h, tau))


@pytest.mark.parametrize("tau", [1, 2, 5, 16])
def test_optimal_steps_minimize_their_contractions(tau):
  h = 2.0
  exact = optimize.minimize_scalar(lambda e: analysis.contraction(h, e, tau), bounds=(1e-4, 1.0 / h),
                                   method="bounded", options={"xatol": 1e-10}).x
  np.testing.assert_allclose(analysis.optimal_learning_rate(h, tau), exact, rtol=1e-4)
  sde = optimize.minimize_scalar(lambda e: analysis.sde_contraction(h, e, tau), bounds=(1e-4, 1.0 / h),
                                 method="bounded", options={"xatol": 1e-10}).x
  np.testing.assert_allclose(analysis.sde_optimal_learning_rate(h, tau), sde, rtol=1e-4)
  # The continuous model's optimum overshoots the exact one, by less as tau grows: ((tau + 1) / tau)^(tau + 1) / e.
  ratio = analysis.sde_optimal_learning_rate(h, tau) / analysis.optimal_learning_rate(h, tau)
  np.testing.assert_allclose(ratio, ((tau + 1) / tau) ** (tau + 1) / math.e, rtol=1e-9)


def test_sde_contraction_is_lambert_w_and_variance_is_the_small_step_limit():
  for tau, eta in [(1, 0.3), (4, 0.05), (4, 0.3)]:
    want = math.exp(special.lambertw(-1.5 * tau * eta).real / tau)
    np.testing.assert_allclose(analysis.sde_contraction(1.5, eta, tau), want, rtol=1e-10)
  # As eta -> 0 the exact variance tends to the SDE's (relative error about eta h / 2).
  for tau in (0, 2, 8):
    eta = 1e-4
    exact = analysis.stationary_variance(1.0, 1.0, eta, tau)
    np.testing.assert_allclose(analysis.sde_stationary_variance(1.0, 1.0, eta, tau), exact, rtol=2e-4)
  # The SDE mean is the delay ODE: its late decay per update matches the Lambert-W contraction.
  m = analysis.sde_mean_path(1.0, 0.05, 4, 1.0, 400, substeps=256)
  np.testing.assert_allclose((abs(m[400]) / abs(m[300])) ** (1 / 100),
                             analysis.sde_contraction(1.0, 0.05, 4), rtol=2e-3)


def test_simulated_moments_match_exact_and_sde_breaks_at_large_steps():
  rng = np.random.default_rng(0)
  z = rng.standard_normal((4096, 2 * PER_GROUP))
  z = (z - z.mean(0)) / z.std(0)  # the noise has mean 0 and variance 1 exactly over the data
  h = jnp.asarray(np.repeat(CURVATURES, PER_GROUP), jnp.float32)

  def loss_fn(x, batch):
    return 0.5 * jnp.sum(h * x * x) - SIGMA * jnp.vdot(jnp.mean(batch["z"], axis=0), x)

  num_updates, burn_in = 1400, 400
  result = dj.simulate(loss_fn, optax.sgd(LR), jnp.ones(2 * PER_GROUP, jnp.float32),
                       {"z": jnp.asarray(z, jnp.float32)}, dj.delays.constant(TAU), num_updates=num_updates,
                       sampling=dj.Sampling(batch_size=1), record=dj.Record(eval_fn=lambda x: x, every=1), seed=0)
  xs = np.asarray(result.history.eval_metrics, np.float64)  # [U + 1, D]
  for g, curvature in enumerate(CURVATURES):
    group = xs[:, g * PER_GROUP:(g + 1) * PER_GROUP]
    mean = analysis.mean_path(curvature, LR, TAU, 1.0, num_updates)
    exact = analysis.stationary_variance(curvature, SIGMA ** 2, LR, TAU)
    # The mean over the group against the exact mean, within 5 standard errors of a group average.
    np.testing.assert_allclose(group[:100].mean(1), mean[:100], atol=5 * math.sqrt(exact / PER_GROUP))
    measured = np.mean(group[burn_in:] ** 2)
    assert abs(measured / exact - 1) < 0.08, (curvature, measured, exact)
    sde_error = abs(analysis.sde_stationary_variance(curvature, SIGMA ** 2, LR, TAU) / measured - 1)
    if curvature * LR * TAU < 0.2:
      assert sde_error < 0.08, (curvature, sde_error)
    else:
      assert sde_error > 0.3, (curvature, sde_error)


def test_bad_inputs():
  with pytest.raises(ValueError, match="curvature"):
    analysis.stationary_variance(0.0, 1.0, 0.1, 2)
  with pytest.raises(ValueError, match="learning_rate"):
    analysis.contraction(1.0, -0.1, 2)
  with pytest.raises(ValueError, match="tau"):
    analysis.sde_stationary_variance(1.0, 1.0, 0.1, -1)
  with pytest.raises(TypeError, match="tau"):
    analysis.mean_path(1.0, 0.1, 1.5, 1.0, 10)
  with pytest.raises(ValueError, match="noise_var"):
    analysis.stationary_variance(1.0, -1.0, 0.1, 2)
  with pytest.raises(ValueError, match="tau must be >= 1"):
    analysis.sde_optimal_learning_rate(1.0, 0)
