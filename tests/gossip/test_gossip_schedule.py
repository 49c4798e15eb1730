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


PARADIGMS = [C.allreduce(), C.d_psgd(dj.topology.torus(2, 3)), C.ad_psgd(), C.ad_psgd(dj.topology.ring(6)),
             C.sgp(0), C.sgp(2), C.gossipgrad(), C.gossipgrad(seed=3)]


@pytest.mark.parametrize("paradigm", PARADIGMS, ids=str)
def test_every_paradigm_is_seeded_saved_and_loaded(paradigm, tmp_path):
  w = C.workers(6, compute="gamma", comm=C.uniform(0.0, 0.5), speed=[1, 1, 1, 1, 1, 0.5])
  s = C.simulate_gossip(paradigm, w, 15, seed=4)
  assert s == C.simulate_gossip(paradigm, w, 15, seed=4)
  assert s != C.simulate_gossip(paradigm, w, 15, seed=5)
  s.save(tmp_path / "s.npz")
  assert C.GossipSchedule.load(tmp_path / "s.npz") == s
  assert s.num_gradients == 15 * 6
  np.testing.assert_allclose(s.busy + s.wait, s.total_time)


@pytest.mark.parametrize("num", [8, 14])
@pytest.mark.parametrize("average, offset", [("read", 0.25), ("completion", 0.0)])
def test_ad_psgd_times_and_bipartite_peers_with_constant_durations(num, average, offset):
  # Compute 1 s, comm 0.25 s: worker m reads at j, averages at j + 0.25 (odd m, with its j-th even peer; at
  # j + 1, just before the apply, under "completion"), applies at j + 1.
  s = C.simulate_gossip(C.ad_psgd(average=average), C.workers(num, compute="constant", comm=0.25), 40, seed=0)
  peers = dj.topology.bipartite_peers(num, 40)
  for m in range(num):
    np.testing.assert_allclose(s.time[(s.kind == R) & (s.worker == m)][:40], np.arange(40))
    np.testing.assert_allclose(s.time[(s.kind == G) & (s.worker == m)], np.arange(1, 41)[:len(
        s.time[(s.kind == G) & (s.worker == m)])])
  assert np.all(s.members[:, 0] % 2 == 1) and np.all(s.members[:, 1] % 2 == 0)
  np.testing.assert_allclose(s.time[s.kind == X] % 1.0, offset)
  for m in range(1, num, 2):
    mine = s.members[:, 0] == m
    np.testing.assert_array_equal(s.members[mine, 1], peers[:mine.sum(), m])
  np.testing.assert_allclose(s.weights, 0.5)


@pytest.mark.parametrize("failures", [None, C.failures(drop=0.2)], ids=["reliable", "drops"])
def test_ad_psgd_averages_just_before_the_apply_at_completion(failures):
  # Every averaging is the event right before its initiator's GRAD, on the same second; under "read" it is comm
  # seconds after the read instead. The reads and applies are the same for both points.
  w = C.workers(6, compute="gamma", comm=0.3, speed=[1, 1, 1, 1, 1, 0.5])
  at = {a: C.simulate_gossip(C.ad_psgd(dj.topology.ring(6), average=a), w, 30, seed=2, failures=failures)
        for a in ("completion", "read")}
  s = at["completion"]
  e = np.flatnonzero(s.kind == X)
  assert np.all(s.kind[e + 1] == G)
  np.testing.assert_array_equal(s.worker[e + 1], s.members[s.mix[e], 0])
  np.testing.assert_array_equal(s.time[e + 1], s.time[e])
  if failures is None:   # on a ring every worker initiates: one averaging per applied gradient
    assert s.num_mixes == s.num_gradients
  r = at["read"]
  reads = {m: r.time[(r.kind == R) & (r.worker == m)] for m in range(6)}
  for k, t in zip(r.mix[r.kind == X], r.time[r.kind == X]):
    initiator = r.members[k, 0]
    assert np.any(np.isclose(reads[initiator] + 0.3, t, rtol=0, atol=1e-12))
  np.testing.assert_array_equal(s.time[s.kind != X], r.time[r.kind != X])
  np.testing.assert_array_equal(s.worker[s.kind != X], r.worker[r.kind != X])


def test_ad_psgd_waits_for_a_slow_averaging():
  # Comm 2 s > compute 1 s: an active worker applies when its averaging is done, and was blocked 1 s.
  s = C.simulate_gossip(C.ad_psgd(), C.workers(2, compute="constant", comm=2.0), 3, seed=0)
  np.testing.assert_allclose(s.time[(s.kind == G) & (s.worker == 1)], [2.0, 4.0, 6.0][:int(np.sum(
      (s.kind == G) & (s.worker == 1)))])
  np.testing.assert_allclose(s.time[(s.kind == G) & (s.worker == 0)][:2], [1.0, 2.0])


