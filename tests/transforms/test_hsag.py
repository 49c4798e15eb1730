"""HSAG (Reddi et al. 2015): SAGA anchors on a set S, SVRG's snapshot elsewhere; S = all is dj.saga, S = {} is
dj.svrg, and a mixed S under stale reads through dj.simulate is a float64 NumPy re-implementation of the rule."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import round_robin_stale_reads

sys.path.insert(0, os.path.dirname(__file__))
from remedy_checks import assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree  # noqa: E402

LAM = 0.1


def least_squares(n=12, d=3, seed=0):
  """f_i(w) = (x_i.w - y_i)^2 / 2 + LAM |w|^2 / 2 as a dj.problems.FiniteSum."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d))
  y = x @ rng.standard_normal(d) + rng.standard_normal(n)
  return dj.problems.FiniteSum("least_squares", y, LAM, features=x)


def _batch(tree, b, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal((b,) + x.shape), x.dtype), tree)


# ---------------------------------------------------------------- S = all indices: SAGA, bit for bit


def test_every_index_in_the_set_is_saga_bit_for_bit():
  n, b = 6, 3
  params = params_tree()
  hsag, saga = dj.hsag(n, range(n)), dj.saga(n)
  hs, ss = hsag.init(params), saga.init(params)
  rng = np.random.default_rng(3)
  for t in range(8):
    idx = jnp.asarray(rng.integers(0, n, b), jnp.int32)  # repeats happen: the last occurrence writes
    mask = jnp.asarray(rng.random(b) < 0.8)
    grads = _batch(params, b, t)
    g = jax.tree.map(lambda x: jnp.mean(x, axis=0), grads)
    # HSAG with no index outside S needs neither a snapshot nor snapshot gradients.
    hu, hs = hsag.update(g, hs, params, sample_indices=idx, sample_grads=grads, sample_mask=mask)
    su, ss = saga.update(g, ss, params, sample_indices=idx, sample_grads=grads, sample_mask=mask)
    for a, c in zip(jax.tree.leaves(hu), jax.tree.leaves(su)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  for a, c in zip(jax.tree.leaves((hs.table, hs.table_sum)), jax.tree.leaves((ss.table, ss.table_sum))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


# ---------------------------------------------------------------- through dj.simulate: S = {} and S = all


def _simulate(problem, tx, worker, delays, updates, batch_size, seed=4):
  return dj.simulate(problem.loss_fn, tx, jnp.zeros(problem.num_features, jnp.float64), problem.data(jnp.float64),
                     delays, num_updates=updates, seed=seed, sampling=dj.Sampling(batch_size=batch_size),
                     worker=worker)


def test_empty_set_is_svrg_and_full_set_is_saga_under_stale_reads():
  problem = least_squares()
  n, eta, updates = problem.num_samples, 0.05, 3 * problem.num_samples
  delays = dj.delays.uniform(3)
  with jax.enable_x64(True):
    # Per-example snapshot gradients and the full gradient weighted by 1 outside S against SVRG's minibatch
    # snapshot gradient and plain full gradient: the same numbers summed in another order.
    epochs = dj.workers.Gradient(snapshot_every=n // 2)
    svrg = _simulate(problem, optax.chain(dj.svrg(), optax.sgd(eta)), epochs, delays, updates, 2)
    empty = _simulate(problem, optax.chain(dj.hsag(n, []), optax.sgd(eta)), epochs, delays, updates, 2)
    np.testing.assert_allclose(np.asarray(empty.params), np.asarray(svrg.params), rtol=1e-12, atol=1e-14)
    saga = _simulate(problem, optax.chain(dj.saga(n), optax.sgd(eta)), None, delays, updates, 2)
    full = _simulate(problem, optax.chain(dj.hsag(n, np.arange(n)), optax.sgd(eta)), epochs, delays, updates, 2)
    np.testing.assert_array_equal(np.asarray(full.params), np.asarray(saga.params))
  assert np.max(np.abs(np.asarray(svrg.params) - np.asarray(saga.params))) > 1e-6  # the two differ at all


def test_the_full_gradient_by_chunks_is_the_same_run():
  """Gradient(full_batch_size=5) sums the weighted full gradient over chunks of 5 and a tail of 2 (n = 12)."""
  problem = least_squares()
  n, eta = problem.num_samples, 0.05
  tx = optax.chain(dj.hsag(n, [1, 2, 5, 11]), optax.sgd(eta))
  with jax.enable_x64(True):
    whole = _simulate(problem, tx, dj.workers.Gradient(snapshot_every=n), dj.delays.constant(2), 2 * n, 1)
    chunked = _simulate(problem, tx, dj.workers.Gradient(snapshot_every=n, full_batch_size=5), dj.delays.constant(2),
                        2 * n, 1)
  np.testing.assert_allclose(np.asarray(chunked.params), np.asarray(whole.params), rtol=1e-12, atol=1e-14)


def test_one_snapshot_per_chain():
  problem = least_squares()
  tx = optax.chain(dj.hsag(problem.num_samples, [0]), dj.svrg(), optax.sgd(0.1))
  with jax.enable_x64(True), pytest.raises(ValueError, match="at most one transformation in a chain may request "
                                                               "snapshot_grad or sample_snapshot_grads"):
    _simulate(problem, tx, None, dj.delays.constant(1), 4, 1)


# ---------------------------------------------------------------- mixed S: the paper's rule in NumPy


def reference(problem, saga_set, epoch, eta, delays, picks):
  """HSAG sequentially in float64 NumPy: anchors alpha_i, SAGA's (the read, after the update) on S, the epoch's
  snapshot (the iterate at its start) elsewhere; v = mean_j [grad f_ij(read) - grad f_ij(alpha_ij)]
  + mean_i grad f_i(alpha_i)."""
  x, y = np.asarray(problem.features), np.asarray(problem.targets)
  n, d = x.shape
  in_s = np.zeros(n, bool)
  in_s[list(saga_set)] = True

  def grad(w, i):
    return x[i] * (x[i] @ w - y[i]) + LAM * w

  table = np.zeros((n, d))  # the S rows' gradients at their anchors, zero before their first draw
  versions, snap = [np.zeros(d)], None
  for t in range(len(delays)):
    w = versions[-1]
    if t % epoch == 0:
      snap = w
    read = versions[t - delays[t]]
    anchor = [table[i] if in_s[i] else grad(snap, i) for i in range(n)]
    batch = picks[t]
    v = np.mean([grad(read, i) - anchor[i] for i in batch], axis=0) + np.mean(anchor, axis=0)
    for i in batch:
      if in_s[i]:
        table[i] = grad(read, i)
    versions.append(w - eta * v)
  return np.stack(versions)


def test_mixed_set_under_stale_reads_is_the_numpy_reference():
  problem = least_squares(n=10)
  n, tau, batch, epoch, eta, seed = problem.num_samples, 3, 2, 7, 0.05, 9
  updates, workers = 4 * n, tau + 1
  saga_set = [0, 3, 4, 8]
  schedule, delays = round_robin_stale_reads(updates, tau, seed=1)
  t = jnp.arange(updates)
  picks = np.asarray(jax.vmap(lambda u, m, k: dj.runtime.minibatch_indices(
      seed, u, m, k, num_examples=n, batch_size=batch))(t, t % workers, t // workers))
  assert np.isin(picks, saga_set).any() and (~np.isin(picks, saga_set)).any()  # batches from both sides
  with jax.enable_x64(True):
    got = dj.simulate(problem.loss_fn, optax.chain(dj.hsag(n, saga_set), optax.sgd(eta)),
                      jnp.zeros(problem.num_features, jnp.float64), problem.data(jnp.float64), schedule, seed=seed,
                      sampling=dj.Sampling(batch_size=batch), worker=dj.workers.Gradient(snapshot_every=epoch),
                      record=dj.Record(eval_fn=lambda w: w, every=1, history="evaluations"))
    iterates = np.asarray(got.history.eval_metrics)
  expected = reference(problem, saga_set, epoch, eta, delays, picks)
  np.testing.assert_allclose(iterates[-1], expected[-1], rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(np.asarray(got.params), expected[-1], rtol=1e-10, atol=1e-12)
  # Stale reads matter here: the same rule with fresh reads ends elsewhere.
  fresh = reference(problem, saga_set, epoch, eta, np.zeros_like(delays), picks)
  assert np.max(np.abs(fresh[-1] - expected[-1])) > 1e-8


def test_the_table_holds_only_the_set():
  state = dj.hsag(10, [1, 7]).init({"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)})
  assert state.table["w"].shape == (2, 3, 2) and state.table["b"].shape == (2, 2)
  np.testing.assert_array_equal(np.asarray(state.full_grad_weights()), [1, 0, 1, 1, 1, 1, 1, 0, 1, 1])
  assert dj.runtime_inputs(optax.chain(dj.hsag(10, [1]), optax.sgd(0.1)).init(jnp.zeros(2))) == (
      "full_grad", "sample_grads", "sample_indices", "sample_mask", "sample_snapshot_grads")


def test_jit_traces_once_and_composes():
  params = params_tree()
  extra = lambda i: {"sample_indices": jnp.array([i, 4], jnp.int32),  # noqa: E731
                     "sample_grads": _batch(params, 2, i), "sample_snapshot_grads": _batch(params, 2, 10 + i),
                     "full_grad": params, "refresh": jnp.asarray(i == 0)}
  assert_jit_traces_once(dj.hsag(5, [0, 4]), params, extra)
  assert_chain_and_unknown_extra_args(dj.hsag(5, [0, 4]), params, extra(0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), params_tree())
  tx = dj.hsag(3, [1])
  state = tx.init(params)
  extra = {"sample_indices": jnp.array([0, 1], jnp.int32), "sample_grads": _batch(params, 2, 0),
           "sample_snapshot_grads": _batch(params, 2, 1), "full_grad": params}
  for _ in range(2):
    u, state = tx.update(params, state, params, **extra)
    assert all(x.dtype == dtype for x in jax.tree.leaves(u))


def test_traced_index_out_of_range_poisons_the_update_and_leaves_the_table():
  w = jnp.zeros(2)
  tx = dj.hsag(3, [0, 2])
  state = tx.init(w)
  step = jax.jit(lambda s, i: tx.update(jnp.ones(2), s, w, sample_indices=i, sample_grads=jnp.ones((1, 2)),
                                        sample_snapshot_grads=jnp.ones((1, 2)), full_grad=jnp.ones(2)))
  u, new = step(state, jnp.array([5], jnp.int32))
  assert np.all(np.isnan(np.asarray(u)))
  np.testing.assert_array_equal(np.asarray(new.table), np.asarray(state.table))
  u, new = step(state, jnp.array([2], jnp.int32))
  np.testing.assert_array_equal(np.asarray(new.table), [[0, 0], [1, 1]])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("saga_set, error, match", [
    ([0, 5], ValueError, r"saga_set must hold indices in \[0, num_samples\) = \[0, 5\); got values in \[0, 5\]"),
    ([-1], ValueError, r"in \[0, num_samples\) = \[0, 5\); got values in \[-1, -1\]"),
    ([1, 1], ValueError, "saga_set must hold distinct indices; got 1 repeated"),
    ([[0, 1]], ValueError, r"saga_set must be 1-d \(a list of indices\), got shape \(1, 2\)"),
    ([0.5], TypeError, "saga_set must hold integer indices .* got dtype float64"),
    (np.array([True, False]), TypeError, r"got dtype bool \(for a bool mask pass np.flatnonzero\(mask\)\)"),
    ("01", TypeError, "saga_set must be a sequence or 1-d array of integer indices .* got str '01'"),
    (3, TypeError, "saga_set must be a sequence .* got int 3"),
])
def test_bad_saga_set(saga_set, error, match):
  with pytest.raises(error, match=match):
    dj.hsag(5, saga_set)


def test_bad_update_inputs():
  with pytest.raises(ValueError, match="num_samples must be an integer"):
    dj.hsag(0, [])
  w = jnp.zeros(2)
  tx = dj.hsag(3, [1])
  state = tx.init(w)
  base = {"sample_indices": jnp.array([0], jnp.int32), "sample_grads": jnp.ones((1, 2)),
          "sample_snapshot_grads": jnp.ones((1, 2))}
  with pytest.raises(ValueError, match="hsag has no full gradient yet"):
    tx.update(jnp.ones(2), state, w, **base)
  with pytest.raises(ValueError, match="hsag needs the extra argument sample_snapshot_grads="):
    tx.update(jnp.ones(2), state, w, full_grad=w, **{k: v for k, v in base.items() if k != "sample_snapshot_grads"})
  with pytest.raises(ValueError, match="hsag needs the extra argument sample_indices="):
    tx.update(jnp.ones(2), state, w, full_grad=w)
  with pytest.raises(ValueError, match=r"sample_indices must be in \[0, num_samples\) = \[0, 3\)"):
    tx.update(jnp.ones(2), state, w, full_grad=w, **dict(base, sample_indices=jnp.array([3])))
  with pytest.raises(ValueError, match=r"sample_snapshot_grads leaves must have shape \[len\(sample_indices\), "
                                       r"\*update_shape\] \(a leading axis of 1\)"):
    tx.update(jnp.ones(2), state, w, full_grad=w, **dict(base, sample_snapshot_grads=jnp.ones((2, 2))))
  with pytest.raises(TypeError, match="refresh must be a bool scalar"):
    tx.update(jnp.ones(2), state, w, full_grad=w, refresh="yes", **base)
