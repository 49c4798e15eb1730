"""A slow, obviously-correct reference of GBA's parameter server with tokens (tests only).

Written from the rule of :class:`~delayjax.cluster.GBA` (Su et al., NeurIPS
2022), independently of the fast simulator and of the other references: each
worker holds a token (the version it read) while it computes on replayed
durations (gradient ``j`` of worker ``m`` takes ``times[m, j % n]`` seconds);
the next push is found by scanning all workers for the smallest ``(finish
time, worker)``; the server keeps a buffer of ``(worker, token)`` pairs in push
order and applies it as one update when it holds ``G`` gradients. A worker
whose gradient with another token is already in the buffer holds its push
(blocked) until that buffer is applied; held pushes then enter the next
buffer in the order they arrived. It fills a ``cluster_reference.Result``.
"""

from __future__ import annotations

import numpy as np

from cluster_reference import Result


def gba(times: np.ndarray, num_updates: int, global_batch: int) -> Result:
  times = np.asarray(times, np.float64)
  num, period = times.shape
  used = [0] * num
  result = Result(num)
  version = 0
  token = [0] * num                           # the version each worker's current gradient was read at
  read_time = [0.0] * num
  finish: list[float | None] = [None] * num   # None: blocked, holding a push or done
  blocked_since: dict[int, float] = {}
  buffer: list[tuple[int, int]] = []          # (worker, token) of the gradients pushed since the last update
  held: list[tuple[int, float]] = []          # (worker, push time) of held pushes, in arrival order

  def read(m: int, t: float) -> None:
    if m in blocked_since:
      result.wait[m] += t - blocked_since.pop(m)
    token[m], read_time[m] = version, t
    finish[m] = t + float(times[m, used[m] % period])
    used[m] += 1

  def push(m: int, t_push: float, t_now: float) -> None:
    """Worker ``m``'s gradient (pushed at ``t_push``) enters the buffer at ``t_now``; a full buffer is applied."""
    nonlocal version, buffer
    result.events.append((m, read_time[m], t_push, version, token[m]))
    buffer.append((m, token[m]))
    if len(buffer) == global_batch:
      contributions: dict[int, tuple[int, int]] = {}
      for w, v in buffer:
        contributions[w] = (v, contributions.get(w, (v, 0))[1] + 1)
      result.updates.append((t_now, contributions))
      version += 1
      buffer = []

  for m in range(num):
    read(m, 0.0)
  while version < num_updates:
    t, m = min((finish[w], w) for w in range(num) if finish[w] is not None)
    finish[m] = None
    if any(w == m and v != token[m] for w, v in buffer):
      held.append((m, t))
      blocked_since[m] = t
      continue
    before = version
    push(m, t, t)
    if version == num_updates:
      blocked_since[m] = t
      break
    read(m, t)
    if version > before:
      queue, held = held, []
      while queue and version < num_updates:
        w, t_push = queue.pop(0)
        push(w, t_push, t)
        if version == num_updates:
          break   # w stays blocked since its push was held
        read(w, t)
      held = queue
  t_end = result.updates[-1][0]
  for w in range(num):
    if finish[w] is not None:
      result.events.append((w, read_time[w], finish[w], -2, token[w]))
  for w, t_push in held:
    result.events.append((w, read_time[w], t_push, -2, token[w]))
  for w, since in blocked_since.items():
    result.wait[w] += t_end - since
  return result
