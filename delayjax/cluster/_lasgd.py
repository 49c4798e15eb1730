"""The LASGD gossip paradigm: local steps that never wait, back-to-back all-reduces of the models behind them."""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np

from delayjax.cluster._gossip import GossipParadigm, _Builder, _Durations
from delayjax.cluster._workers import Workers

# At equal times a gradient is applied before an all-reduce completes, and a replica reads after both: in lockstep
# (every gradient as long as the all-reduce) a round is READ, GRAD, MIX and the next gradient is taken at the
# merged model.
_GRAD, _MERGE, _READ = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class LASGD(GossipParadigm):
  """LASGD's schedule: every replica trains without waiting while all-reduces of the models run back to back.

  Rule (the library's construction from the abstract of Avidor and Tal
  Israel 2022; see ``dj.gossip.lasgd`` for what is confirmed):

  - **Local steps.** Replica ``m`` reads, computes its gradient for the
    ``compute`` seconds of its worker (speed, stragglers and straggler
    windows applied, the same per-worker stream as every other paradigm),
    applies it (``GRAD``, at the moment the gradient is done: a local step
    sends nothing) and reads again at once. Nobody ever waits.
  - **All-reduces.** All-reduce ``r`` starts at ``s_r`` (``s_0 = 0``) with
    every replica's model as it is then (the method keeps it: for
    ``dj.gossip.lasgd``, the model right after the previous merge). It lasts
    ``max_m c_{m,r}``, where ``c_{m,r}`` is worker ``m``'s ``r``-th draw of its
    ``comm`` model from a stream of its own (the all-reduce finishes when its
    slowest member's messages have arrived). When it completes, one ``PARAMS``
    mix of all ``M`` replicas with weights ``1/M`` and lag 0 (the messages
    are the snapshots the method keeps, not the current models), and the
    next all-reduce starts at once: ``s_{r+1} = s_r + max_m c_{m,r}``.

  At equal times a ``GRAD`` comes before the ``MIX``, and a ``READ`` after
  both. The run ends with the ``num_steps * M``-th gradient; an all-reduce
  still in flight then is not recorded. ``extras`` hold, beside the
  simulator's usual records, ``allreduce_start`` (float64 ``[K]``, ``s_r``)
  and ``local_steps`` (int64 ``[K, M]``: the gradients each replica applied
  while all-reduce ``r`` ran, how far its merged progress goes beyond its
  snapshot). ``wait`` is 0 up to the last gradient: nobody waits.

  References:
    Avidor, Tal Israel, `Locally Asynchronous Stochastic Gradient Descent for
    Decentralised Deep Learning <https://arxiv.org/abs/2203.13085>`_, arXiv 2203.13085, 2022.
  """

  _name = "lasgd"

  def events(self, workers: Workers, times: _Durations, total: int, seed_sequence: Any) -> _Builder:
    """LASGD's event loop for ``dj.cluster.simulate_gossip``: the all-reduces take the workers' ``comm`` draws
    from the stream of ``seed_sequence``, the gradients the shared compute times."""
    if workers.comm is None:
      raise ValueError("workers has no comm model, but lasgd's all-reduces last the workers' comm times; pass "
                       "dj.cluster.workers(..., comm=...) with positive times.")
    return _lasgd_engine(workers, times, _Durations(workers, seed_sequence), total)


def lasgd() -> LASGD:
  """LASGD's schedule (see :class:`LASGD`), simulated by ``dj.cluster.simulate_gossip``.

  Gradient ``j`` of replica ``m`` takes the compute time ``dj.cluster.simulate``
  gives gradient ``j`` of worker ``m`` (same ``workers``, same ``seed``); the
  all-reduces take the workers' ``comm`` times from a second stream of the
  seed, so ``workers`` needs a ``comm`` model with positive times (a
  ``ValueError`` otherwise). Run the schedule with ``dj.simulate_gossip(...,
  dj.gossip.lasgd(), ...)``.

  Example::

    >>> import delayjax as dj
    >>> w = dj.cluster.workers(4, compute="exponential", comm=0.5, speed=[1, 1, 1, 0.25])
    >>> s = dj.cluster.simulate_gossip(dj.cluster.lasgd(), w, num_steps=10, seed=0)
    >>> s.num_gradients, float(s.wait.sum())
    (40, 0.0)
  """
  return LASGD()


def _lasgd_engine(workers: Workers, times: _Durations, comm_times: _Durations, total: int) -> _Builder:
  """Local steps of every replica and back-to-back all-reduces, as an event loop over (time, order) keys."""
  num = workers.num_workers
  b = _Builder(num)
  heap: list[tuple[float, int, int, int]] = []
  seq = 0
  steps = np.zeros(num, np.int64)
  local_steps: list[np.ndarray] = []
  starts: list[float] = []
  members = np.arange(num)
  weights = np.full((num, num), 1.0 / num)

  def push(t: float, what: int, m: int) -> None:
    nonlocal seq
    heapq.heappush(heap, (t, what, seq, m))
    seq += 1

  def read(m: int, t: float) -> None:
    b.read(m, t)
    compute, _ = times.take_split(m, t)
    b.computing(m, t, t + compute)
    push(t + compute, _GRAD, m)

  def start_allreduce(t: float) -> None:
    duration = max(comm_times.take_split(m, t)[1] for m in range(num))
    if not t + duration > t:
      raise ValueError(f"all-reduce {len(starts)} of lasgd, started at {t:.6g} s, took no time (its members' comm "
                       f"draws were at most {duration:.6g} s): back-to-back all-reduces would never let a gradient "
                       "through; give the workers a comm model with positive times.")
    starts.append(t)
    push(t + duration, _MERGE, -1)

  for m in range(num):
    read(m, 0.0)
  start_allreduce(0.0)
  applied = 0
  while applied < total:
    t, what, _, m = heapq.heappop(heap)
    if what == _GRAD:
      b.grad(m, t, t)
      steps[m] += 1
      applied += 1
      if applied < total:
        push(t, _READ, m)
    elif what == _READ:
      read(m, t)
    else:
      b.mix(t, members, weights)
      local_steps.append(steps.copy())
      steps[:] = 0
      start_allreduce(t)
  count = len(local_steps)
  b.extras["allreduce_start"] = np.asarray(starts[:count], np.float64)
  b.extras["local_steps"] = np.asarray(local_steps, np.int64).reshape(count, num)
  return b
