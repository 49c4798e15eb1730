"""History pieces every runtime shares: evaluation points and the non-finite report."""

from __future__ import annotations

import numpy as np


def eval_points(num_updates: int, eval_every: int | None) -> np.ndarray:
  """int64: the versions evaluated: 0, every ``eval_every``-th and the last, sorted."""
  points = {0, num_updates}
  if eval_every is not None:
    points.update(range(eval_every, num_updates, eval_every))
  return np.asarray(sorted(points), np.int64)


def sorted_pairs(rows: np.ndarray) -> np.ndarray:
  """int64 ``[n, 2]`` rows such as ``(update, worker)``, sorted by the first column, then the second."""
  rows = np.asarray(rows).astype(np.int64).reshape(-1, 2)
  return rows[np.lexsort((rows[:, 1], rows[:, 0]))]
