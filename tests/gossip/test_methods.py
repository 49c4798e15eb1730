"""Each gossip method against a NumPy re-implementation of its rule, on short random event sequences."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.cluster import GRADS, PARAMS, GossipSchedule

sys.path.insert(0, os.path.dirname(__file__))
from method_reference import random_schedule, regression, run_reference  # noqa: E402

LR, BETA, BATCH = 0.05, 0.5, 4


def _run(method, schedule, **kw):
  data, loss_fn, params = regression()
  return dj.simulate_gossip(loss_fn, optax.sgd(LR, momentum=BETA), method, params, data, schedule,
                            sampling=dj.Sampling(batch_size=BATCH), **kw), data, params


def _stacked(params):
  return np.concatenate([np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)[:, None]], axis=1)


CASES = [
    ("d_psgd", lambda: dj.gossip.d_psgd(), dict(group=3), {}),
    ("ad_psgd", lambda: dj.gossip.ad_psgd(), dict(group=2, lag=2), {}),
    ("sgp", lambda: dj.gossip.sgp(), dict(group=2, push_sum=True, lag=2), {}),
    ("gossip_grad", lambda: dj.gossip.gossip_grad(), dict(group=2, mixes=GRADS), {}),
    ("dc_s3gd", lambda: dj.gossip.dc_s3gd(0.7), dict(group=4), dict(lam=0.7)),
    ("a2cid2", lambda: dj.gossip.a2cid2(0.4, 0.3, time_unit=0.8), dict(group=2),
     dict(eta=0.4, beta_tilde=0.3, time_unit=0.8)),
    # Groups of 3 with 2 layers: some layer is pushed by two members at once (the renormalization).
    ("layup", dj.gossip.layup, dict(group=3), {}),
    ("accelerated", lambda: dj.gossip.accelerated_sgd(1.7), dict(group=3), dict(agg=1.7)),
]
_RULE = {"ad_psgd": "d_psgd"}


@pytest.mark.fast_compile
@pytest.mark.parametrize("name,make,schedule_kw,rule_kw", CASES, ids=[c[0] for c in CASES])
def test_method_matches_numpy_rule(name, make, schedule_kw, rule_kw):
  schedule = random_schedule(4, 60, seed=3, max_batches=2, **schedule_kw)
  result, data, params = _run(make(), schedule)
  ref = run_reference(_RULE.get(name, name), schedule, params, data, lr=LR, beta=BETA, batch_size=BATCH,
                      **rule_kw)
  np.testing.assert_allclose(_stacked(result.params), ref["x"], rtol=2e-5, atol=2e-6)
  if name == "sgp":
    np.testing.assert_allclose(np.asarray(result.extra.weight), ref["w"], rtol=1e-6)
  if name == "a2cid2":
    np.testing.assert_allclose(_stacked(result.extra.tilde), ref["tilde"], rtol=2e-5, atol=2e-6)
  if name == "dc_s3gd":
    np.testing.assert_allclose(_stacked(result.extra.average), ref["average"], rtol=2e-5, atol=2e-6)
  if name == "layup":
    np.testing.assert_array_equal(np.asarray(result.extra.cursor), ref["cursor"])
    # The rule changed something: some layer was averaged with a pusher's copy at least once.
    assert ref["cursor"].any()
  if name == "accelerated":
    np.testing.assert_allclose(_stacked(result.extra.aggregate), ref["aggregate"], rtol=2e-5, atol=2e-6)
    # The average model is that of the points where gradients are taken, x_md = (1 - 1/beta) x_ag + x / beta.
    x_md = (1 - 1 / 1.7) * ref["aggregate"] + ref["x"] / 1.7
    np.testing.assert_allclose(_stacked({k: v[None] for k, v in result.average.items()})[0], x_md.mean(axis=0),
                               rtol=2e-5, atol=2e-6)


def _one_replica_rounds(rounds: int, mixes: int) -> GossipSchedule:
  """One replica: rounds of READ, MIX (with itself, weight 1), GRAD."""
  kind = np.tile(np.array([0, 2, 1], np.int8), rounds)
  return GossipSchedule(
      num_workers=1, time=np.arange(3.0 * rounds), kind=kind, worker=np.where(kind == 2, -1, 0),
      num_batches=np.where(kind == 2, 0, 1), mix=np.where(kind == 2, np.cumsum(kind == 2) - 1, -1),
      members=np.zeros((rounds, 1), np.int64), weights=np.ones((rounds, 1, 1)), lag=np.zeros((rounds, 1), np.int64),
      receives=np.ones((rounds, 1), bool), mixes=np.full(rounds, mixes, np.int8))


@pytest.mark.parametrize("make", [dj.gossip.d_psgd, dj.gossip.sgp, dj.gossip.gossip_grad,
                                  lambda: dj.gossip.dc_s3gd(0.5), lambda: dj.gossip.a2cid2(0.3, 0.2),
                                  dj.gossip.layup, lambda: dj.gossip.accelerated_sgd(1.0)])
def test_one_replica_is_plain_training_bit_for_bit(make):
  method = make()
  schedule = _one_replica_rounds(6, GRADS if method.mixes == "gradients" else PARAMS)
  data, loss_fn, params = regression()
  # The optimizer of AD-PSGD's reference code: weight decay, then SGD with Nesterov momentum.
  tx = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.05, momentum=0.9, nesterov=True))
  result = dj.simulate_gossip(loss_fn, tx, method, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))

  @jax.jit
  def train_step(p, s, k):
    idx = dj.runtime.minibatch_indices(0, 0, 0, k, num_examples=40, batch_size=BATCH)
    g = jax.grad(loss_fn)(p, jax.tree.map(lambda x: jnp.asarray(x)[idx], data))
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p, s = jax.tree.map(jnp.asarray, params), tx.init(params)
  for k in range(6):
    p, s = train_step(p, s, k)
  for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(p)):
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b))


def test_acid_constants_on_a_ring_match_the_closed_form():
  # Ring of M nodes, W = (S + S^T)/2: lambda_2(I - W) = 1 - cos(2 pi / M); an edge's effective resistance
  # with conductance 1/2 is 2 (M - 1) / M, so chi_2 = (M - 1) / M.
  m = 8
  adjacency = np.roll(np.eye(m), 1, axis=1) + np.roll(np.eye(m), -1, axis=1)
  chi_1, chi_2 = 1.0 / (1.0 - np.cos(2 * np.pi / m)), (m - 1) / m
  eta, beta = dj.gossip.acid_constants(adjacency)
  assert eta == pytest.approx(0.5 / np.sqrt(chi_1 * chi_2))
  assert beta == pytest.approx(0.5 * np.sqrt(chi_1 / chi_2))
  # Twice the communication rate: L doubles, chi_1 and chi_2 halve.
  eta2, beta2 = dj.gossip.acid_constants(adjacency, rate=2.0)
  assert eta2 == pytest.approx(2 * eta) and beta2 == pytest.approx(beta)


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="eta"):
    dj.gossip.a2cid2(-1.0, 0.1)
  with pytest.raises(ValueError, match="lam"):
    dj.gossip.dc_s3gd(-0.1)
  with pytest.raises(ValueError, match="connected"):
    dj.gossip.acid_constants(np.zeros((3, 3)))
  with pytest.raises(ValueError, match=r"beta must be >= 1.0, got 0.5"):
    dj.gossip.accelerated_sgd(0.5)
  with pytest.raises(TypeError, match="beta must be a real number"):
    dj.gossip.accelerated_sgd("2")


@pytest.mark.parametrize("make", [dj.gossip.layup, lambda: dj.gossip.a2cid2(0.3, 0.2)])
def test_rules_that_take_their_own_share_out_refuse_late_messages(make):
  data, loss_fn, params = regression()
  schedule = random_schedule(4, 30, seed=1, group=2, lag=2)
  assert schedule.lag.max() > 0
  method = make()
  with pytest.raises(ValueError, match=rf"'{method.name}' is not defined for late messages.*lag up to 2"):
    dj.simulate_gossip(loss_fn, optax.sgd(LR), method, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))


def _mixed_at_rest(schedule: GossipSchedule, push_sum: bool) -> np.ndarray:
  """Replicas of value 1 at learning rate 0 through the schedule's mixes, in NumPy: the value each ends with (for
  push-sum the de-biased x / w, both mixed alike with the schedule's weights and lags)."""
  num = schedule.num_workers
  x_hist = [[1.0] for _ in range(num)]
  w_hist = [[1.0] for _ in range(num)]
  for e in range(schedule.num_events):
    kind = int(schedule.kind[e])
    if kind == 1:  # GRAD at rate 0: a new local version, the same value
      m = int(schedule.worker[e])
      x_hist[m].append(x_hist[m][-1])
      w_hist[m].append(w_hist[m][-1])
    elif kind == 2 and schedule.mixes[schedule.mix[e]] == PARAMS:
      k = int(schedule.mix[e])
      members = [int(m) for m in schedule.members[k] if m >= 0]
      sent_x = [x_hist[m][len(x_hist[m]) - 1 - schedule.lag[k, b]] for b, m in enumerate(members)]
      sent_w = [w_hist[m][len(w_hist[m]) - 1 - schedule.lag[k, b]] for b, m in enumerate(members)]
      for a, m in enumerate(members):
        if schedule.receives[k, a]:
          x_hist[m].append(float(np.dot(schedule.weights[k, a, :len(members)], sent_x)))
          w_hist[m].append(float(np.dot(schedule.weights[k, a, :len(members)], sent_w)))
  x = np.array([h[-1] for h in x_hist])
  return x / np.array([h[-1] for h in w_hist]) if push_sum else x


