"""A slow, obviously-correct reference of Pisces' server (client selection and aggregation pace), for tests only.

Written from the rule of :class:`~delayjax.cluster.Pisces` (Jiang et al.,
SoCC 2022, as the authors' artifact implements it), independently of the fast
simulator: clients train on replayed durations (the ``j``-th training of
client ``m`` takes ``times[m, j % n]`` seconds); each step scans every client
for the next push, and compares it with the moment the pace falls due,
recomputing the interval from the running clients' latencies every time; the
score, the exploration and the staleness averages are recomputed from the
whole per-client history in float64. Random draws follow the documented
protocol on the given generator. It fills a ``cluster_reference.Result``.
"""

from __future__ import annotations

import numpy as np

from cluster_reference import Result


def pisces(times: np.ndarray, num_updates: int, rng: np.random.Generator, concurrency: int,
           utility: list[float] | None = None, beta: float = 0.5, bound: int | None = None,
           explore: float = 0.9, decay: float = 0.98, min_explore: float = 0.3, window: int = 5,
           selection: str = "pisces", every: int | None = None) -> Result:
  times = np.asarray(times, np.float64)
  num, period = times.shape
  utility = [1.0] * num if utility is None else [float(x) for x in utility]
  bound = concurrency if bound is None else bound
  result = Result(num)
  trained = [0] * num
  finish: list[float | None] = [None] * num   # None: not training
  read_time, read_version = [0.0] * num, [0] * num
  pushed_at = [0.0] * num
  latencies: list[list[float]] = [[] for _ in range(num)]
  staleness: list[list[int]] = [[] for _ in range(num)]
  buffer: list[int] = []
  idle_since = {m: 0.0 for m in range(num)}
  eps = explore
  state = {"version": 0, "last": 0.0}

  def pace_interval() -> float:
    measured = [x for lat in latencies for x in lat]
    running = [m for m in range(num) if finish[m] is not None]
    if not running:
      return 0.0
    return max(latencies[m][-1] if latencies[m] else max(measured) for m in running) / bound

  def choose(t: float) -> None:
    nonlocal eps
    running = sum(f is not None for f in finish)
    idle = [m for m in range(num) if finish[m] is None and m not in buffer]
    n = min(concurrency - running, len(idle))
    if n < 1:
      return
    if selection == "random":
      picked = list(rng.choice(np.array(idle), n, replace=False))
    else:
      fresh = [m for m in idle if not latencies[m]]
      known = [m for m in idle if latencies[m]]
      e = min(len(fresh), rng.binomial(n, eps))
      eps = max(eps * decay, min_explore)
      k_exploit = min(len(known), n - e)
      k_explore = min(len(fresh), n - k_exploit)
      order = [known[i] for i in rng.permutation(len(known))]
      def score(m: int) -> float:
        recent = staleness[m][-window:]
        mean = float(np.mean(np.array(recent, np.float64))) if recent else 0.0
        return utility[m] / (mean + 1.0) ** beta
      # Highest score first; among equal scores, the permutation's order (a stable sort).
      ranked = sorted(range(len(order)), key=lambda i: (-score(order[i]), i))
      picked = [order[i] for i in ranked[:k_exploit]]
      if k_explore:
        picked += list(rng.choice(np.array(fresh), k_explore, replace=False))
    for m in picked:
      m = int(m)
      result.wait[m] += t - idle_since.pop(m)
      read_time[m], read_version[m] = t, state["version"]
      finish[m] = t + times[m, trained[m] % period]
      trained[m] += 1

  def aggregate(t: float) -> None:
    u = state["version"]
    contributions = {}
    for m in buffer:
      contributions[m] = (read_version[m], 1)
      staleness[m].append(u - read_version[m])
      result.events.append((m, read_time[m], pushed_at[m], u, read_version[m]))
    result.updates.append((t, dict(sorted(contributions.items()))))
    buffer.clear()
    state["version"] = u + 1
    state["last"] = t

  def step(t: float, forced: bool) -> None:
    if buffer and (forced or (len(buffer) >= every if every is not None
                              else t - state["last"] >= pace_interval())):
      aggregate(t)
      if state["version"] == num_updates:
        return
    choose(t)

  step(0.0, False)
  while state["version"] < num_updates:
    candidates = [(finish[m], m) for m in range(num) if finish[m] is not None]
    next_push = min(candidates) if candidates else (np.inf, -1)
    if every is None and buffer and state["last"] + pace_interval() <= next_push[0]:
      step(state["last"] + pace_interval(), True)
      continue
    t, m = next_push
    finish[m] = None
    latencies[m].append(t - read_time[m])
    pushed_at[m] = t
    buffer.append(m)
    idle_since[m] = t
    step(t, False)
  t_end = result.updates[-1][0]
  for m in range(num):
    if finish[m] is not None:
      result.events.append((m, read_time[m], finish[m], -2, read_version[m]))
  for m in buffer:
    result.events.append((m, read_time[m], pushed_at[m], -2, read_version[m]))
  for m, t in idle_since.items():
    result.wait[m] += t_end - t
  return result
