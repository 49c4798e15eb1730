"""A slow, obviously-correct reference simulator of PSP, probabilistic synchronous parallel (tests only).

Written from the rule as its authors state it: "at the barrier control point,
a worker samples beta out of P workers without replacement. If a single one
of these lags more than s steps behind the current worker then it waits"
(s = 0 is pBSP, s > 0 pSSP; beta = P is the unsampled barrier, SSP). Here the
barrier control point is a push: the pusher's clock (its pushes so far) goes
up by one, its gradient is applied at once as one update, and it draws its
sample. A worker that waits keeps its sample and starts again (reading the
version of that moment) as soon as no one in the sample lags more than ``s``
behind it. Every waiting worker is re-checked from scratch after every push.

It runs on the replayed durations and the explicit per-worker state of
``cluster_reference.Cluster`` (the smallest ``(finish time, worker)`` pushes
next), and draws each sample with a ``sample(num_workers, beta)`` callable the
test supplies, so that it needs nothing from the fast simulator but the
random stream its samples come from.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cluster_reference import Cluster, Result


def psp(times: np.ndarray, num_updates: int, beta: int, s: int,
        sample: Callable[[int, int], list[int]]) -> Result:
  c = Cluster(times)
  clock = [0] * c.num
  waits_on: dict[int, list[int]] = {}
  while True:
    t, m = c.next_push()
    c.event(m, t, c.version)
    c.apply(t, {m: (c.read_version[m], 1)})
    clock[m] += 1
    c.block(m, t)
    if c.version == num_updates:
      return c.finish_up()
    waits_on[m] = list(sample(c.num, beta))
    assert len(set(waits_on[m])) == beta and all(0 <= w < c.num for w in waits_on[m])
    for w in sorted(waits_on):
      if not any(clock[w] - clock[x] > s for x in waits_on[w]):
        del waits_on[w]
        c.read(w, t)