def test_sgp_overlap_bounds_how_late_a_message_is():
  # Replica m's receive of a message from its k-th in-peer happens before its READ of iteration k + overlap + 1:
  # every node receives exactly one message per iteration, so by its (k + overlap + 1)-th READ it has added at
  # least k + 1 messages.
  for overlap in (0, 2):
    w = C.workers(8, compute="exponential", comm=C.exponential(2.0), speed=[1] * 7 + [0.25])
    s = C.simulate_gossip(C.sgp(overlap), w, 40, seed=1)
    receives = (s.kind == X) & np.isin(s.mix, np.flatnonzero(s.members[:, 1] >= 0))
    for m in range(8):
      recv_m = receives.copy()
      recv_m[receives] = s.members[s.mix[receives], 0] == m
      reads = np.flatnonzero((s.kind == R) & (s.worker == m))
      for k, e in enumerate(reads):
        assert np.sum(recv_m[:e]) >= k - overlap, (overlap, m, k)
    np.testing.assert_allclose(s.weights[s.members[:, 1] < 0, 0, 0], 0.5)


def test_gossipgrad_mixes_gradients_with_the_rotating_partner():
  num, steps = 8, 7
  s = C.simulate_gossip(C.gossipgrad(), C.workers(num), steps, seed=0)
  partners = dj.topology.gossipgrad_partners(num, steps)
  assert np.all(s.mixes == C.GRADS)
  for t in range(steps):
    expected = 0.5 * np.eye(num)
    expected[partners[t], np.arange(num)] += 0.5    # r receives from the node that sends to it
    np.testing.assert_allclose(s.weights[t], expected)


def test_link_failures_drop_messages_at_the_given_rate():
  num = 8
  w = C.workers(num, compute="exponential", comm=0.1)
  s = C.simulate_gossip(C.ad_psgd(dj.topology.ring(num)), w, 300, seed=0, failures=C.failures(drop=0.2))
  # Each direction is lost independently; an averaging whose two messages are both lost leaves no mix, so
  # the attempts are num_mixes / (1 - 0.2^2) and 80% of their 2 messages arrive.
  attempts = s.num_mixes / (1 - 0.2 ** 2)
  assert abs(s.receives.sum() / (2 * attempts) - 0.8) < 0.03
  assert np.sum(s.receives.sum(axis=1) == 1) > 0
  rows = s.weights.sum(axis=2)
  np.testing.assert_allclose(rows[s.receives], 1.0)   # a receiver's row is still stochastic
  d = C.simulate_gossip(C.d_psgd(dj.topology.ring(num)), w, 50, seed=0, failures=C.failures(drop=0.3))
  np.testing.assert_allclose(d.weights.sum(axis=2), 1.0)
  assert not np.allclose(d.weights.sum(axis=1), 1.0)   # no longer doubly stochastic


def test_a_node_down_is_left_out_during_its_window():
  num = 6
  w = C.workers(num, compute="exponential", comm=0.1)
  f = C.failures(down=[C.node_down(2, 5.0, 15.0)])
  for paradigm in (C.ad_psgd(dj.topology.ring(num)), C.d_psgd(dj.topology.ring(num))):
    s = C.simulate_gossip(paradigm, w, 40, seed=2, failures=f)
    inside = (s.time >= 5.0) & (s.time < 15.0)
    assert not np.any(inside & (s.kind == R) & (s.worker == 2))
    mixes_inside = s.mix[inside & (s.kind == X)]
    # D-PSGD: a node down at a round's start sits it out (the round under way at 5.0 still counts it).
    allowed = 1 if str(paradigm).startswith("d_psgd") else 0
    assert np.sum(np.any(s.members[mixes_inside] == 2, axis=1)) <= allowed
    assert np.any(s.members[s.mix[(s.time >= 15.0) & (s.kind == X)]] == 2)


def test_failure_arguments_are_checked():
  w = C.workers(4)
  with pytest.raises(ValueError, match="drop"):
    C.failures(drop=1.5)
  with pytest.raises(ValueError, match="stop must be >= start"):
    C.node_down(0, 3.0, 1.0)
  with pytest.raises(ValueError, match="supported by d_psgd and ad_psgd"):
    C.simulate_gossip(C.sgp(), w, 3, failures=C.failures(drop=0.1))
  with pytest.raises(ValueError, match="node_down node"):
    C.simulate_gossip(C.ad_psgd(), w, 3, failures=C.failures(down=C.node_down(9, 0.0, 1.0)))
  with pytest.raises(ValueError, match="even number"):
    C.simulate_gossip(C.ad_psgd(), C.workers(5), 3)
  with pytest.raises(ValueError, match="overlap"):
    C.sgp(-1)
  with pytest.raises(ValueError, match="undirected"):
    C.ad_psgd(dj.topology.exponential(8, directed=True))
  with pytest.raises(ValueError, match="average must be one of 'completion', 'read'; got 'apply'"):
    C.ad_psgd(average="apply")
  with pytest.raises(ValueError, match="receive must be one of 'iteration', 'arrived'; got 'all'"):
    C.sgp(receive="all")


