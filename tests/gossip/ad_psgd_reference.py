"""AD-PSGD (Lian, Zhang, Zhang, Liu, ICML 2018, Algorithm 1) as a slow, event-by-event NumPy simulation (tests only).

It knows nothing of ``GossipSchedule``: it builds its own timeline from constant per-worker durations and runs
Algorithm 1's steps on flat float64 vectors. Worker ``m`` computes each gradient in ``compute[m]`` seconds and
its averaging message takes ``comm`` seconds; its ``j``-th loop:

1. reads ``x_m`` at ``r_j`` and computes ``g = grad_fn(x_m, m, j)`` at that snapshot;
2. if it initiates averagings (``peers[j, m] >= 0``), averages atomically with ``p = peers[j, m]``:
   ``x_m, x_p <- (x_m + x_p) / 2``, at ``r_j + comm`` (``average="read"``) or, Algorithm 1's order, just before
   step 3 (``average="completion"``);
3. applies ``x_m <- x_m - lr g`` at ``a_j = max(r_j + compute[m], r_j + comm)`` (``r_j + compute[m]`` for a
   worker that does not initiate), and reads again: ``r_{j+1} = a_j``.

All events are run in time order; at one second, one worker's averaging comes before its apply, and its apply
before its next read, and workers go in index order. The run stops when ``total`` gradients have been applied.
Callers choose durations under which the only events of two workers on one second are those of the first loop
(everyone reads at 0, the initiators average at ``comm`` under ``"read"``), where the simulator too starts the
workers in index order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

_MIX, _GRAD, _READ = 0, 1, 2   # the order of one worker's events at one second


def run(compute: np.ndarray, comm: float, peers: np.ndarray, total: int,
        grad_fn: Callable[[np.ndarray, int, int], np.ndarray], x0: np.ndarray, *, lr: float,
        average: str) -> dict:
  """Runs AD-PSGD until ``total`` gradients are applied.

  Args:
    compute: ``[M]`` seconds per gradient of each worker.
    comm: seconds of one averaging's message.
    peers: ``[J, M]``: the peer of worker ``m``'s ``j``-th averaging, ``-1`` where it initiates none.
    grad_fn: ``grad_fn(x, worker, j) -> gradient`` of worker ``worker``'s ``j``-th minibatch at ``x``.
    x0: ``[M, d]`` initial models.
    average: ``"read"`` or ``"completion"``.

  Returns:
    ``{"x": [M, d], "events": [(time, kind, worker)] in execution order, kind "read" / "mix" / "grad"}``.
  """
  if average not in ("read", "completion"):
    raise ValueError(f"average must be 'read' or 'completion', got {average!r}.")
  num = compute.shape[0]
  # The timeline: every worker's loops, far enough that `total` applies happen before any worker runs out.
  timeline = []
  for m in range(num):
    r = 0.0
    for j in range(peers.shape[0]):
      initiates = peers[j, m] >= 0
      apply_at = max(r + compute[m], r + comm) if initiates else r + compute[m]
      timeline.append((r, m, _READ, j))
      if initiates:
        timeline.append((apply_at if average == "completion" else r + comm, m, _MIX, j))
      timeline.append((apply_at, m, _GRAD, j))
      r = apply_at
  timeline.sort()
  x = np.array(x0, np.float64)
  pending = [None] * num
  events = []
  applied = 0
  for t, m, kind, j in timeline:
    if kind == _READ:
      pending[m] = np.asarray(grad_fn(x[m].copy(), m, j), np.float64)
      events.append((t, "read", m))
    elif kind == _MIX:
      p = int(peers[j, m])
      x[m] = x[p] = (x[m] + x[p]) / 2
      events.append((t, "mix", m))
    else:
      x[m] = x[m] - lr * pending[m]
      pending[m] = None
      events.append((t, "grad", m))
      applied += 1
      if applied == total:
        break
  assert applied == total, "the timeline is too short: pass more rows of peers"
  return {"x": x, "events": events}
