"""dj.analysis.gradient_mapping_norm: the proximal gradient mapping's norm against closed forms, and bad inputs."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from delayjax import analysis


def l1_mapping(x: np.ndarray, g: np.ndarray, lam: float, eta: float) -> np.ndarray:
  """The L1 gradient mapping coordinate by coordinate: x / eta where the prox zeroes it, g + lam sign else."""
  z = x - eta * g
  return np.where(np.abs(z) <= eta * lam, x / eta, g + lam * np.sign(z))


def test_l1_mapping_matches_the_closed_form_on_both_sides_of_the_threshold():
  rng = np.random.default_rng(0)
  x = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5) * 0.05}
  g = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5) * 0.05}
  lam, eta = 0.3, 0.7
  parts = [l1_mapping(x[k], g[k], lam, eta) for k in ("a", "b")]
  zeroed = sum(int(np.sum(np.abs(x[k] - eta * g[k]) <= eta * lam)) for k in ("a", "b"))
  assert 0 < zeroed < 17  # both branches of the closed form are exercised
  want = math.sqrt(sum(float(np.sum(p ** 2)) for p in parts))
  assert analysis.gradient_mapping_norm(x, g, dj.prox_l1(lam), eta) == pytest.approx(want, rel=1e-14)


def test_without_a_regularizer_it_is_the_gradient_norm_and_with_a_box_the_projected_step():
  rng = np.random.default_rng(1)
  x, g = rng.standard_normal(7), rng.standard_normal(7)
  assert analysis.gradient_mapping_norm(x, g, dj.prox_l1(0.0), 0.4) == pytest.approx(np.linalg.norm(g), rel=1e-14)
  boxed = np.clip(x, -0.5, 0.5)
  want = np.linalg.norm((boxed - np.clip(boxed - 0.4 * g, -0.5, 0.5)) / 0.4)
  assert analysis.gradient_mapping_norm(boxed, g, dj.prox_box(-0.5, 0.5), 0.4) == pytest.approx(want, rel=1e-14)


def test_zero_exactly_at_a_stationary_point_of_the_composite_problem():
  # 0 in g + lam * subdifferential: x_i != 0 with g_i = -lam sign(x_i), or x_i = 0 with |g_i| <= lam.
  x = np.array([1.0, -2.0, 0.0, 0.0])
  g = np.array([-0.25, 0.25, 0.1, -0.25])
  assert analysis.gradient_mapping_norm(x, g, dj.prox_l1(0.25), 0.5) == 0.0
  assert analysis.gradient_mapping_norm(x, g + np.array([0, 0, 0.2, 0]), dj.prox_l1(0.25), 0.5) > 0.0


def test_float32_inputs_are_measured_in_float64():
  # A mapping of 1e-9 beside parameters of order 1: float32 arithmetic would round x - eta g back to x.
  x = np.array([1.0, 2.0], np.float32)
  g = np.array([1e-9, 0.0], np.float32)
  got = analysis.gradient_mapping_norm(jnp.asarray(x), jnp.asarray(g), dj.prox_l1(0.0), 0.5)
  assert got == pytest.approx(float(g[0]), rel=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prox="l1"), TypeError, "prox must be a callable"),
    (dict(step=0.0), ValueError, "step must be > 0"),
    (dict(step=-1.0), ValueError, "step must be > 0"),
    (dict(step=float("nan")), ValueError, "step must be finite"),
    (dict(step="0.1"), TypeError, "step must be a real number"),
    (dict(grads={"w": np.zeros(3)}), ValueError, "grads must have the tree of params"),
    (dict(grads=np.zeros(4)), ValueError, r"grads must have the shapes of params: leaf 0 has shape \(4,\)"),
    (dict(params=np.array(["a", "b", "c"])), TypeError, "params must hold real arrays"),
    (dict(grads=np.zeros(3, complex)), TypeError, "grads must hold real arrays"),
    (dict(params=(), grads=()), ValueError, "params must hold at least one array"),
])
def test_bad_inputs_name_the_argument(kwargs, error, match):
  args = dict(params=np.ones(3), grads=np.zeros(3), prox=dj.prox_l1(0.1), step=0.1) | kwargs
  with pytest.raises(error, match=match):
    analysis.gradient_mapping_norm(**args)
