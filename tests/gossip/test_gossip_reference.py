"""The sequential reference executor against closed forms, and the paradigms' schedules executed by it."""

import numpy as np
import pytest

import delayjax as dj
import gossip_reference as ref

C = dj.cluster
T = dj.topology


def linear_problem(num, dim=3, seed=0):
  """Gradients A x - b_i: a shared Hessian, a different optimum per replica (heterogeneous data)."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(dim, dim))
  a = q @ q.T / dim + np.eye(dim)
  b = rng.normal(size=(num, dim))
  noise = rng.normal(size=(num, 1000, dim)) * 0.1
  return a, b, lambda z, i, j: a @ z - b[i] + noise[i, j]


def test_one_worker_is_plain_local_sgd_with_momentum():
  a, b, grad = linear_problem(1)
  s = C.simulate_gossip(C.allreduce(), C.workers(1, compute="exponential"), 30, seed=0)
  out = ref.run(s, grad, np.ones(3), lr=0.1, momentum=0.9)
  x, v = np.ones(3), np.zeros(3)
  for j in range(30):   # optax.sgd(0.1, momentum=0.9): v <- g + 0.9 v; x <- x - 0.1 v
    v = grad(x, 0, j) + 0.9 * v
    x = x - 0.1 * v
  np.testing.assert_allclose(out["x"][0], x, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("paradigm", [C.d_psgd(T.complete(5)), C.gossipgrad()])
def test_average_model_equals_allreduce_sgd_for_linear_gradients(paradigm):
  # With gradients A x - b_i, the average of D-PSGD on the complete graph (W = 11^T / M) and of GossipGraD
  # (each gradient averaged with one other: a permutation) moves exactly as all-reduce SGD.
  num = 5
  _, _, grad = linear_problem(num, seed=1)
  w = C.workers(num, compute="lognormal")
  x0 = np.array([1.0, -2.0, 0.5])
  got = ref.run(C.simulate_gossip(paradigm, w, 25, seed=2), grad, x0, lr=0.05)["x"].mean(axis=0)
  x = x0.copy()
  for j in range(25):
    x = x - 0.05 * np.mean([grad(x, i, j) for i in range(num)], axis=0)
  np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)
  allreduce = ref.run(C.simulate_gossip(C.allreduce(), w, 25, seed=2), grad, x0, lr=0.05)["x"]
  np.testing.assert_allclose(allreduce, np.broadcast_to(x, allreduce.shape), rtol=1e-12, atol=1e-12)


def test_d_psgd_mixing_is_the_matrix_power_and_keeps_the_average():
  num = 8
  x0 = np.random.default_rng(3).normal(size=(num, 2))
  s = C.simulate_gossip(C.d_psgd(T.ring(num)), C.workers(num), 12, seed=0)
  out = ref.run(s, lambda z, i, j: np.zeros(2), x0, lr=0.1)
  w = T.mixing_matrix(T.ring(num))
  np.testing.assert_allclose(out["x"], np.linalg.matrix_power(w, 12) @ x0, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(out["x"].mean(axis=0), x0.mean(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("topology", [None, T.ring(6)])
def test_ad_psgd_pairwise_averaging_keeps_the_average(topology):
  num = 6
  x0 = np.random.default_rng(4).normal(size=(num, 2))
  s = C.simulate_gossip(C.ad_psgd(topology), C.workers(num, compute="exponential", comm=0.3), 40, seed=1)
  out = ref.run(s, lambda z, i, j: np.zeros(2), x0, lr=0.1)
  np.testing.assert_allclose(out["x"].mean(axis=0), x0.mean(axis=0), rtol=1e-12, atol=1e-12)
  assert np.ptp(out["x"], axis=0).max() < 1e-2 * np.ptp(x0, axis=0).max()   # and reaches consensus


@pytest.mark.parametrize("receive", ["iteration", "arrived"])
@pytest.mark.parametrize("overlap", [0, 1, 3])
def test_sgp_conserves_push_sum_mass_with_late_messages(overlap, receive):
  # Constant per-replica gradients g_i: sum_i x_i plus the messages still in flight changes only by the applied
  # gradients. A lag pointing at the wrong version (before or after a GRAD, halving or receive) breaks it.
  num, dim = 6, 2
  rng = np.random.default_rng(overlap)
  g, x0 = rng.normal(size=(num, dim)), rng.normal(size=(num, dim))
  w = C.workers(num, compute="exponential", comm=C.exponential(1.5))
  s = C.simulate_gossip(C.sgp(overlap, receive=receive), w, 30, seed=5)
  assert s.max_lag > 0
  out = ref.run(s, lambda z, i, j: g[i], x0, lr=0.1, push_sum=True, record=True)
  received = set()
  versions = s.mix_versions()
  for k in np.flatnonzero(s.members[:, 1] >= 0):
    sender = s.members[k, 1]
    received.add((sender, versions[k, 1] - s.lag[k, 1]))   # the sender's version right after its halving
  in_flight_x = np.zeros(dim)
  halvings = np.flatnonzero(s.members[:, 1] < 0)
  mix_events = np.flatnonzero(s.kind == C.MIX)
  for k in halvings:
    sender = s.members[k, 0]
    if (sender, versions[k, 0] + 1) not in received:
      in_flight_x += out["models"][mix_events[k], sender]
  applied = np.bincount(s.worker[s.kind == C.GRAD], minlength=num)
  expected = x0.sum(axis=0) - 0.1 * (applied[:, None] * g).sum(axis=0)
  np.testing.assert_allclose(out["x"].sum(axis=0) + in_flight_x, expected, rtol=1e-10, atol=1e-10)


def _schedule_events(s):
  """``(time, kind, worker)`` of every event; a mix is named by its first member (AD-PSGD's initiator)."""
  names = {C.READ: "read", C.GRAD: "grad", C.MIX: "mix"}
  who = np.where(s.kind == C.MIX, s.members[np.maximum(s.mix, 0), 0], s.worker)
  return [(float(t), names[int(k)], int(m)) for t, k, m in zip(s.time, s.kind, who)]


@pytest.mark.parametrize("topology", [None, T.ring(6)], ids=["bipartite", "ring"])
@pytest.mark.parametrize("average", ["completion", "read"])
def test_ad_psgd_is_algorithm_1_event_by_event(average, topology):
  # Constant durations whose events never share a second across workers (worker 1 computes faster than an
  # averaging's message, so it waits for it): the schedule executed step by step is an independent simulation of
  # Lian et al.'s Algorithm 1 averaging at that point, event for event and in its models.
  import ad_psgd_reference as adref
  num, steps, comm = 6, 15, 0.9
  speeds = np.array([1.0, 1.21, 0.83, 0.67, 1.13, 0.91])
  _, _, grad = linear_problem(num, seed=6)
  x0 = np.random.default_rng(7).normal(size=(num, 3))
  w = C.workers(num, compute="constant", comm=comm, speed=speeds)
  s = C.simulate_gossip(C.ad_psgd(topology, average=average), w, steps, seed=0)
  if topology is None:
    peers = T.bipartite_peers(num, 3 * steps)
  else:   # a ring's peers are random draws: take the schedule's, in each initiator's order
    peers = np.full((3 * steps, num), -1)
    for m in range(num):
      mine = s.members[s.members[:, 0] == m, 1]
      peers[:mine.size, m] = mine
  want = adref.run(1.0 / speeds, comm, peers, steps * num, grad, x0, lr=0.1, average=average)
  got_events = _schedule_events(s)
  assert [e[1:] for e in got_events] == [e[1:] for e in want["events"]]
  np.testing.assert_allclose([e[0] for e in got_events], [e[0] for e in want["events"]], rtol=1e-12)
  got = ref.run(s, grad, x0, lr=0.1)
  np.testing.assert_allclose(got["x"], want["x"], rtol=1e-12, atol=1e-12)
  # The two points are different algorithms on the same timeline, not two spellings of one.
  other = adref.run(1.0 / speeds, comm, peers, steps * num, grad, x0, lr=0.1,
                    average="read" if average == "completion" else "completion")
  assert np.max(np.abs(other["x"] - want["x"])) > 1e-3
