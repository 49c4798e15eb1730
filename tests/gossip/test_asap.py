"""ASAP's stochastic reduce with NOTIFY-ACK (``dj.cluster.asap``) against an independent NumPy event simulation."""

from __future__ import annotations

import os
import sys

import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
import asap_reference  # noqa: E402
import gossip_reference  # noqa: E402
from method_reference import flat, grad, regression  # noqa: E402

C = dj.cluster
T = dj.topology


def _linear(num, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(dim, dim))
  a = q @ q.T / dim + np.eye(dim)
  b = rng.normal(size=(num, dim))
  noise = rng.normal(size=(num, 400, dim)) * 0.1
  return lambda z, i, j: a @ z - b[i] + noise[i, j]


def _schedule_events(s):
  """The schedule's events in the reference's form (a mix: receiver, senders, weights, senders' sent versions)."""
  versions = s.mix_versions()
  out = []
  for e in range(s.num_events):
    t, kind = float(s.time[e]), int(s.kind[e])
    if kind == C.READ:
      out.append(("read", t, int(s.worker[e])))
    elif kind == C.GRAD:
      out.append(("grad", t, int(s.worker[e])))
    else:
      k = int(s.mix[e])
      size = int(np.count_nonzero(s.members[k] >= 0))
      assert s.receives[k, 0] and not s.receives[k, 1:size].any()
      out.append(("mix", t, int(s.members[k, 0]), tuple(int(m) for m in s.members[k, 1:size]),
                  tuple(float(v) for v in s.weights[k, 0, :size]),
                  tuple(int(versions[k, b] - s.lag[k, b]) for b in range(1, size))))
  return out


# Random clusters: size, graph, heterogeneous speeds (replayed random compute times, one slow node), per-node latency.
CLUSTERS = {
    "regular8": (8, lambda: T.random_regular(8, 3, seed=1), 0),
    "ring6": (6, lambda: T.ring(6), 1),
    "directed_exp8": (8, lambda: T.exponential(8, directed=True), 2),
    "torus9": (9, lambda: T.torus(3, 3), 3),
}


