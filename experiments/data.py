"""Data sets for the experiments; the default, scikit-learn's bundled digits, needs no download."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Split(NamedTuple):
  x_train: np.ndarray  # float32 [n_train, features]
  y_train: np.ndarray  # int32 [n_train]
  x_test: np.ndarray  # float32 [n_test, features]
  y_test: np.ndarray  # int32 [n_test]


def digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
  """The 8x8 handwritten digits bundled with scikit-learn (1797 images, 10 classes).

  Pixels are scaled to [0, 1]; the split is a seeded permutation, stratified
  by nothing but chance (the classes are balanced).
  """
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_test = int(round(test_fraction * len(y)))
  test, train = order[:n_test], order[n_test:]
  return Split(x[train], y[train], x[test], y[test])
