"""ASAP's stochastic reduce with NOTIFY-ACK (Kadav, Kruus 2016), as a slow NumPy event simulation (tests only).

It knows nothing of ``GossipSchedule``: it runs every node's loop on its own clock, with messages that carry a
copy of the sender's model (not a version to look up), and trains flat float64 vectors with plain SGD. Node ``m``
computes its ``j``-th gradient in ``compute[m, j]`` seconds; each of its messages, and each ACK it returns, takes
``comm[m]`` seconds. Its loop:

1. read ``x_m`` and compute ``g = grad_fn(x_m, m, j)``; when done, ``x_m <- x_m - lr g``;
2. reduce: with ``R`` the senders whose notified messages it holds, ``x_m <- (1 - sum_R W[m, s]) x_m +
   sum_R W[m, s] x_s^sent``, and (NOTIFY-ACK) ACK each of them;
3. if every receiver has ACKed its last message (or ``sync == "none"``), send ``x_m`` to all of them and go to 1;
   otherwise wait, reducing each message the moment it arrives (and ACKing it), until the last ACK comes, then
   send and go to 1.

Without NOTIFY-ACK a message that arrives while an older one of the same sender is still held replaces it.
A node's version counts its gradient steps and its reduces; each message is stamped with the sender's version.
Everything that happens at one second happens in the order it was caused (all nodes read at 0 in index order).
The run stops right after the ``total``-th gradient step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def run(compute: np.ndarray, comm: np.ndarray, adjacency: np.ndarray, w: np.ndarray, total: int,
        grad_fn: Callable[[np.ndarray, int, int], np.ndarray], x0: np.ndarray, *, lr: float,
        sync: str = "notify_ack") -> dict:
  """Runs ASAP until ``total`` gradient steps are taken.

  Args:
    compute: ``[M, J]`` seconds of each node's gradients.
    comm: ``[M]`` seconds of each node's messages and ACKs.
    adjacency: ``[M, M]`` bool, ``adjacency[i, j]``: ``i`` sends to ``j``.
    w: ``[M, M]`` weights, ``w[i, j]``: the weight of ``j``'s model in ``i``'s reduce.
    x0: ``[M, d]`` initial models.

  Returns:
    ``{"x": [M, d], "events": [...], "overwritten": [M]}``; events are ``("read", t, m)``, ``("grad", t, m)`` and
    ``("mix", t, m, senders, weights, sent_versions)`` (``weights``: ``m``'s own weight, then the senders').
  """
  num = compute.shape[0]
  x = np.array(x0, np.float64)
  version = np.zeros(num, np.int64)
  gradients = np.zeros(num, np.int64)
  pending_grad = [None] * num
  held: list[dict] = [dict() for _ in range(num)]          # sender -> (model copy, sender version)
  waiting_for: list[set] = [set() for _ in range(num)]      # receivers that have not ACKed
  idle = [False] * num
  overwritten = np.zeros(num, np.int64)
  events: list[tuple] = []
  agenda: list[list] = []   # [time, order, action, node, payload], kept unsorted; the earliest is taken
  counter = [0]

  def schedule(t, action, node, payload=None):
    agenda.append([t, counter[0], action, node, payload])
    counter[0] += 1

  def read(m, t):
    events.append(("read", t, m))
    pending_grad[m] = np.asarray(grad_fn(x[m].copy(), m, int(gradients[m])), np.float64)
    schedule(t + compute[m, gradients[m]], "finish", m)

  def do_reduce(m, t):
    if not held[m]:
      return
    senders = sorted(held[m])
    own = 1.0 - sum(w[m, s] for s in senders)
    x[m] = own * x[m] + sum(w[m, s] * held[m][s][0] for s in senders)
    events.append(("mix", t, m, tuple(senders), (own,) + tuple(w[m, s] for s in senders),
                   tuple(held[m][s][1] for s in senders)))
    version[m] += 1
    held[m] = {}
    if sync == "notify_ack":
      for s in senders:
        schedule(t + comm[m], "ack", s, m)

  def send_and_go(m, t):
    for r in np.flatnonzero(adjacency[m]):
      schedule(t + comm[m], "message", int(r), (m, x[m].copy(), int(version[m])))
    waiting_for[m] = set(np.flatnonzero(adjacency[m]).tolist()) if sync == "notify_ack" else set()
    read(m, t)

  for m in range(num):
    read(m, 0.0)
  steps = 0
  while steps < total:
    first = min(range(len(agenda)), key=lambda i: (agenda[i][0], agenda[i][1]))
    t, _, action, m, payload = agenda.pop(first)
    if action == "finish":
      x[m] = x[m] - lr * pending_grad[m]
      version[m] += 1
      gradients[m] += 1
      steps += 1
      events.append(("grad", t, m))
      if steps == total:
        break
      do_reduce(m, t)
      if waiting_for[m]:
        idle[m] = True
      else:
        send_and_go(m, t)
    elif action == "message":
      sender, model, sent_version = payload
      if sender in held[m]:
        assert sync == "none", "NOTIFY-ACK lets no sender have two messages held by one receiver"
        overwritten[m] += 1
      held[m][sender] = (model, sent_version)
      if idle[m]:
        do_reduce(m, t)
    else:
      waiting_for[m].discard(payload)
      if idle[m] and not waiting_for[m]:
        idle[m] = False
        send_and_go(m, t)
  return {"x": x, "events": events, "overwritten": overwritten}
