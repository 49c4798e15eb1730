"""A slow, obviously-correct sequential executor of a ``GossipSchedule`` (tests only).

It walks the events one by one in NumPy float64 and keeps, per replica, the
model ``x_i`` (a flat vector), the momentum buffer ``v_i``, the snapshot and
pending gradient of its last ``READ``, and *every* past version of its model
(so a message ``lag`` versions old is simply looked up). The rules, written
out directly:

- ``READ`` of replica ``i`` with ``nb`` minibatches starting at ``j``:
  ``g_i = (1/nb) sum_{q < nb} grad_fn(x_i / w_i, i, j + q)`` (``w_i = 1`` unless
  ``push_sum``), where ``j`` counts the minibatches replica ``i`` read before.
- ``GRAD`` of replica ``i``: SGD with heavy-ball momentum, as
  ``optax.sgd(lr, momentum)``: ``v_i <- momentum * v_i + g_i``,
  ``x_i <- x_i - lr * v_i``; the version of ``i`` grows by one.
- ``MIX`` of ``PARAMS``: every sent value ``s_b = x_{m_b}`` at version
  ``version(m_b) - lag_b`` is taken first, then each receiving member gets
  ``x_{m_a} = sum_b W_ab s_b`` (and ``w_{m_a} = sum_b W_ab w_b^{sent}`` with
  ``push_sum``); receivers' versions grow by one.
- ``MIX`` of ``GRADS``: ``g_{m_a} <- sum_b W_ab g_{m_b}`` for receiving members,
  all from the values before the event.

``push_sum`` is SGP's de-biasing (Assran et al., ICML 2019): each replica also
carries a scalar weight ``w_i`` (1 at the start) mixed exactly like ``x_i``,
and gradients are computed at ``z_i = x_i / w_i``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

import delayjax as dj

C = dj.cluster


def run(schedule: C.GossipSchedule, grad_fn: Callable[[np.ndarray, int, int], np.ndarray], x0: np.ndarray, *,
        lr: float, momentum: float = 0.0, push_sum: bool = False, record: bool = False) -> dict:
  """Executes ``schedule`` from every replica at ``x0`` (a flat vector, or ``[M, d]`` per-replica starts).

  Args:
    grad_fn: ``grad_fn(z, replica, batch_index) -> gradient`` (same shape as ``z``).
    record: also return every replica's model after every event (``[E, M, d]``).

  Returns:
    ``{"x": [M, d], "w": [M], "momentum": [M, d], "version": [M], "models": [E, M, d] if record}``.
  """
  num = schedule.num_workers
  x0 = np.asarray(x0, np.float64)
  x = np.array(np.broadcast_to(x0, (num,) + x0.shape[-1:]))
  w = np.ones(num)
  v = np.zeros_like(x)
  history = [[(x[i].copy(), 1.0)] for i in range(num)]   # history[i][k]: (x_i, w_i) at version k
  pending: list[np.ndarray | None] = [None] * num
  batches = [0] * num
  models = []
  for e in range(schedule.num_events):
    kind = int(schedule.kind[e])
    if kind == C.READ:
      i, nb = int(schedule.worker[e]), int(schedule.num_batches[e])
      z = x[i] / w[i]
      pending[i] = sum(np.asarray(grad_fn(z, i, batches[i] + q), np.float64) for q in range(nb)) / nb
      batches[i] += nb
    elif kind == C.GRAD:
      i = int(schedule.worker[e])
      assert pending[i] is not None
      v[i] = momentum * v[i] + pending[i]
      x[i] = x[i] - lr * v[i]
      pending[i] = None
      history[i].append((x[i].copy(), w[i]))
    else:
      k = int(schedule.mix[e])
      members = [int(m) for m in schedule.members[k] if m >= 0]
      weights = schedule.weights[k]
      receives = schedule.receives[k]
      if schedule.mixes[k] == C.PARAMS:
        sent = [history[m][len(history[m]) - 1 - int(schedule.lag[k, b])] for b, m in enumerate(members)]
        new = {}
        for a, m in enumerate(members):
          if receives[a]:
            new[m] = (sum(weights[a, b] * sent[b][0] for b in range(len(members))),
                      sum(weights[a, b] * sent[b][1] for b in range(len(members))))
        for m, (xm, wm) in new.items():
          x[m] = xm
          if push_sum:
            w[m] = wm
          history[m].append((x[m].copy(), w[m]))
      else:
        grads = [pending[m] for m in members]
        for a, m in enumerate(members):
          if receives[a]:
            pending[m] = sum(weights[a, b] * grads[b] for b in range(len(members)))
    if record:
      models.append(x.copy())
  out = {"x": x, "w": w, "momentum": v, "version": np.array([len(h) - 1 for h in history])}
  if record:
    out["models"] = np.stack(models)
  return out