PARADIGMS = {
    "allreduce": lambda: dj.cluster.allreduce(),
    "d_psgd": lambda: dj.cluster.d_psgd(dj.topology.ring(4)),
    "ad_psgd": lambda: dj.cluster.ad_psgd(),
    "ad_psgd_ring": lambda: dj.cluster.ad_psgd(dj.topology.ring(4)),
    "sgp": lambda: dj.cluster.sgp(),
    "sgp_overlap": lambda: dj.cluster.sgp(overlap=2),
    "gossipgrad": lambda: dj.cluster.gossipgrad(),
}
METHODS = {
    "d_psgd": dj.gossip.d_psgd, "ad_psgd": dj.gossip.ad_psgd, "gossip_grad": dj.gossip.gossip_grad,
    "sgp": dj.gossip.sgp, "dc_s3gd": dj.gossip.dc_s3gd, "a2cid2": lambda: dj.gossip.a2cid2(0.3, 0.2),
    "layup": dj.gossip.layup, "accelerated": dj.gossip.accelerated_sgd,
}
PUSH_SUM_PARADIGMS = ("sgp", "sgp_overlap")
GRADS_ONLY_PARADIGMS = ("allreduce", "gossipgrad")


@pytest.mark.parametrize("paradigm", PARADIGMS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_and_paradigm_pair_is_accepted_exactly_when_the_mixes_suit_the_method(method, paradigm):
  """Mixed at rest, identical replicas stay identical under the rule of each accepted pair; each refused pair is
  named with its reason (push-sum weights changing the mass, gradient mixing on model mixes, late messages, or
  DC-S3GD without model mixes)."""
  m = METHODS[method]()
  schedule = dj.cluster.simulate_gossip(PARADIGMS[paradigm](), dj.cluster.workers(4, seed=0), num_steps=6, seed=1)
  reasons = []
  if paradigm in PUSH_SUM_PARADIGMS and not m.push_sum:
    reasons.append("has no push-sum weight")
  if m.mixes == "gradients" and paradigm not in GRADS_ONLY_PARADIGMS:
    reasons.append("mixes gradients")
  if m.needs_param_mixes and paradigm in GRADS_ONLY_PARADIGMS:
    reasons.append("continues from its last mixed model")
  if not m.late_messages and schedule.lag.max() > 0:
    reasons.append("not defined for late messages")
  if not reasons:
    dj.gossip.check_method_schedule(m, schedule)
    np.testing.assert_allclose(_mixed_at_rest(schedule, m.push_sum), np.ones(4), rtol=1e-12)
    return
  with pytest.raises(ValueError, match=rf"method '{m.name}'") as info:
    dj.gossip.check_method_schedule(m, schedule)
  message = str(info.value)
  assert any(r in message for r in reasons), message
  if "push-sum" in message:
    assert f"paradigm '{schedule.paradigm}'" in message
    # The refusal is the math: mixed without a weight, identical replicas drift apart.
    assert not np.allclose(_mixed_at_rest(schedule, False), 1.0)


def test_a_method_without_a_weight_on_an_sgp_schedule_drifts_apart_and_is_refused():
  """The case of the issue: AD-PSGD's rule on a short SGP schedule, learning rate 0, identical replicas."""
  # The schedule, whose nodes add every arrived message ("arrived"): early messages push one above 1.4.
  schedule = dj.cluster.simulate_gossip(dj.cluster.sgp(receive="arrived"), dj.cluster.workers(4, seed=0),
                                        num_steps=6, seed=1)
  at_rest = _mixed_at_rest(schedule, False)
  assert at_rest.min() < 0.6 and at_rest.max() > 1.4
  np.testing.assert_allclose(_mixed_at_rest(schedule, True), np.ones(4), rtol=1e-12)
  with pytest.raises(ValueError, match=r"method 'ad_psgd' has no push-sum weight, so its mixes must average .*"
                                       r"paradigm 'sgp\(overlap=0, forward_only=False, receive=arrived\)'.* "
                                       r"summing to 0\.5"):
    dj.gossip.check_method_schedule(dj.gossip.ad_psgd(), schedule)


def test_a_gradient_mix_that_does_not_average_is_refused_for_every_method():
  schedule = _one_replica_rounds(3, GRADS)
  fields = {f: getattr(schedule, f) for f in ("time", "kind", "worker", "num_batches", "mix", "members", "lag",
                                               "receives", "mixes")}
  doubled = GossipSchedule(num_workers=1, weights=2.0 * schedule.weights, **fields)
  for make in (dj.gossip.gossip_grad, dj.gossip.sgp):
    dj.gossip.check_method_schedule(make(), schedule)
    with pytest.raises(ValueError, match=r"gradient mixes must average .*GRADS mix 0 .*summing to 2"):
      dj.gossip.check_method_schedule(make(), doubled)


def test_check_method_schedule_refuses_other_types():
  schedule = _one_replica_rounds(2, PARAMS)
  with pytest.raises(TypeError, match="method must be a dj.gossip method"):
    dj.gossip.check_method_schedule("d_psgd", schedule)
  with pytest.raises(TypeError, match="schedule must be a dj.cluster.GossipSchedule, got Schedule"):
    dj.gossip.check_method_schedule(dj.gossip.d_psgd(),
                                    dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(2), 5))
