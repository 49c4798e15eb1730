"""HPSGD (``dj.gossip.hpsgd``) against a NumPy re-implementation of the authors' per-iteration loop."""

from __future__ import annotations

import os
import sys

import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GRAD, MIX, PARAMS, READ
from delayjax.runtime._sampling import minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from method_reference import _schedule, flat, grad, regression  # noqa: E402

LR, BATCH = 0.05, 4


def _stacked(tree) -> np.ndarray:
  return np.concatenate([np.asarray(tree["w"], np.float64), np.asarray(tree["b"], np.float64)[:, None]], axis=1)


def _phases_schedule(num, phases):
  """Lockstep phases: in phase k every replica takes ``phases[k]`` gradients (READ, GRAD), then one all-reduce MIX
  of every replica (weights 1/num) merges (the phase's last gradient is the authors' merge iteration)."""
  rows, t = [], 0.0
  for length in phases:
    for _ in range(length):
      for kind in (READ, GRAD):
        for r in range(num):
          t += 0.1
          rows.append({"time": t, "kind": kind, "worker": r, "num_batches": 1})
    t += 0.1
    rows.append({"time": t, "kind": MIX, "members": np.arange(num), "weights": np.full((num, num), 1.0 / num),
                 "lag": np.zeros(num, np.int64), "receives": np.ones(num, bool), "mixes": PARAMS})
  return _schedule(num, rows, num)


def _authors_loop(num, phases, params, data):
  """The authors' HLSGD loop, per worker and iteration, with plain SGD (their optimizer: momentum 0): while the
  all-reduce is in flight, add the gradient to G_sum and step (the phase's first iteration snapshots the model);
  at the merge iteration commit G_sum + g, restore the snapshot and step it with the reduced previous commit
  over the world size (nothing to restore at the first merge: step with g), and all-reduce the new commit."""
  n = np.asarray(data["x"]).shape[0]
  param = np.tile(flat(params), (num, 1))
  backup = np.zeros_like(param)
  g_sum = np.zeros_like(param)
  latest = None  # the all-reduced sum of the commits, once the first merge has launched one
  init = True
  draws = 0
  for length in phases:
    for it in range(length):
      g = np.stack([grad(param[j], data, np.asarray(minibatch_indices(0, 0, j, draws, num_examples=n,
                                                                      batch_size=BATCH))) for j in range(num)])
      draws += 1
      if it < length - 1:  # local training while the all-reduce runs
        if init:
          backup = param.copy()
          init = False
        g_sum += g
        param = param - LR * g
        continue
      commit = g_sum + g
      step = g
      if latest is not None:
        param = backup.copy()
        step = np.broadcast_to(latest / num, param.shape)
        init = True
      latest = commit.sum(axis=0)
      g_sum = np.zeros_like(g_sum)
      param = param - LR * step
  return param


@pytest.mark.fast_compile
@pytest.mark.parametrize("num,phases", [(4, [2, 3, 2, 4, 2]), (3, [3, 2, 2, 2]), (1, [2, 4, 3])])
def test_lockstep_phases_are_the_authors_loop(num, phases):
  data, loss_fn, params = regression()
  schedule = _phases_schedule(num, phases)
  result = dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.hpsgd(), params, data, schedule,
                              sampling=dj.Sampling(batch_size=BATCH))
  ref = _authors_loop(num, phases, params, data)
  np.testing.assert_allclose(_stacked(result.params), ref, rtol=2e-5, atol=2e-6)
  assert int(np.asarray(result.extra.merged)[0]) == len(phases)
  # Past the first merge every replica restarts from the same global model (to float rounding).
  if len(phases) > 1 and num > 1:
    central = _stacked(result.extra.central)
    np.testing.assert_allclose(central, np.broadcast_to(central[0], central.shape), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_stacked(result.params), central, rtol=1e-6, atol=1e-7)


@pytest.mark.fast_compile
def test_a_replicas_own_change_waits_with_the_others():
  """Unlike LASGD and DC-S3GD without compensation, the second merge restarts every replica from the initial model
  plus the *average* of the first phase's changes: a replica's own change is not kept at once."""
  data, loss_fn, params = regression()
  schedule = _phases_schedule(2, [2, 2])
  result = dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.hpsgd(), params, data, schedule,
                              sampling=dj.Sampling(batch_size=BATCH))
  first = _authors_loop(2, [2], params, data)  # the models at the first merge: the first phase's changes
  expected = flat(params) + (first - flat(params)).mean(axis=0)
  np.testing.assert_allclose(_stacked(result.params), np.broadcast_to(expected, (2, expected.size)), rtol=2e-5,
                             atol=2e-6)


def test_late_messages_are_refused():
  from method_reference import random_schedule

  data, loss_fn, params = regression()
  schedule = random_schedule(4, 30, seed=1, group=2, lag=2)
  with pytest.raises(ValueError, match=r"'hpsgd' is not defined for late messages"):
    dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.hpsgd(), params, data, schedule,
                       sampling=dj.Sampling(batch_size=BATCH))
