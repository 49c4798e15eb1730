"""Gradient compressors (top-k, random-k, QSGD, PowerSGD) and error feedback against NumPy re-implementations of
the papers' rules, closed forms of their expectations and message sizes, and a run through dj.simulate."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.runtime.simulate_reference import numpy_per_contribution, regression_problem


def _tree(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((6, 5)), dtype), "b": jnp.asarray(rng.standard_normal(7), dtype),
          "s": jnp.asarray(rng.standard_normal(()), dtype)}


# --- NumPy references --------------------------------------------------------------------------------------------


def numpy_top_k(g, k):
  """Stich et al.'s top_k on one leaf: the k largest |g_i| kept (ties to the lower index), the rest zero."""
  g = np.asarray(g, np.float64)
  flat = g.ravel()
  keep = np.argsort(-np.abs(flat), kind="stable")[:k]
  out = np.zeros_like(flat)
  out[keep] = flat[keep]
  return out.reshape(g.shape)


def numpy_qsgd(v, u, s):
  """QSGD's Q_s with the uniforms u: l = floor(s|v_i|/||v||), up with probability s|v_i|/||v|| - l."""
  v = np.asarray(v, np.float64)
  norm = np.sqrt(np.sum(v * v))
  if norm == 0:
    return np.zeros_like(v)
  r = np.minimum(np.abs(v) / norm * s, s)
  low = np.floor(r)
  return norm * np.sign(v) * (low + (u < r - low)) / s


def numpy_gram_schmidt(p):
  p = np.array(p, np.float64)
  for i in range(p.shape[1]):
    for j in range(i):
      p[:, i] -= np.dot(p[:, j], p[:, i]) * p[:, j]
    norm = np.linalg.norm(p[:, i])
    p[:, i] /= norm if norm > 0 else 1.0
  return p


def numpy_powersgd_step(m, q):
  """Vogels et al.'s rank-r step: P = M Q, P^ = orth(P), Q <- M^T P^, decoded P^ Q^T."""
  p_hat = numpy_gram_schmidt(m @ q)
  q_new = m.T @ p_hat
  return p_hat @ q_new.T, q_new


# --- top-k -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 0.2, 1.0])
def test_top_k_keeps_the_largest_coordinates_of_each_leaf(k):
  g = _tree(1)
  tx = dj.top_k(k)
  out, _ = jax.jit(tx.update)(g, tx.init(g))
  for name in g:
    size = g[name].size
    kept = min(k, size) if isinstance(k, int) else max(1, math.ceil(k * size))
    np.testing.assert_array_equal(np.asarray(out[name]), numpy_top_k(g[name], kept).astype(np.float32))


def test_top_k_is_a_contraction():
  # ||g - top_k(g)||^2 <= (1 - k/d) ||g||^2 (Stich et al., Definition 2.1)
  g = jnp.asarray(np.random.default_rng(2).standard_normal(50), jnp.float32)
  tx = dj.top_k(5)
  out, _ = tx.update(g, tx.init(g))
  assert float(jnp.sum((g - out) ** 2)) <= (1 - 5 / 50) * float(jnp.sum(g * g))


# --- random-k --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unbiased", [False, True])
def test_random_k_keeps_k_coordinates_scaled_as_documented(unbiased):
  g = _tree(3)
  tx = dj.random_k(4, unbiased=unbiased, seed=5)
  state = tx.init(g)
  for _ in range(3):
    out, state = tx.update(g, state)
    for name in ("w", "b"):
      x, y = np.asarray(g[name]), np.asarray(out[name])
      nz = y != 0
      assert nz.sum() == 4
      scale = x.size / 4 if unbiased else 1.0
      np.testing.assert_allclose(y[nz], x[nz] * scale, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["s"]), np.asarray(g["s"]))  # k >= size: as it is