@pytest.mark.parametrize("forward_only", [False, True])
def test_sgp_sends_each_iteration_to_the_one_peer_exponential_peer(forward_only):
  num = 8
  s = C.simulate_gossip(C.sgp(1, forward_only=forward_only), C.workers(num, comm=C.exponential(0.5)), 20, seed=2)
  peers = dj.topology.one_peer_exponential(num, 40, forward_only=forward_only)
  versions = s.mix_versions()
  halvings = np.flatnonzero(s.members[:, 1] < 0)
  receives = np.flatnonzero(s.members[:, 1] >= 0)
  # A receive names the sender's version right after the halving that sent the message.
  sent_by = {(s.members[k, 1], versions[k, 1] - s.lag[k, 1]): s.members[k, 0] for k in receives}
  checked = 0
  for m in range(num):
    for it, k in enumerate(halvings[s.members[halvings, 0] == m]):
      receiver = sent_by.get((m, versions[k, 0] + 1))
      if receiver is not None:
        assert receiver == peers[it, m]
        checked += 1
  assert checked > 0.8 * len(halvings)


def test_async_gradients_take_the_cluster_durations():
  # Gradient j of worker m computes for as long as gradient j of worker m under dj.cluster.simulate (same
  # workers, same seed), stragglers included.
  w = C.workers(4, compute="gamma", speed=[1, 1, 0.5, 1], stragglers=C.random_stragglers(0.2, 5.0))
  s = C.simulate_gossip(C.ad_psgd(), w, 30, seed=9)
  asp = C.simulate(C.asp(), w, 400, seed=9)
  x = asp.extras
  for m in range(4):
    mine = s.extras["busy_worker"] == m
    durations = (s.extras["busy_stop"] - s.extras["busy_start"])[mine]
    theirs = (x["event_end_time"] - x["event_read_time"])[x["event_worker"] == m]
    n = min(durations.size, theirs.size)
    assert n >= 15
    np.testing.assert_allclose(durations[:n], theirs[:n], rtol=1e-12)


def _sgp_receives(s):
  """For each receive of an SGP schedule, in order: (event, receiver, sender, the sender's iteration that sent it,
  the receiver's iteration about to start)."""
  versions = s.mix_versions()
  mix_events = np.flatnonzero(s.kind == X)
  halvings = np.flatnonzero(s.members[:, 1] < 0)
  sent_at = {}   # (sender, its version right after the halving) -> the sender's iteration
  for m in range(s.num_workers):
    for it, k in enumerate(halvings[s.members[halvings, 0] == m]):
      sent_at[(m, versions[k, 0] + 1)] = it
  out = []
  for k in np.flatnonzero(s.members[:, 1] >= 0):
    e, receiver, sender = mix_events[k], s.members[k, 0], s.members[k, 1]
    starting = int(np.sum((s.kind[:e] == R) & (s.worker[:e] == receiver)))
    out.append((e, receiver, sender, sent_at[(sender, versions[k, 1] - s.lag[k, 1])], starting))
  return out


@pytest.mark.parametrize("overlap", [0, 2])
def test_sgp_receive_iteration_adds_no_message_before_the_iteration_after_its_own(overlap):
  # One node 4x slower: its out-peers run ahead, and a message sent at their iteration k can arrive before the
  # receiver has finished its own iteration k. "iteration" (Assran et al.'s Algorithm 1, the reference code)
  # holds it until the receiver starts iteration k + 1; "arrived" adds it at once. Same start times for both.
  num = 8
  w = C.workers(num, compute="exponential", comm=C.exponential(0.5), speed=[1] * 7 + [0.25])
  paper = C.simulate_gossip(C.sgp(overlap), w, 30, seed=1)
  arrived = C.simulate_gossip(C.sgp(overlap, receive="arrived"), w, 30, seed=1)
  np.testing.assert_array_equal(paper.time[paper.kind != X], arrived.time[arrived.kind != X])
  np.testing.assert_array_equal(paper.worker[paper.kind != X], arrived.worker[arrived.kind != X])
  got = _sgp_receives(paper)
  # A message of iteration k is added before iteration k + 1 + d, 0 <= d <= overlap.
  assert all(k + 1 <= starting <= k + 1 + overlap for _, _, _, k, starting in got)
  early = [k >= starting for _, _, _, k, starting in _sgp_receives(arrived)]
  assert sum(early) > 0.1 * len(early)
  if overlap == 0:
    # Exactly the in-peer's iteration-k message, each time, as the reference's blocking receive.
    peers = dj.topology.one_peer_exponential(num, 40)
    for _, receiver, sender, k, starting in got:
      assert starting == k + 1 and peers[k, sender] == receiver
    for m in range(num):
      mine = [k for _, r, _, k, _ in got if r == m]
      assert mine == list(range(len(mine)))
