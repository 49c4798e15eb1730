"""AET-SGD: its rule against a float64 NumPy loop written from the event-triggered rule, the closed forms at
threshold 0 (D-PSGD) and at a threshold never reached (replicas alone), and its bad inputs."""

from __future__ import annotations

import os
import sys

import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GRAD, READ
from delayjax.runtime import minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from method_reference import flat, grad, random_schedule, regression  # noqa: E402

LR, BETA, BATCH = 0.05, 0.5, 4


def aet_reference(schedule, params, data, *, threshold: float, growth: float, lr: float, beta: float,
                  batch_size: int, seed: int = 0):
  """Every replica's model, last broadcast model, steps and events after ``schedule`` (float64).

  A ``GRAD`` is SGD with momentum at the replica's model and counts a step. At a mix, each member decides first
  (all before anyone changes): it fires when ``||x - x_hat|| > threshold * (1 + growth * steps)``, and then its
  broadcast model is its current one; a receiver moves by ``sum_j W_ij (x_hat_j - x_hat_i)`` over the (new)
  broadcast models. Also returns the smallest relative gap between a distance and its threshold (so a test can
  check that no decision sits on the edge of float32 rounding)."""
  m = schedule.num_workers
  n = np.asarray(data["x"]).shape[0]
  x = np.tile(flat(params), (m, 1))
  hat, mom = x.copy(), np.zeros_like(x)
  steps, events = np.zeros(m, np.int64), np.zeros(m, np.int64)
  pending = [None] * m
  draws = np.zeros(m, np.int64)
  edge = np.inf
  for e in range(schedule.num_events):
    i = int(schedule.worker[e])
    if schedule.kind[e] == READ:
      nb = int(schedule.num_batches[e])
      pending[i] = np.mean([grad(x[i], data, np.asarray(minibatch_indices(seed, 0, i, int(draws[i]) + j,
                                                                          num_examples=n, batch_size=batch_size)))
                            for j in range(nb)], axis=0)
      draws[i] += nb
    elif schedule.kind[e] == GRAD:
      mom[i] = beta * mom[i] + pending[i]
      x[i] = x[i] - lr * mom[i]
      steps[i] += 1
    else:
      q = schedule.mix[e]
      group = schedule.members[q][schedule.members[q] >= 0]
      w = schedule.weights[q][:len(group), :len(group)]
      for r in group:
        limit = threshold * (1.0 + growth * steps[r])
        dist = float(np.linalg.norm(x[r] - hat[r]))
        if dist > 0 and limit > 0:
          edge = min(edge, abs(dist - limit) / limit)
        if dist > limit:
          hat[r] = x[r].copy()
          events[r] += 1
      sent = hat[group].copy()
      for a, r in enumerate(group):
        if schedule.receives[q][a]:
          x[r] = x[r] + w[a] @ (sent - sent[a])
  return {"x": x, "hat": hat, "steps": steps, "events": events, "edge": edge}


def _stacked(tree) -> np.ndarray:
  return np.concatenate([np.asarray(tree["w"], np.float64), np.asarray(tree["b"], np.float64)[:, None]], axis=1)


def _run(method, schedule):
  data, loss_fn, params = regression()
  return dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), method, params, data, schedule,
                            sampling=dj.Sampling(batch_size=BATCH))


def _ring(num: int, steps: int, seed: int):
  workers = dj.cluster.workers(num, compute="exponential", comm=0.2)
  return dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(num)), workers, num_steps=steps, seed=seed)


def _ad_psgd(num: int, steps: int, seed: int):
  workers = dj.cluster.workers(num, compute="exponential", comm=0.2, speed=[1.0, 2.0, 0.5, 1.0][:num])
  return dj.cluster.simulate_gossip(dj.cluster.ad_psgd(), workers, num_steps=steps, seed=seed)