def test_random_k_draws_uniform_subsets_and_is_unbiased_when_asked():
  d, k, n = 10, 3, 4000
  g = jnp.arange(1.0, d + 1.0)
  tx = dj.random_k(k, unbiased=True, seed=0)

  def step(state, _):
    out, state = tx.update(g, state)
    return state, out

  _, outs = jax.lax.scan(step, tx.init(g), None, length=n)
  outs = np.asarray(outs)
  freq = (outs != 0).mean(axis=0)  # each coordinate kept with probability k / d
  np.testing.assert_allclose(freq, k / d, atol=5 * math.sqrt(k / d * (1 - k / d) / n))
  # E[rand_k(g)] = g with c = d / k; the per-coordinate variance is g_i^2 (d/k - 1).
  tol = 5 * np.asarray(g) * math.sqrt(d / k - 1) / math.sqrt(n)
  np.testing.assert_array_less(np.abs(outs.mean(axis=0) - np.asarray(g)), tol)


def test_random_k_same_seed_same_messages_other_seed_others():
  g = _tree(4)
  runs = []
  for seed in (7, 7, 8):
    tx = dj.random_k(0.3, seed=seed)
    runs.append(np.asarray(tx.update(g, tx.init(g))[0]["w"]))
  np.testing.assert_array_equal(runs[0], runs[1])
  assert not np.array_equal(runs[0], runs[2])


# --- QSGD ------------------------------------------------------------------------------------------------------