@pytest.mark.parametrize("sync", ["notify_ack", "none"])
@pytest.mark.parametrize("cluster", list(CLUSTERS))
def test_schedule_is_the_reference_event_by_event(cluster, sync):
  num, topology, seed = CLUSTERS[cluster]
  topology = topology()
  rng = np.random.default_rng(seed)
  steps = 12
  compute = rng.exponential(size=(num, 4 * steps)) / np.r_[np.ones(num - 1), 0.3][:, None] + 1e-3
  comm = rng.uniform(0.1, 0.6, size=num)
  workers = C.workers(num, compute=C.replay(compute), comm=comm.tolist())
  s = C.simulate_gossip(C.asap(topology, sync=sync), workers, steps, seed=seed)
  grad_fn = _linear(num, seed=seed)
  x0 = rng.normal(size=(num, 3))
  w = T.mixing_matrix(topology, "uniform")
  want = asap_reference.run(compute, comm, topology.adjacency, w, steps * num, grad_fn, x0, lr=0.1, sync=sync)
  got = _schedule_events(s)
  assert [e[:1] + e[2:3] for e in got] == [e[:1] + e[2:3] for e in want["events"]]
  np.testing.assert_allclose([e[1] for e in got], [e[1] for e in want["events"]], rtol=1e-12)
  mixes = [(g, r) for g, r in zip(got, want["events"]) if g[0] == "mix"]
  assert mixes
  for g, r in mixes:
    assert g[3] == r[3] and g[5] == r[5]          # who mixes with whom, at which of the senders' versions
    np.testing.assert_allclose(g[4], r[4], rtol=1e-14)
  # The schedule executed event by event (lags looked up in each replica's history) gives the reference's models,
  # whose messages carry copies: every lag points at the version that was sent.
  out = gossip_reference.run(s, grad_fn, x0, lr=0.1)
  np.testing.assert_allclose(out["x"], want["x"], rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(s.extras["overwritten"], want["overwritten"])
  if sync == "notify_ack":
    assert not s.extras["overwritten"].any()
    assert s.wait.sum() > 0
  else:
    assert s.extras["overwritten"].sum() > 0   # the slow node's receivers lose messages of their fast senders
    np.testing.assert_allclose(s.wait, 0.0, atol=1e-9)


def test_notify_ack_bounds_each_link_to_one_unconsumed_message():
  # Between two sends of a node, each receiver consumes its previous message (NOTIFY-ACK); a straggler's fast
  # in-neighbours wait for it, its other nodes do not.
  num = 8
  topology = T.random_regular(num, 3, seed=2)
  workers = C.workers(num, compute="exponential", comm=C.exponential(0.2), speed=[1.0] * (num - 1) + [0.2])
  s = C.simulate_gossip(C.asap(topology), workers, 40, seed=4)
  versions = s.mix_versions()
  consumed = {}
  for k in range(s.num_mixes):
    r = int(s.members[k, 0])
    for b in range(1, int(np.count_nonzero(s.members[k] >= 0))):
      consumed.setdefault((int(s.members[k, b]), r), []).append(int(versions[k, b] - s.lag[k, b]))
  for (sender, receiver), sent in consumed.items():
    assert receiver in topology.neighbors(sender)
    assert sent == sorted(set(sent))   # each message consumed once, in the order sent
  slow = num - 1
  feeders = [m for m in range(num) if slow in topology.neighbors(m)]
  others = [m for m in range(num - 1) if m not in feeders]
  assert s.idle_fraction[feeders].mean() > 2 * s.idle_fraction[others].mean()
  allreduce = C.simulate_gossip(C.allreduce(), workers, 40, seed=4)
  assert s.total_time < 0.7 * allreduce.total_time


def test_zero_gradients_reach_consensus_and_same_seed_same_schedule(tmp_path):
  num = 6
  topology = T.ring(num)
  workers = C.workers(num, compute="lognormal", comm=C.exponential(0.3))
  s = C.simulate_gossip(C.asap(topology), workers, 60, seed=1)
  x0 = np.random.default_rng(0).normal(size=(num, 2))
  out = gossip_reference.run(s, lambda z, i, j: np.zeros(2), x0, lr=0.1)
  assert np.ptp(out["x"], axis=0).max() < 1e-3 * np.ptp(x0, axis=0).max()
  assert s == C.simulate_gossip(C.asap(topology), workers, 60, seed=1)
  s.save(tmp_path / "asap.npz")
  assert C.GossipSchedule.load(tmp_path / "asap.npz") == s


def test_replica_runtime_matches_the_numpy_replica_loop():
  num, lr, beta, batch = 6, 0.05, 0.5, 4
  workers = C.workers(num, compute="exponential", comm=C.exponential(0.3), speed=[1.0] * 5 + [0.25], seed=0)
  s = C.simulate_gossip(C.asap(T.ring(num)), workers, 5, seed=2)
  assert s.max_lag > 0
  data, loss_fn, params = regression()
  result = dj.simulate_gossip(loss_fn, optax.sgd(lr, momentum=beta), dj.gossip.d_psgd(), params, data, s,
                              sampling=dj.Sampling(batch_size=batch))

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(0, 0, replica, batch_index, num_examples=40, batch_size=batch))
    return grad(z, data, idx)

  want = gossip_reference.run(s, grad_fn, flat(params), lr=lr, momentum=beta)
  got = np.concatenate([np.asarray(result.params["w"], np.float64),
                        np.asarray(result.params["b"], np.float64)[:, None]], axis=1)
  np.testing.assert_allclose(got, want["x"], rtol=2e-5, atol=2e-6)


def test_bad_inputs():
  ring = T.ring(4)
  with pytest.raises(TypeError, match="topology must be a dj.topology.Topology"):
    C.asap("ring")
  with pytest.raises(ValueError, match="rule must be one of"):
    C.asap(ring, rule="max")
  with pytest.raises(ValueError, match="sync must be one of.*'barrier'"):
    C.asap(ring, sync="barrier")
  with pytest.raises(ValueError, match="topology has 4 nodes but the workers are 5"):
    C.simulate_gossip(C.asap(ring), C.workers(5), 3)
  star = np.zeros((4, 4), bool)
  star[0, 1:] = star[1:, 0] = True
  with pytest.raises(ValueError, match="uniform weights"):
    C.asap(T.from_adjacency(star, "star"), rule="uniform")   # not doubly stochastic on an irregular graph
  with pytest.raises(ValueError, match="failures are supported by d_psgd and ad_psgd"):
    C.simulate_gossip(C.asap(ring), C.workers(4), 3, failures=C.failures(drop=0.1))
