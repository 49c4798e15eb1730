"""Staleness-model step sizes (mindthestep, mindthestep_weight): the re-weighting rule and its properties."""

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, assert_same_updates_as,
                           params_tree, random_like)


def _numpy_weight(q, target, taus):
  """s(tau) = P_target(tau) / P_model(tau) for geometric P(l) = (1 - p) p^l, written out per tau."""
  model = (1.0 - q) * q ** taus.astype(np.float64)
  wanted = (1.0 - target) * target ** taus.astype(np.float64)
  return wanted / model


@pytest.mark.parametrize("m, target", [(2, 0.25), (4, 0.5), (8, 0.875), (16, 0.0), (10, 0.3)])
def test_numpy_reference(m, target):
  taus = np.arange(12)
  got = dj.mindthestep_weight(m, target_momentum=target)(jnp.asarray(taus, jnp.int32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, _numpy_weight(1.0 - 1.0 / m, target, taus), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m, target", [(3, 0.4), (6, 0.0), (12, 0.9)])
def test_model_expected_weight_is_one_and_weighted_distribution_is_the_target(m, target):
  q = 1.0 - 1.0 / m
  taus = np.arange(400)
  model = (1.0 - q) * q ** taus
  s = np.asarray(dj.mindthestep_weight(m, target_momentum=target)(jnp.asarray(taus, jnp.int32)), np.float64)
  assert np.sum(model * s) == pytest.approx(1.0, rel=1e-5)
  weighted = model * s
  np.testing.assert_allclose(weighted[:20], (1.0 - target) * target ** taus[:20], rtol=1e-5, atol=1e-12)
  # The implicit momentum of the weighted distribution is the target.
  assert dj.implicit_momentum(staleness_probs=weighted / weighted.sum()) == pytest.approx(target, abs=1e-5)


def test_measured_staleness_uses_the_mean_matching_model():
  probs = np.zeros(8)
  probs[7] = 1.0  # 8 round-robin workers: q = 7/8, as for num_workers=8
  taus = jnp.arange(10, dtype=jnp.int32)
  np.testing.assert_array_equal(dj.mindthestep_weight(staleness_probs=probs, target_momentum=0.5)(taus),
                                dj.mindthestep_weight(8, target_momentum=0.5)(taus))


def test_one_worker_is_sgd_bit_for_bit():
  assert_same_updates_as(dj.mindthestep(0.3, 1, target_momentum=0.0), optax.sgd(0.3), {"staleness": 0})


def test_target_equal_to_the_model_keeps_every_step():
  params = params_tree()
  tx, ref = dj.mindthestep(0.3, 4, target_momentum=0.75), optax.sgd(0.3)
  g = random_like(params, 5)
  for tau in (0, 1, 7):
    u, _ = tx.update(g, tx.init(params), params, staleness=tau)
    v, _ = ref.update(g, ref.init(params), params)
    chex.assert_trees_all_close(u, v, rtol=1e-6)


def test_per_leaf_staleness_jit_and_chain():
  params = params_tree()
  tx = dj.mindthestep(0.1, 4, target_momentum=0.5)
  g = random_like(params, 2)
  u, _ = tx.update(g, tx.init(params), params, staleness={"w": jnp.int32(0), "b": jnp.int32(2)})
  np.testing.assert_allclose(u["w"], -0.1 * 2.0 * np.asarray(g["w"]), rtol=1e-6)
  np.testing.assert_allclose(u["b"], -0.1 * 2.0 * (2.0 / 3.0) ** 2 * np.asarray(g["b"]), rtol=1e-5)
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i)})
  assert_chain_and_unknown_extra_args(tx, params, {"staleness": 3, "worker": 0})
  # The weight composes with scale_by_staleness in front of any optimizer.
  s = dj.mindthestep_weight(4, target_momentum=0.5)
  chained = optax.chain(dj.scale_by_staleness(s), optax.sgd(0.1))
  v, _ = chained.update(g, chained.init(params), params, staleness=3)
  w, _ = tx.update(g, tx.init(params), params, staleness=3)
  chex.assert_trees_all_equal(v, w)
  with pytest.raises(ValueError, match="staleness="):
    tx.update(g, tx.init(params), params)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"num_workers": 4, "target_momentum": 0.8}, ValueError, r"target_momentum must be in \[0, 0.75\]"),
    ({"num_workers": 1, "target_momentum": 0.1}, ValueError, r"target_momentum must be in \[0, 0.0\]"),
    ({"num_workers": 4, "target_momentum": -0.1}, ValueError, "target_momentum must be >= 0.0"),
    ({"num_workers": 4, "target_momentum": "0.5"}, TypeError, "target_momentum must be a real number"),
    ({"num_workers": 0, "target_momentum": 0.0}, ValueError, "num_workers must be an integer >= 1"),
    ({"target_momentum": 0.0}, ValueError, "exactly one of num_workers and staleness_probs"),
    ({"staleness_probs": [0.5, 0.2], "target_momentum": 0.0}, ValueError, "sum to 1"),
])
def test_bad_arguments(kwargs, err, match):
  with pytest.raises(err, match=match):
    dj.mindthestep_weight(**kwargs)
  with pytest.raises(err, match=match):
    dj.mindthestep(0.1, **kwargs)


def test_bad_learning_rate_and_missing_target():
  with pytest.raises(ValueError, match="learning_rate must be > 0.0"):
    dj.mindthestep(0.0, 4, target_momentum=0.5)
  with pytest.raises(TypeError, match="target_momentum"):
    dj.mindthestep(0.1, 4)