def test_qsgd_against_numpy_with_the_same_uniforms():
  g = _tree(5)
  tx = dj.qsgd(levels=3, seed=11)
  out, state = jax.jit(tx.update)(g, tx.init(g))
  # The documented randomness: the state's key is split, leaf i draws uniforms from fold_in(sub, i).
  _, sub = jax.random.split(jax.random.PRNGKey(11))
  leaves, treedef = jax.tree.flatten(g)
  for i, (x, y) in enumerate(zip(leaves, jax.tree.leaves(out))):
    u = np.asarray(jax.random.uniform(jax.random.fold_in(sub, i), x.shape, jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(y), numpy_qsgd(x, u, 3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("levels", [1, 4])
def test_qsgd_values_are_levels_of_the_norm_and_unbiased(levels):
  v_np = np.array([3.0, -1.0, 0.5, 0.0, 2.0], np.float32)
  v = jnp.asarray(v_np)
  norm = float(np.linalg.norm(v_np))
  tx = dj.qsgd(levels)
  n = 4000

  def step(state, _):
    out, state = tx.update(v, state)
    return state, out

  _, outs = jax.lax.scan(step, tx.init(v), None, length=n)
  outs = np.asarray(outs, np.float64)
  code = outs / norm * levels
  np.testing.assert_allclose(code, np.round(code), atol=1e-4)  # on the grid ||v|| {0, +-1/s, ..., +-1}
  assert np.all(np.abs(np.round(code)) <= levels)
  assert np.all(outs[:, 3] == 0) and np.all(np.sign(outs[:, [0, 1, 2, 4]]) * np.sign(v_np[[0, 1, 2, 4]]) >= 0)
  # E[Q_s(v)] = v; each coordinate is two adjacent levels norm/s apart: variance at most (norm / s)^2 / 4.
  tol = 5 * (norm / levels) / 2 / math.sqrt(n)
  np.testing.assert_array_less(np.abs(outs.mean(axis=0) - v_np), tol)


def test_qsgd_leaves_zeros_and_non_finite_leaves_as_they_are():
  tx = dj.qsgd(2)
  zeros = jnp.zeros(4)
  np.testing.assert_array_equal(np.asarray(tx.update(zeros, tx.init(zeros))[0]), np.zeros(4))
  bad = jnp.array([1.0, jnp.nan, 2.0])
  out = np.asarray(tx.update(bad, tx.init(bad))[0])
  assert np.isnan(out[1]) and out[0] == 1.0 and out[2] == 2.0


# --- PowerSGD ---------------------------------------------------------------------------------------------------


def test_powersgd_is_a_warm_started_numpy_power_iteration():
  rng = np.random.default_rng(6)
  params = {"w": jnp.zeros((8, 2, 3), jnp.float32), "b": jnp.zeros(8, jnp.float32)}
  tx = dj.powersgd(rank=2, seed=3)
  state = tx.init(params)
  leaves = jax.tree.leaves(params)
  w_index = [i for i, x in enumerate(leaves) if x.ndim == 3][0]
  q = np.asarray(state.q[w_index], np.float64)
  assert q.shape == (6, 2)
  update = jax.jit(tx.update)
  for _ in range(4):
    g = {"w": jnp.asarray(rng.standard_normal((8, 2, 3)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal(8), jnp.float32)}
    out, state = update(g, state)
    expected, q = numpy_powersgd_step(np.asarray(g["w"], np.float64).reshape(8, 6), q)
    np.testing.assert_allclose(np.asarray(out["w"]).reshape(8, 6), expected, rtol=2e-4, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(g["b"]))  # vectors sent as they are
    np.testing.assert_allclose(np.asarray(state.q[w_index]), q, rtol=2e-4, atol=2e-5)


def test_powersgd_recovers_an_update_of_its_rank_exactly():
  rng = np.random.default_rng(7)
  g = jnp.asarray(rng.standard_normal((9, 2)) @ rng.standard_normal((2, 7)), jnp.float32)
  tx = dj.powersgd(rank=2)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(np.asarray(out), np.asarray(g), rtol=1e-4, atol=1e-4)


def test_powersgd_per_worker_warm_starts_are_separate_runs_interleaved():
  rng = np.random.default_rng(8)
  grads = [jnp.asarray(rng.standard_normal((5, 4)), jnp.float32) for _ in range(6)]
  workers = [0, 1, 1, 0, 1, 0]
  shared = dj.powersgd(1, num_workers=2)
  state = shared.init(grads[0])
  assert dj.worker_capacity(state) == 2
  alone = {m: (dj.powersgd(1), None) for m in (0, 1)}
  alone = {m: (tx, tx.init(grads[0])) for m, (tx, _) in alone.items()}
  for g, m in zip(grads, workers):
    out, state = shared.update(g, state, worker=jnp.int32(m))
    tx, s = alone[m]
    ref, s = tx.update(g, s)
    alone[m] = (tx, s)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_powersgd_zero_update_keeps_the_warm_start():
  tx = dj.powersgd(2)
  g = jnp.asarray(np.random.default_rng(9).standard_normal((4, 5)), jnp.float32)
  state = tx.init(g)
  out, after = tx.update(jnp.zeros_like(g), state)
  np.testing.assert_array_equal(np.asarray(out), np.zeros((4, 5)))
  np.testing.assert_array_equal(np.asarray(after.q[0]), np.asarray(state.q[0]))


# --- error feedback ----------------------------------------------------------------------------------------------


def test_error_feedback_memory_identity_and_numpy_mem_sgd():
  rng = np.random.default_rng(10)
  grads = [_tree(int(s)) for s in rng.integers(0, 1000, 8)]
  tx = dj.error_feedback(dj.top_k(2))
  state = tx.init(grads[0])
  update = jax.jit(tx.update)
  memory = {k: np.zeros(np.shape(v)) for k, v in grads[0].items()}
  sent_sum = {k: np.zeros(np.shape(v)) for k, v in grads[0].items()}
  for g in grads:
    out, state = update(g, state)
    for k in g:
      p = np.asarray(g[k], np.float64) + memory[k]
      sent = numpy_top_k(p, min(2, p.size))
      memory[k] = p - sent
      np.testing.assert_allclose(np.asarray(out[k]), sent, rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(np.asarray(state.memory[k]), memory[k], rtol=1e-5, atol=1e-6)
      sent_sum[k] += np.asarray(out[k], np.float64)
  for k in grads[0]:
    # sum of what was sent = sum of the gradients - what is left in memory
    total = sum(np.asarray(g[k], np.float64) for g in grads)
    np.testing.assert_allclose(sent_sum[k] + np.asarray(state.memory[k]), total, rtol=1e-5, atol=1e-5)


def test_error_feedback_with_an_exact_compressor_is_the_identity():
  g = _tree(12)
  tx = dj.error_feedback(dj.top_k(1.0), num_workers=3)
  out, state = tx.update(g, tx.init(g), worker=jnp.int32(2))
  for k in g:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(g[k]))
    np.testing.assert_array_equal(np.asarray(state.memory[k]), np.zeros((3,) + g[k].shape))


def _numpy_ef_top_k_per_contribution(data, schedule, *, lr, k, batch_size, seed):
  """Mem-SGD per worker (Stich et al.): each worker's push is top_k(g + e_m), e_m keeps the rest; the server
  averages the pushes of an update with the num_batches weights."""
  dim = data["x"].shape[1]
  memory = np.zeros((schedule.num_workers, dim + 1))

  def push(m, g, w, w_read):
    p = g + memory[m]
    sent = np.concatenate([numpy_top_k(p[:dim], k), p[dim:]])  # the scalar bias is one coordinate: kept
    memory[m] = p - sent
    return sent

  return numpy_per_contribution(data, schedule, push, lr=lr, batch_size=batch_size, seed=seed), memory


@pytest.mark.parametrize("paradigm", ["bsp", "k_async"])
def test_each_workers_push_compressed_with_its_memory_through_simulate(paradigm):
  data, loss_fn, params = regression_problem()
  kind = dj.cluster.bsp() if paradigm == "bsp" else dj.cluster.k_async(2)
  schedule = dj.cluster.simulate(kind, dj.cluster.workers(3, compute="exponential"), num_updates=25, seed=5)
  tx = optax.chain(dj.per_contribution(dj.error_feedback(dj.top_k(1), num_workers=3)), optax.sgd(0.05))
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=8), seed=6)
  expected, memory = _numpy_ef_top_k_per_contribution(data, schedule, lr=0.05, k=1, batch_size=8, seed=6)
  got = np.concatenate([np.asarray(result.params["w"]), np.asarray(result.params["b"])[None]])
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(result.opt_state[0].inner.memory["w"]), memory[:, :3], rtol=2e-4, atol=1e-5)


# --- message sizes, composition, bad inputs ----------------------------------------------------------------------


def test_message_bytes_closed_forms():
  params = {"w": jax.ShapeDtypeStruct((64, 128), jnp.float32), "b": jax.ShapeDtypeStruct((128,), jnp.float32),
            "h": jax.ShapeDtypeStruct((10, 4), jnp.bfloat16)}
  assert dj.message_bytes(params) == 64 * 128 * 4 + 128 * 4 + 40 * 2
  assert dj.message_bytes(params, dj.top_k(3)) == 3 * (4 + 4) * 2 + 3 * (2 + 4)
  assert dj.message_bytes(params, dj.top_k(0.01)) == 82 * 8 + 2 * 8 + 1 * 6
  assert dj.message_bytes(params, dj.random_k(3)) == 8 + 3 * 4 * 2 + 3 * 2
  # QSGD, s = 4: a sign and ceil(log2 5) = 3 level bits per coordinate, and a float32 norm per leaf
  assert dj.message_bytes(params, dj.qsgd(4)) == sum(4 + math.ceil(n * 4 / 8) for n in (8192, 128, 40))
  # PowerSGD rank 2: (n + m) r numbers per matrix; the bias dense; the 10 x 4 leaf: (10 + 4) * 2 = 28 < 40
  assert dj.message_bytes(params, dj.powersgd(2)) == (64 + 128) * 2 * 4 + 128 * 4 + (10 + 4) * 2 * 2
  assert dj.message_bytes(params, dj.error_feedback(dj.powersgd(2), num_workers=4)) == \
      dj.message_bytes(params, dj.powersgd(2))


def test_compressors_compose_in_chains_keep_dtypes_and_repeat_bit_for_bit():
  g = _tree(13, jnp.bfloat16)
  for make in (lambda: dj.top_k(2), lambda: dj.random_k(2), lambda: dj.qsgd(2),
               lambda: dj.powersgd(2), lambda: dj.error_feedback(dj.qsgd(2), num_workers=2)):
    outs = []
    for _ in range(2):
      tx = optax.chain(make(), optax.sgd(0.1))
      state = tx.init(g)

      def step(state, _):
        out, state = tx.update(g, state, g, worker=jnp.int32(1), staleness=jnp.int32(0), unknown=1.0)
        return state, out

      _, out = jax.lax.scan(step, state, None, length=3)
      outs.append(out)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
      assert a.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("make, error, match", [
    (lambda: dj.top_k(0), ValueError, "k must be"),
    (lambda: dj.top_k(-2), ValueError, "k must be"),
    (lambda: dj.top_k(1.5), ValueError, "k must be"),
    (lambda: dj.top_k(0.0), ValueError, "k must be"),
    (lambda: dj.top_k(True), TypeError, "k must be"),
    (lambda: dj.random_k("3"), TypeError, "k must be"),
    (lambda: dj.random_k(2, unbiased="yes"), TypeError, "unbiased"),
    (lambda: dj.random_k(2, seed=-1), ValueError, "seed"),
    (lambda: dj.qsgd(0), ValueError, "levels"),
    (lambda: dj.qsgd(2.5), TypeError, "levels"),
    (lambda: dj.powersgd(0), ValueError, "rank"),
    (lambda: dj.powersgd(2, num_workers=0), ValueError, "num_workers"),
    (lambda: dj.error_feedback("top_k"), TypeError, "compressor"),
    (lambda: dj.error_feedback(dj.top_k(1), num_workers=0), ValueError, "num_workers"),
    (lambda: dj.message_bytes({"w": jnp.zeros(3)}, optax.sgd(0.1)), TypeError, "compressor"),
])
def test_bad_inputs_name_the_argument(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_per_worker_states_refuse_a_missing_or_out_of_range_worker():
  g = jnp.ones((4, 3))
  for tx in (dj.error_feedback(dj.top_k(1), num_workers=2), dj.powersgd(1, num_workers=2)):
    state = tx.init(g)
    with pytest.raises(ValueError, match="worker"):
      tx.update(g, state)
    with pytest.raises(ValueError, match="worker"):
      tx.update(g, state, worker=2)
  with pytest.raises(TypeError, match="floating"):
    tx = dj.top_k(1)
    tx.update(jnp.arange(3), tx.init(jnp.arange(3)))


def test_updates_of_other_shapes_than_the_state_are_refused():
  ef = dj.error_feedback(dj.top_k(1))
  with pytest.raises(ValueError, match="updates"):
    ef.update(jnp.ones(4), ef.init(jnp.ones(3)))
  ps = dj.powersgd(1)
  with pytest.raises(ValueError, match="updates"):
    ps.update(jnp.ones((4, 5)), ps.init(jnp.ones((4, 6))))


@pytest.mark.standard_promotion  # MultiSteps divides by its int32 step count
def test_wrapped_by_inject_hyperparams_and_multisteps():
  g = _tree(14)

  def make(learning_rate):
    return optax.chain(dj.error_feedback(dj.powersgd(2, num_workers=2), num_workers=2), optax.sgd(learning_rate))

  plain = make(0.1)
  injected = optax.inject_hyperparams(make)(learning_rate=0.1)
  a, _ = plain.update(g, plain.init(g), worker=jnp.int32(1))
  b, _ = injected.update(g, injected.init(g), worker=jnp.int32(1))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  multi = optax.MultiSteps(make(0.1), every_k_schedule=2)
  state = multi.init(g)
  out, state = multi.update(g, state, worker=jnp.int32(0))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))  # the first of two accumulates
  out, state = multi.update(g, state, worker=jnp.int32(0))
  ref, _ = plain.update(g, plain.init(g), worker=jnp.int32(0))
  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_simulate_refuses_per_worker_tables_smaller_than_the_cluster():
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=5, seed=0)
  for comp in (dj.error_feedback(dj.top_k(1), num_workers=3), dj.powersgd(1, num_workers=3)):
    assert dj.worker_capacity(comp.init(params)) == 3
    tx = optax.chain(dj.per_contribution(comp), optax.sgd(0.1))
    with pytest.raises(ValueError, match="worker"):
      dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=4))
