"""Gossip schedules: the event format's invariants, derived versions, statistics, save/load, and the paradigms."""

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster
R, G, X = C.READ, C.GRAD, C.MIX


def hand_made() -> C.GossipSchedule:
  # Replicas 0 and 1: both read; they average; 0 applies; 1 sends to 0 a value 1 version old; 1 applies.
  return C.GossipSchedule(
      num_workers=2,
      time=[0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 4.0],
      kind=[R, R, X, G, X, G, R],
      worker=[0, 1, -1, 0, -1, 1, 0],
      num_batches=[1, 2, 0, 1, 0, 2, 1],
      mix=[-1, -1, 0, -1, 1, -1, -1],
      members=[[0, 1], [0, 1]],
      weights=[[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.0, 0.0]]],
      lag=[[0, 0], [0, 1]],
      receives=[[True, True], [True, False]],
      mixes=[C.PARAMS, C.PARAMS],
      busy=[3.0, 4.0], wait=[1.0, 0.0], paradigm="hand")


def test_versions_staleness_and_batches_of_a_hand_made_schedule():
  s = hand_made()
  # Replica 0: mix (v1), grad (v2), mix (v3); replica 1: mix (v1), grad (v2).
  np.testing.assert_array_equal(s.mix_versions(), [[0, 0], [2, 1]])
  np.testing.assert_array_equal(s.read_version(), [0, 0, -1, 0, -1, 0, 3])
  np.testing.assert_array_equal(s.staleness(), [-1, -1, -1, 1, -1, 1, -1])
  np.testing.assert_array_equal(s.batch_index(), [0, 0, -1, 0, -1, 0, 1])
  np.testing.assert_array_equal(s.message_lags(), [0, 0, 1])
  np.testing.assert_array_equal(s.lag_histogram(), [2, 1])
  np.testing.assert_array_equal(s.staleness_histogram(), [0, 2])
  assert s.max_lag == 1 and s.num_gradients == 2 and s.num_mixes == 2
  assert s.events_per_second == pytest.approx(7 / 4)
  np.testing.assert_allclose(s.idle_fraction, [0.25, 0.0])
  assert "hand" in s.summary() and "7 events" in s.summary()


def test_save_load_round_trip(tmp_path):
  s = C.simulate_gossip(C.d_psgd(dj.topology.ring(5)), C.workers(5, compute="gamma"), 20, seed=3)
  s.save(tmp_path / "s.npz")
  assert C.GossipSchedule.load(tmp_path / "s.npz") == s
  assert hand_made() != s


def _fields(**changes):
  s = hand_made()
  f = {k: np.array(getattr(s, k)) for k in ("time", "kind", "worker", "num_batches", "mix", "members", "weights",
                                              "lag", "receives", "mixes")}
  f.update(changes)
  return f


@pytest.mark.parametrize("change, match", [
    (dict(time=[0.0, 0.0, 1.0, 0.5, 3.0, 4.0, 4.0]), "non-decreasing"),
    (dict(kind=[R, G, X, G, X, G, R]), "alternate"),
    (dict(worker=[0, 1, -1, 0, -1, 1, 5]), "worker"),
    (dict(num_batches=[1, 2, 0, 1, 0, 1, 1]), "num_batches"),
    (dict(mix=[-1, -1, 1, -1, 0, -1, -1]), "mix must number"),
    (dict(members=[[0, 0], [0, 1]]), "distinct"),
    (dict(members=[[-1, 1], [0, 1]]), "at least one member"),
    (dict(lag=[[0, 1], [0, 1]]), "version 0"),
    (dict(weights=[[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.0, 1.0]]]), "does not receive"),
    (dict(mixes=[C.PARAMS, C.GRADS], lag=[[0, 0], [0, 0]]), "pending gradient"),
    (dict(mixes=[C.PARAMS, C.GRADS]), "lag must be 0"),
])
def test_invalid_schedules_are_rejected(change, match):
  with pytest.raises(ValueError, match=match):
    C.GossipSchedule(num_workers=2, **_fields(**change))


def test_d_psgd_rounds_take_the_bsp_round_times():
  # Same workers and seed: every round ends when the slowest replica is done, as a BSP update.
  w = C.workers(6, compute="lognormal", comm=C.exponential(0.1), speed=[1, 1, 1, 1, 1, 0.25],
                stragglers=C.straggler_window(3.0, 6.0, 4.0, workers=2))
  s = C.simulate_gossip(C.d_psgd(dj.topology.ring(6)), w, 30, seed=7)
  bsp = C.simulate(C.bsp(), w, 30, seed=7)
  mix_times = s.time[s.kind == X]
  np.testing.assert_allclose(mix_times, bsp.time, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s.wait, bsp.wait, rtol=0, atol=1e-9)
  np.testing.assert_array_equal(s.staleness()[s.kind == G], 1)
  # Each round's mix is the Metropolis-Hastings matrix of the ring.
  np.testing.assert_allclose(s.weights[0], dj.topology.mixing_matrix(dj.topology.ring(6)))
  assert C.simulate_gossip(C.d_psgd(dj.topology.ring(6)), w, 30, seed=7) == s


def test_allreduce_mixes_pending_gradients_uniformly():
  s = C.simulate_gossip(C.allreduce(), C.workers(4), 5, seed=0)
  assert np.all(s.mixes == C.GRADS)
  np.testing.assert_allclose(s.weights, 0.25)
  np.testing.assert_array_equal(s.staleness()[s.kind == G], 0)


def test_bad_arguments_name_the_argument():
  w = C.workers(4)
  with pytest.raises(ValueError, match="topology has 5 nodes"):
    C.simulate_gossip(C.d_psgd(dj.topology.ring(5)), w, 3)
  with pytest.raises(TypeError, match="paradigm"):
    C.simulate_gossip(C.bsp(), w, 3)
  with pytest.raises(ValueError, match="num_steps"):
    C.simulate_gossip(C.allreduce(), w, 0)
  with pytest.raises(TypeError, match="topology"):
    C.d_psgd(np.ones((4, 4)))
