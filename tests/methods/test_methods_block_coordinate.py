"""Asynchronous block-coordinate methods (APCD, AsySBCDVR) against a NumPy re-implementation with per-block reads."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from methods_reference import composite_optimum, lasso_problem, soft  # noqa: E402

L1 = 0.05
LR = 0.8
BLOCKS = {"a": slice(0, 2), "b": slice(2, 5), "c": slice(5, 6)}  # sorted like the dict's leaves
TRACES = {"a": (0, 3, 1, 2, 0), "b": (2, 0, 3), "c": (1, 1, 0, 3, 2, 0, 2)}
SEED = 3


def split(w):
  return {k: jnp.asarray(w[s], jnp.float32) for k, s in BLOCKS.items()}


def join(params):
  return jnp.concatenate([params[k] for k in BLOCKS])


def numpy_apcd(problem, num_updates: int) -> np.ndarray:
  """Versions ``[U + 1, d]`` in float64: block b of update t's read is version max(0, t - trace_b[t]); only
  block j_t (uniform from fold_in(key(SEED), t)) changes, by a prox step from its current value."""
  versions = [np.zeros(problem.num_features)]
  for t in range(num_updates):
    read = np.concatenate([versions[max(0, t - TRACES[k][t % len(TRACES[k])])][s] for k, s in BLOCKS.items()])
    g = problem.gradient(read)
    j = int(jax.random.randint(jax.random.fold_in(jax.random.key(SEED), t), (), 0, len(BLOCKS)))
    new = versions[t].copy()
    s = list(BLOCKS.values())[j]
    new[s] = soft(versions[t][s] - LR * g[s], LR * L1)
    versions.append(new)
  return np.stack(versions)


def test_apcd_through_simulate_matches_numpy_per_block_reads_and_converges():
  problem = lasso_problem()
  source = dj.delays.per_leaf({k: dj.delays.trace(v) for k, v in TRACES.items()})
  result = dj.simulate(lambda p, batch: problem.loss_fn(join(p), batch), dj.apcd(LR, dj.prox_l1(L1), seed=SEED),
                       split(np.zeros(problem.num_features)), problem.data(), source, num_updates=320,
                       sampling=dj.Sampling(batch_size=problem.num_samples, scheme="epoch"),
                       record=dj.Record(eval_fn=join, every=16))
  got = np.asarray(result.history.eval_metrics)
  want = numpy_apcd(problem, 320)
  np.testing.assert_allclose(got, want[result.history.eval_update], rtol=1e-4, atol=2e-5)
  np.testing.assert_allclose(got[-1], composite_optimum(problem, L1), atol=1e-4)


def test_asysbcdvr_converges_on_a_lasso_under_per_block_delays_where_block_sgd_stalls():
  problem = lasso_problem()
  w_star = composite_optimum(problem, L1)
  source = dj.delays.per_leaf({"a": dj.delays.uniform(3), "b": dj.delays.uniform(1), "c": dj.delays.uniform(4)})
  kwargs = dict(num_updates=900, sampling=dj.Sampling(batch_size=4), seed=1, record=dj.Record(eval_fn=join))
  loss = lambda p, batch: problem.loss_fn(join(p), batch)  # noqa: E731
  w0 = split(np.zeros(problem.num_features))
  vr = dj.simulate(loss, dj.asysbcdvr(0.3, dj.prox_l1(L1)), w0, problem.data(), source,
                   worker=dj.workers.Gradient(snapshot_every=48), **kwargs)
  err_vr = np.max(np.abs(np.asarray(vr.history.eval_metrics)[-1] - w_star))
  # The same block steps on plain minibatch gradients, in NumPy: the noise floor VR removes.
  rng = np.random.default_rng(0)
  w = np.zeros(problem.num_features)
  x, y = problem.features, problem.targets
  for t in range(900):
    j, i = t % 3, rng.integers(0, problem.num_samples, 4)
    g = x[i].T @ (x[i] @ w - y[i]) / 4 + problem.lam * w
    s = list(BLOCKS.values())[j]
    w[s] = soft(w[s] - 0.3 * g[s], 0.3 * L1)
  err_sgd = np.max(np.abs(w - w_star))
  assert err_vr < 1e-3
  assert err_sgd > 10 * err_vr


def test_block_coordinate_changes_one_leaf_and_counts():
  tx = dj.block_coordinate(0.5, selection="cyclic")
  w = {"a": jnp.ones(2), "b": jnp.ones(3)}
  g = {"a": jnp.full(2, 2.0), "b": jnp.full(3, 4.0)}
  state = tx.init(w)
  u0, state = tx.update(g, state, w)
  u1, state = tx.update(g, state, w)
  np.testing.assert_array_equal(np.asarray(u0["a"]), -1.0)
  np.testing.assert_array_equal(np.asarray(u0["b"]), 0.0)
  np.testing.assert_array_equal(np.asarray(u1["a"]), 0.0)
  np.testing.assert_array_equal(np.asarray(u1["b"]), -2.0)
  assert int(state.count) == 2


def test_random_blocks_are_uniform():
  picks = np.asarray(jax.vmap(lambda c: dj.transforms.block_index(c, 4, "random", 0))(jnp.arange(4000)))
  counts = np.bincount(picks, minlength=4)
  assert counts.min() > 900 and counts.max() < 1100  # 1000 +- ~3.5 sigma


def test_bad_inputs():
  with pytest.raises(ValueError, match="learning_rate"):
    dj.block_coordinate(0.0)
  with pytest.raises(ValueError, match="selection"):
    dj.apcd(0.1, selection="greedy")
  with pytest.raises(TypeError, match="prox"):
    dj.asysbcdvr(0.1, prox="l1")
  with pytest.raises(ValueError, match="seed"):
    dj.block_coordinate(0.1, seed=-1)
  with pytest.raises(ValueError, match="params"):
    tx = dj.block_coordinate(0.1)
    tx.update({"a": jnp.ones(2)}, tx.init({"a": jnp.ones(2)}))
