"""GBA's server (Su et al., NeurIPS 2022): its global batch of stale gradients, each decayed past the threshold.

The decay is the documented composition ``dj.per_contribution(dj.scale_by_staleness("hinge", a=1, b=iota))``
ahead of the server optimizer; through ``dj.simulate`` on a ``dj.cluster.gba`` schedule it must equal a float64
NumPy server that weighs each gradient by ``1`` up to ``iota`` and ``1 / (1 + tau - iota)`` beyond, then averages
the global batch.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import numpy_per_contribution, regression_problem

IOTA = 2


def _schedule() -> dj.cluster.Schedule:
  # One worker 5x slower: its gradients arrive several updates stale, past the threshold.
  workers = dj.cluster.workers(4, compute="exponential", speed=[1.0, 1.0, 1.0, 0.2])
  return dj.cluster.simulate(dj.cluster.gba(4), workers, num_updates=40, seed=1)


def _taus_in_runtime_order(schedule: dj.cluster.Schedule) -> list[int]:
  """Each contribution's staleness, in the order the server loop visits them (stalest read first, then worker)."""
  taus = []
  for u in range(schedule.num_updates):
    workers = np.flatnonzero(schedule.contributes[u])
    reads = schedule.read_version[u, workers]
    taus += [u - int(reads[j]) for j in np.lexsort((workers, reads))]
  return taus


def _numpy_gba(data, schedule, *, decay: bool, lr: float, batch_size: int, seed: int) -> np.ndarray:
  taus = iter(_taus_in_runtime_order(schedule))

  def push(m, g, w, w_read):
    tau = next(taus)
    return (1.0 if tau <= IOTA or not decay else 1.0 / (1.0 + tau - IOTA)) * g

  return numpy_per_contribution(data, schedule, push, lr=lr, batch_size=batch_size, seed=seed)


@pytest.mark.fast_compile
def test_decayed_global_batch_against_numpy():
  data, loss_fn, params = regression_problem()
  schedule = _schedule()
  assert schedule.staleness.max() > IOTA + 1          # some gradients are decayed, by more than one step
  assert schedule.num_batches.max() > 1               # a fast worker's gradients at one token are one contribution
  tx = optax.chain(dj.per_contribution(dj.scale_by_staleness("hinge", a=1.0, b=float(IOTA))), optax.sgd(0.05))
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=4)
  got = np.concatenate([np.asarray(result.params["w"]), np.asarray(result.params["b"])[None]])
  expected = _numpy_gba(data, schedule, decay=True, lr=0.05, batch_size=8, seed=4)
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)
  # The decay matters here: the undecayed mean of the same gradients ends elsewhere.
  plain = _numpy_gba(data, schedule, decay=False, lr=0.05, batch_size=8, seed=4)
  assert np.abs(plain - expected).max() > 1e-3


@pytest.mark.fast_compile
def test_fresh_gradients_are_not_decayed():
  # Below the threshold the decay is the identity: the update is the plain mean of the global batch.
  data, loss_fn, params = regression_problem()
  workers = dj.cluster.workers(4, compute=dj.cluster.replay(np.full((4, 2), 1.0)))
  schedule = dj.cluster.simulate(dj.cluster.gba(4), workers, num_updates=12)
  assert schedule.staleness.max() <= IOTA
  decayed = optax.chain(dj.per_contribution(dj.scale_by_staleness("hinge", a=1.0, b=float(IOTA))), optax.sgd(0.05))
  a = dj.simulate(loss_fn, decayed, params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=0)
  b = dj.simulate(loss_fn, optax.sgd(0.05), params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=0)
  np.testing.assert_allclose(np.asarray(a.params["w"]), np.asarray(b.params["w"]), rtol=1e-6, atol=1e-7)


def test_negative_threshold_is_refused():
  with pytest.raises(ValueError, match=r"b must be >= 0.0, got -1.0"):
    dj.scale_by_staleness("hinge", a=1.0, b=-1.0)