SCHEDULES = {
    "ring-dpsgd": lambda: _ring(4, 12, 3),
    "ad-psgd": lambda: _ad_psgd(4, 12, 1),
    # Any row-stochastic mixes: random groups of 3 of 4 replicas, random weights, 2 minibatches at most.
    "random-groups": lambda: random_schedule(4, 80, seed=5, group=3, max_batches=2),
}
# (threshold, growth): some events fire and some do not, with and without the threshold's growth.
SETTINGS = [(0.05, 0.0), (0.05, 0.3)]


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_rule_matches_numpy_loop(name):
  schedule = SCHEDULES[name]()
  assert schedule.num_mixes > 0 and schedule.receives[schedule.members >= 0].all()
  data, _, params = regression()
  fired = []
  for threshold, growth in SETTINGS:
    result = _run(dj.gossip.aet_sgd(threshold, growth), schedule)
    ref = aet_reference(schedule, params, data, threshold=threshold, growth=growth, lr=LR, beta=BETA,
                        batch_size=BATCH)
    assert ref["edge"] > 1e-4, "a decision sits within float32 rounding of its threshold: change the setting"
    np.testing.assert_array_equal(np.asarray(result.extra.events), ref["events"])
    np.testing.assert_array_equal(np.asarray(result.extra.steps), ref["steps"])
    np.testing.assert_allclose(_stacked(result.params), ref["x"], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(_stacked(result.extra.broadcast), ref["hat"], rtol=2e-5, atol=2e-6)
    fired.append(ref["events"].sum())
  # Not trivially so: events fired, but not at every opportunity, and the growing threshold fires fewer.
  member_slots = int((schedule.members >= 0).sum())
  assert all(0 < f < member_slots for f in fired)
  assert fired[1] < fired[0]


@pytest.mark.fast_compile
def test_threshold_zero_is_dpsgd_and_an_unreached_threshold_trains_alone():
  schedule = _ring(4, 10, 0)
  dpsgd = _run(dj.gossip.d_psgd(), schedule)
  zero = _run(dj.gossip.aet_sgd(0.0, 0.0), schedule)
  np.testing.assert_array_equal(_stacked(zero.params), _stacked(dpsgd.params))
  # Every member of every round moved since its last broadcast (a gradient in between), so every slot fired,
  # except the first round's (nothing moved yet: rounds are READ, MIX, GRAD).
  per_replica = np.bincount(schedule.members[schedule.members >= 0], minlength=4)
  first = np.zeros(4, np.int64)
  first[schedule.members[0][schedule.members[0] >= 0]] = 1
  np.testing.assert_array_equal(np.asarray(zero.extra.events), per_replica - first)
  # Never reached: no event, the broadcast models stay the equal initial ones, every mix moves nobody, and each
  # replica's model is what training alone with tx gives (the loop below mixes nothing: all hats are equal).
  alone = _run(dj.gossip.aet_sgd(1e6, 0.0), schedule)
  assert not np.asarray(alone.extra.events).any()
  data, _, params = regression()
  ref = aet_reference(schedule, params, data, threshold=1e6, growth=0.0, lr=LR, beta=BETA, batch_size=BATCH)
  assert not ref["events"].any()
  np.testing.assert_allclose(_stacked(alone.params), ref["x"], rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(_stacked(alone.extra.broadcast), np.tile(flat(params), (4, 1)), rtol=0, atol=0)
  assert np.abs(_stacked(alone.params) - _stacked(dpsgd.params)).max() > 1e-3


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(threshold=-0.1), ValueError, "threshold"),
    (dict(threshold=float("nan")), ValueError, "threshold"),
    (dict(threshold="0.1"), TypeError, "threshold"),
    (dict(threshold=0.1, growth=-1.0), ValueError, "growth"),
    (dict(threshold=0.1, growth=None), TypeError, "growth"),
])
def test_bad_inputs_name_themselves(kwargs, error, match):
  with pytest.raises(error, match=match):
    dj.gossip.aet_sgd(**kwargs)


def test_late_messages_are_refused():
  schedule = random_schedule(4, 30, seed=1, group=2, lag=2)
  assert schedule.lag.max() > 0
  with pytest.raises(ValueError, match="'aet_sgd' is not defined for late messages"):
    _run(dj.gossip.aet_sgd(0.1), schedule)
