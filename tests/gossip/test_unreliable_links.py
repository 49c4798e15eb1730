"""``dj.cluster.failures(on_failure="reuse")``: a failed link's term reuses the last message that arrived.

Checked against ``unreliable_reference`` (a model-space NumPy simulation with stored copies, written from the
rule): the terms each receiver mixes (who, weight, which version) and the trained models, through the sequential
schedule executor and through ``dj.simulate_gossip``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
import gossip_reference  # noqa: E402
import unreliable_reference as ur  # noqa: E402
from method_reference import flat, grad, regression  # noqa: E402

C, T = dj.cluster, dj.topology
LR, BETA, BATCH = 0.05, 0.5, 4


def _pair(paradigm, num, steps, seed, drop, down=()):
  workers = C.workers(num, compute="exponential", speed=[1.0] * (num - 1) + [0.5], seed=0)
  return tuple(C.simulate_gossip(paradigm, workers, steps, seed=seed, failures=C.failures(drop, down, rule))
               for rule in ("drop", "reuse"))


def _reads_and_applies(s):
  keep = s.kind != C.MIX
  return s.time[keep], s.kind[keep], s.worker[keep], s.extras["compute_end"][keep]


def _linear(num, dim=3):
  rng = np.random.default_rng(5)
  a = np.eye(dim) + 0.1 * rng.normal(size=(dim, dim))
  a = a @ a.T
  b = rng.normal(size=(num, dim))
  noise = 0.1 * rng.normal(size=(num, 200, dim))
  return lambda z, i, j: a @ z - b[i] + noise[i, j]


@pytest.mark.parametrize("case", ["ring", "torus-outage", "exponential"])
def test_d_psgd_reuse_matches_the_stored_copy_simulation(case):
  num = 8
  topology = {"ring": T.ring(8), "torus-outage": T.torus(2, 4), "exponential": T.exponential(8)}[case]
  down = [C.node_down(2, 3.0, 9.0), C.node_down(5, 6.0, 8.0)] if case == "torus-outage" else ()
  drop, reuse = _pair(C.d_psgd(topology), num, 25, seed=3, drop=0.35, down=down)
  # Same failures, same times: only the mixes differ.
  for x, y in zip(_reads_and_applies(drop), _reads_and_applies(reuse)):
    np.testing.assert_array_equal(x, y)
  w = T.mixing_matrix(topology)
  grad_fn = _linear(num)
  want = ur.d_psgd_reuse(drop, w, grad_fn, np.ones(3), lr=0.1, momentum=0.5)
  assert want["lost"] > 10 and any(lag > 1 for lag in reuse.message_lags())
  # Who mixes with whom, with which weight, and which version (the schedule's lags), round by round.
  got_terms = ur.schedule_terms(reuse)
  assert len(got_terms) == len(want["terms"])
  for got, ref_round in zip(got_terms, want["terms"]):
    assert got.keys() == ref_round.keys()
    for i in got:
      assert got[i].keys() == ref_round[i].keys()
      for j in got[i]:
        assert got[i][j][1] == ref_round[i][j][1]
        np.testing.assert_allclose(got[i][j][0], ref_round[i][j][0], rtol=1e-15)
  got = gossip_reference.run(reuse, grad_fn, np.ones(3), lr=0.1, momentum=0.5)["x"]
  np.testing.assert_allclose(got, want["x"], rtol=1e-12, atol=1e-12)
  # Dropping differs from reusing on this realization.
  dropped = gossip_reference.run(drop, grad_fn, np.ones(3), lr=0.1, momentum=0.5)["x"]
  assert np.max(np.abs(dropped - want["x"])) > 1e-3


@pytest.mark.parametrize("topology", [None, T.ring(6)], ids=["bipartite", "ring"])
def test_ad_psgd_reuse_matches_the_stored_copy_simulation(topology):
  num = 6
  drop, reuse = _pair(C.ad_psgd(topology), num, 20, seed=4, drop=0.4)
  for x, y in zip(_reads_and_applies(drop), _reads_and_applies(reuse)):
    np.testing.assert_array_equal(x, y)
  grad_fn = _linear(num)
  want = ur.ad_psgd_reuse(reuse, drop, grad_fn, np.ones(3), lr=0.1, momentum=0.5)
  assert want["both_lost"] > 0
  got_terms = ur.schedule_terms(reuse)
  assert got_terms == want["terms"]
  got = gossip_reference.run(reuse, grad_fn, np.ones(3), lr=0.1, momentum=0.5)["x"]
  np.testing.assert_allclose(got, want["x"], rtol=1e-12, atol=1e-12)


def test_ad_psgd_reuse_averages_with_the_stored_copy_of_a_peer_that_is_down():
  # The bipartite peers: 1 averages with 0, 3 with 2 (and so on); node 0 gone for a while, so every averaging
  # of an active node with it uses its stored copy, and 0 does not receive.
  num = 4
  window = C.node_down(0, 2.0, 6.0)
  drop, reuse = _pair(C.ad_psgd(), num, 12, seed=1, drop=0.0, down=[window])
  version = np.zeros(num, np.int64)
  last_arrived = {}
  seen = 0
  for e in range(reuse.num_events):
    kind = int(reuse.kind[e])
    if kind == C.GRAD:
      version[int(reuse.worker[e])] += 1
      continue
    if kind != C.MIX:
      continue
    k = int(reuse.mix[e])
    members = [int(m) for m in reuse.members[k] if m >= 0]
    t = float(reuse.time[e])
    if 0 in members and 2.0 <= t < 6.0:
      a, b = members.index(0), 1 - members.index(0)
      assert not reuse.receives[k, a] and reuse.receives[k, b]
      assert version[0] - reuse.lag[k, a] == last_arrived.get(members[b], 0)
      seen += 1
    elif 0 in members:
      assert np.all(reuse.lag[k, :2] == 0)
      last_arrived[members[1 - members.index(0)]] = int(version[0])
    for a, m in enumerate(members):
      version[m] += bool(reuse.receives[k, a])
  assert seen > 0
  # Under "drop" no averaging with the node that is down happens.
  assert not any(0 in s.members[k] for s in (drop,) for k in range(s.num_mixes)
                 if 2.0 <= s.time[s.mix == k][0] < 6.0)


def test_failure_process_is_bernoulli_per_link_and_reuse_without_losses_is_plain_d_psgd():
  num = 8
  drop, reuse = _pair(C.d_psgd(T.ring(num)), num, 400, seed=0, drop=0.3)
  want = ur.d_psgd_reuse(drop, T.mixing_matrix(T.ring(num)), lambda z, i, j: np.zeros(1), np.zeros(1), lr=0.0)
  frac, n = want["lost"] / want["links"], want["links"]
  assert abs(frac - 0.3) < 4 * np.sqrt(0.3 * 0.7 / n)
  # The reuse schedule mixes the same rounds.
  assert len(ur.schedule_terms(reuse)) == len(want["terms"]) == 400
  # No losses: reuse is D-PSGD, one mix per round.
  plain = C.simulate_gossip(C.d_psgd(T.ring(num)), C.workers(num), 6, seed=0)
  same = C.simulate_gossip(C.d_psgd(T.ring(num)), C.workers(num), 6, seed=0,
                           failures=C.failures(0.0, on_failure="reuse"))
  assert same.num_mixes == plain.num_mixes and np.all(same.lag == 0)
  np.testing.assert_allclose(same.weights, plain.weights, rtol=0, atol=1e-15)


@pytest.mark.fast_compile
@pytest.mark.parametrize("paradigm", ["d_psgd", "ad_psgd"])
def test_runtime_trains_as_the_stored_copy_simulation(paradigm):
  num = 6
  par = C.d_psgd(T.ring(num)) if paradigm == "d_psgd" else C.ad_psgd(T.ring(num))
  drop, reuse = _pair(par, num, 5, seed=2, drop=0.4, down=[C.node_down(1, 1.0, 3.0)] if paradigm == "d_psgd" else ())
  data, loss_fn, params = regression()

  def grad_fn(z, replica, batch_index):
    idx = np.asarray(dj.runtime.minibatch_indices(0, 0, replica, batch_index, num_examples=40, batch_size=BATCH))
    return grad(z, data, idx)

  result = dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), dj.gossip.d_psgd(), params, data, reuse,
                              sampling=dj.Sampling(batch_size=BATCH))
  if paradigm == "d_psgd":
    want = ur.d_psgd_reuse(drop, T.mixing_matrix(T.ring(num)), grad_fn, flat(params), lr=LR, momentum=BETA)
  else:
    want = ur.ad_psgd_reuse(reuse, drop, grad_fn, flat(params), lr=LR, momentum=BETA)
  got = np.concatenate([np.asarray(result.params["w"], np.float64),
                        np.asarray(result.params["b"], np.float64)[:, None]], axis=1)
  np.testing.assert_allclose(got, want["x"], rtol=2e-5, atol=2e-6)


def test_bad_on_failure():
  with pytest.raises(ValueError, match="on_failure"):
    C.failures(0.1, on_failure="keep")
  with pytest.raises((TypeError, ValueError), match="on_failure"):
    C.failures(0.1, on_failure=1)
  assert C.failures(0.1).on_failure == "drop"
