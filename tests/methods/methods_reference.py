"""NumPy references for the methods tests: an L1-regularized least-squares problem and its composite optimum."""

from __future__ import annotations

import numpy as np

import delayjax as dj


def lasso_problem(n: int = 48, d: int = 6, lam: float = 1e-2, seed: int = 0) -> dj.problems.FiniteSum:
  """A small ridge-regularized least-squares finite sum (the smooth part; the L1 term is added apart)."""
  return dj.problems.make_dense("least_squares", n, d, lam=lam, seed=seed)


def soft(x: np.ndarray, t: float) -> np.ndarray:
  return np.sign(x) * np.maximum(np.abs(x) - t, 0.0)


def composite_optimum(problem: dj.problems.FiniteSum, l1: float, iters: int = 20000) -> np.ndarray:
  """argmin F(w) + l1 |w|_1 by proximal gradient (ISTA) in float64, to a fixed-point residual below 1e-13."""
  step = 1.0 / problem.smoothness().l
  w = np.zeros(problem.num_features)
  for _ in range(iters):
    new = soft(w - step * problem.gradient(w), step * l1)
    if np.max(np.abs(new - w)) < 1e-13:
      return new
    w = new
  raise AssertionError("ISTA did not converge")
