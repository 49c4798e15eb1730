"""experiments.sketch_project: the reformulation's step is the Kaczmarz projection, its mean is W, and the bounds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from experiments import sketch_project

CONFIG = dict(sketch_project.SCALES["quick"])


def problem():
  a, b, x_star = sketch_project.system(CONFIG)
  return dj.problems.FiniteSum("least_squares", targets=b, lam=0.0, features=a), a, b, x_star


def test_the_system_is_consistent_with_unit_rows_and_a_unique_solution():
  _, a, b, x_star = problem()
  np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-14)
  np.testing.assert_allclose(a @ x_star, b, rtol=1e-14)
  assert np.linalg.matrix_rank(a) == a.shape[1]


def test_an_sgd_step_of_one_on_f_s_is_the_projection_onto_the_sketched_equation():
  """omega = 1: x - grad f_S(x) satisfies a_i.x = b_i and moves along a_i only (sketch-and-project, B = I)."""
  p, a, b, _ = problem()
  data = p.data(jnp.float32)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(a.shape[1]), jnp.float32)
  for i in (0, 7, 63):
    row = jax.tree.map(lambda v: v[i], data)
    new = np.asarray(x - jax.grad(p.loss_fn)(x, row), np.float64)
    assert a[i] @ new == pytest.approx(b[i], abs=1e-5)
    moved = new - np.asarray(x, np.float64)
    np.testing.assert_allclose(moved, (moved @ a[i]) * a[i], atol=1e-5)


def test_the_mean_gradient_is_w_times_the_error():
  """E_i grad f_S(x) = W (x - x*), W = A^T A / n: the matrix of the mean recursion and of the paper's rate."""
  p, a, _, x_star = problem()
  x = np.random.default_rng(1).standard_normal(a.shape[1])
  with jax.enable_x64():
    data = p.data(jnp.float64)
    grads = jax.vmap(jax.grad(p.loss_fn), in_axes=(None, 0))(jnp.asarray(x), data)
    mean = np.asarray(grads).mean(0)
  w = a.T @ a / a.shape[0]
  np.testing.assert_allclose(mean, w @ (x - x_star), rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(sketch_project.w_eigenvalues(CONFIG), np.linalg.eigvalsh(w), rtol=1e-12)


def test_bounds_match_their_closed_forms():
  ev = sketch_project.w_eigenvalues(CONFIG)
  for omega in (1.0, 0.25):
    expected = CONFIG["steps"] * math.log10(1 - omega * (2 - omega) * ev[0])
    assert sketch_project.paper_bound(CONFIG, omega) == pytest.approx(expected, rel=1e-12)
  for tau, omega in zip(CONFIG["taus"], CONFIG["omegas"]):
    limit = 2 * math.sin(math.pi / (2 * (2 * tau + 1))) / ev[-1]
    assert sketch_project.within_bound(CONFIG, tau, omega) == (omega < limit)
  # The quick grid has runs on both sides of the delay bound.
  inside = [sketch_project.within_bound(CONFIG, t, w) for t, w in zip(CONFIG["taus"], CONFIG["omegas"])]
  assert any(inside) and not all(inside)
