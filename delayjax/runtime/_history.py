"""History pieces every runtime shares: evaluation points and the non-finite report."""

from __future__ import annotations

import warnings

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


def chunk_span(updates_per_chunk: np.ndarray, healthy: np.ndarray) -> tuple[int, int] | None:
  """The updates ``(first, last)`` of the first chunk after which a health check failed, or ``None``.

  ``updates_per_chunk``: how many updates each chunk applied; ``healthy``: the
  check after each chunk (the engine's ``"check"`` record).
  """
  bad = np.flatnonzero(~np.asarray(healthy, bool))
  if not bad.size:
    return None
  ends = np.cumsum(updates_per_chunk)
  c = int(bad[0])
  return int(ends[c] - updates_per_chunk[c]), int(ends[c] - 1)


def nonfinite_report(runtime: str, gradients: np.ndarray, skipped: np.ndarray | None,
                     state_span: tuple[int, int] | None, *, stacklevel: int = 3, source: str = "worker",
                     can_skip: bool = False) -> str | None:
  """Warns (``RuntimeWarning``) if a run met non-finite values, and returns the message (``None`` if not).

  Args:
    runtime: the runtime's public name, which starts the message.
    gradients: ``(update, worker)`` rows of the non-finite gradients, sorted.
    skipped: ``(update, worker)`` rows of the updates left out because their
      update or new optimizer state was not finite (``None``: not checked).
    state_span: the updates ``(first, last)`` of the chunk after which the
      parameters or optimizer state were first found non-finite, or ``None``.
    stacklevel: passed to ``warnings.warn`` (the user's call by default).
    source: what the second column of ``gradients`` counts (``"worker"``, ``"replica"``, ``"stage"``).
    can_skip: whether the runtime can skip such updates (``dj.Record(nonfinite="skip")``), which the
      message then says.
  """
  parts = []
  if len(gradients):
    u, m = gradients[0]
    left = " (left out of their updates)" if skipped is not None else ""
    parts.append(f"{len(gradients)} gradients were not finite{left}, the first at update {u} from {source} {m}")
  if skipped is not None and len(skipped):
    u, m = skipped[0]
    parts.append(f"{len(skipped)} updates were skipped because their update or optimizer state was not "
                 f"finite, the first at update {u} (worker {m} the stalest contribution)")
  if state_span is not None:
    parts.append(f"the parameters or optimizer state became non-finite between updates {state_span[0]} and "
                 f"{state_span[1]} (checked after every chunk"
                 + ("; dj.Record(nonfinite='skip') skips such updates)" if can_skip else ")"))
  if not parts:
    return None
  message = f"{runtime}: " + "; ".join(parts) + "."
  warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
  return message
