"""CROSSBOW's SMA (``dj.gossip.sma``) against NumPy re-implementations of its rule."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GRAD, MIX, PARAMS, READ
from delayjax.runtime._sampling import minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from method_reference import _schedule, flat, grad, random_schedule, regression  # noqa: E402

LR, BETA, BATCH = 0.05, 0.5, 4


def _stacked(tree) -> np.ndarray:
  return np.concatenate([np.asarray(tree["w"], np.float64), np.asarray(tree["b"], np.float64)[:, None]], axis=1)


def _run(schedule, alpha, momentum):
  data, loss_fn, params = regression()
  result = dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), dj.gossip.sma(alpha, momentum), params, data,
                              schedule, sampling=dj.Sampling(batch_size=BATCH))
  return result, data, params


def _paper_rounds(num, rounds, params, data, alpha, mu):
  """The paper's iterations, written as rounds: every learner j takes its gradient at w_j, then
  c_j = alpha (w_j - z), w_j <- w_j - lr m_j - c_j (m_j <- beta m_j + g_j), z <- z + sum_j c_j + mu (z - z_prev)."""
  n = np.asarray(data["x"]).shape[0]
  w = np.tile(flat(params), (num, 1))
  z, z_prev = flat(params), flat(params)
  m = np.zeros_like(w)
  for t in range(rounds):
    g = np.stack([grad(w[j], data, np.asarray(minibatch_indices(0, 0, j, t, num_examples=n, batch_size=BATCH)))
                  for j in range(num)])
    c = alpha * (w - z)
    m = BETA * m + g
    w = w - LR * m - c
    z, z_prev = z + c.sum(axis=0) + mu * (z - z_prev), z
  return w, z, z - z_prev


@pytest.mark.fast_compile
@pytest.mark.parametrize("num,alpha,mu", [(4, 0.1, 0.9), (4, 0.5, 0.0), (3, 0.25, 0.5), (1, 0.3, 0.9)])
def test_allreduce_rounds_are_the_papers_iterations(num, alpha, mu):
  rounds = 12
  paradigm = dj.cluster.d_psgd(dj.topology.complete(num)) if num > 1 else dj.cluster.allreduce()
  schedule = dj.cluster.simulate_gossip(paradigm, dj.cluster.workers(num, seed=1), num_steps=rounds, seed=2)
  if num == 1:  # one learner: its rounds READ, MIX with itself (weight 1), GRAD
    kind = np.tile(np.array([READ, MIX, GRAD], np.int8), rounds)
    schedule = _schedule(1, [{"time": float(e), "kind": k, "worker": 0, "num_batches": 1} if k != MIX else
                             {"time": float(e), "kind": MIX, "members": np.array([0]), "weights": np.ones((1, 1)),
                              "lag": np.zeros(1, np.int64), "receives": np.ones(1, bool), "mixes": PARAMS}
                             for e, k in enumerate(kind)], 1)
  assert (schedule.kind == MIX).sum() == rounds and (schedule.kind == GRAD).sum() == rounds * num
  result, data, params = _run(schedule, alpha, mu)
  w, z, v = _paper_rounds(num, rounds, params, data, alpha, mu)
  np.testing.assert_allclose(_stacked(result.params), w, rtol=2e-5, atol=2e-6)
  central = _stacked(result.extra.central)
  # Every replica's copy of z is the same model up to float rounding (each receiver adds the messages in its own
  # order, so the copies may differ in the last bits).
  np.testing.assert_allclose(central, np.broadcast_to(central[0], central.shape), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(central[0], z, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(_stacked(result.extra.velocity)[0], v, rtol=2e-5, atol=2e-6)
  # Each round's GRAD applied the correction its MIX left pending.
  assert np.abs(_stacked(result.extra.correction)).max() == 0.0


def _random_allreduce_schedule(num, num_events, seed):
  """Asynchronous reads and gradients of random replicas between all-reduces of every replica (weights 1/num):
  some replicas take several gradients between two mixes, others none (two mixes' corrections pending)."""
  rng = np.random.default_rng(seed)
  pending = np.zeros(num, bool)
  rows, t = [], 0.0
  for _ in range(num_events):
    t += float(rng.exponential(0.5))
    if rng.random() < 0.7:
      r = int(rng.integers(num))
      rows.append({"time": t, "kind": GRAD if pending[r] else READ, "worker": r, "num_batches": 1})
      pending[r] = not pending[r]
    else:
      rows.append({"time": t, "kind": MIX, "members": np.arange(num), "weights": np.full((num, num), 1.0 / num),
                   "lag": np.zeros(num, np.int64), "receives": np.ones(num, bool), "mixes": PARAMS})
  return _schedule(num, rows, num)


def _event_reference(schedule, params, data, alpha, mu):
  """The rule event by event: a mix sums c_j = alpha (w_j - z) over the learners, moves z with momentum and leaves
  each c_j pending; a gradient event steps w_j with momentum SGD and subtracts its pending corrections."""
  num, n = schedule.num_workers, np.asarray(data["x"]).shape[0]
  w = np.tile(flat(params), (num, 1))
  z, v = flat(params), np.zeros_like(flat(params))
  m, c, g = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
  draws = np.zeros(num, np.int64)
  for e in range(schedule.num_events):
    kind, j = schedule.kind[e], int(schedule.worker[e])
    if kind == READ:
      g[j] = grad(w[j], data, np.asarray(minibatch_indices(0, 0, j, int(draws[j]), num_examples=n,
                                                           batch_size=BATCH)))
      draws[j] += 1
    elif kind == GRAD:
      m[j] = BETA * m[j] + g[j]
      w[j] = w[j] - LR * m[j] - c[j]
      c[j] = 0.0
    else:
      now = alpha * (w - z)
      v = now.sum(axis=0) + mu * v
      z = z + v
      c = c + now
  return w, z, c


@pytest.mark.fast_compile
@pytest.mark.parametrize("num,alpha,mu,seed", [(4, 0.2, 0.9, 0), (3, 0.6, 0.3, 1), (2, 0.0, 0.9, 2)])
def test_asynchronous_events_between_allreduces_match_numpy(num, alpha, mu, seed):
  schedule = _random_allreduce_schedule(num, 70, seed)
  result, data, params = _run(schedule, alpha, mu)
  w, z, c = _event_reference(schedule, params, data, alpha, mu)
  np.testing.assert_allclose(_stacked(result.params), w, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(_stacked(result.extra.central), np.broadcast_to(z, (num, z.size)), rtol=2e-5,
                             atol=2e-6)
  np.testing.assert_allclose(_stacked(result.extra.correction), c, rtol=2e-5, atol=2e-6)
  if alpha == 0.0:
    # No correction: z stays the initial model exactly, and the learners train on their own.
    np.testing.assert_array_equal(_stacked(result.extra.central), np.broadcast_to(flat(params), (num, z.size)))
  else:
    assert np.abs(c).max() > 0  # some correction was pending at the end: the case is exercised


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="alpha must be >= 0"):
    dj.gossip.sma(-0.1)
  with pytest.raises(ValueError, match="momentum must be < 1"):
    dj.gossip.sma(0.1, 1.0)
  with pytest.raises(TypeError, match="alpha must be a real number"):
    dj.gossip.sma("0.1")


def test_late_messages_are_refused():
  data, loss_fn, params = regression()
  schedule = random_schedule(4, 30, seed=1, group=2, lag=2)
  assert schedule.lag.max() > 0
  with pytest.raises(ValueError, match=r"'sma' is not defined for late messages"):
    dj.simulate_gossip(loss_fn, optax.sgd(LR), dj.gossip.sma(), params, data, schedule,
                       sampling=dj.Sampling(batch_size=BATCH))


def test_state_is_a_pytree_like_params():
  state = dj.gossip.sma().init({"w": np.ones(3, np.float32)})
  assert isinstance(state, dj.gossip.SMAState)
  assert [x.shape for x in jax.tree.leaves(state)] == [(3,)] * 3


@pytest.mark.fast_compile
def test_resume_is_bit_identical_and_another_alpha_is_another_run(tmp_path):
  data, loss_fn, params = regression()
  schedule = _random_allreduce_schedule(4, 50, 3)

  def run(alpha=0.2, **kw):
    return dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), dj.gossip.sma(alpha, 0.9), params, data,
                              schedule, sampling=dj.Sampling(batch_size=BATCH), execution=dj.Execution(chunk_size=3),
                              **kw)

  full = run()

  def stop_after_two(info):
    if info["chunk"] == 1:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run(checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=stop_after_two))
  with pytest.raises(ValueError, match="different run"):
    run(alpha=0.3, checkpoint=dj.Checkpoint(tmp_path))
  resumed = run(checkpoint=dj.Checkpoint(tmp_path))
  for a, b in zip(jax.tree.leaves((full.params, full.opt_state, full.extra)),
                  jax.tree.leaves((resumed.params, resumed.opt_state, resumed.extra))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
