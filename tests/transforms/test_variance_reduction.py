"""SVRG and SAGA (Johnson & Zhang; Defazio et al.) and their stale-read forms (AsySVRG, ASAGA)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from remedy_checks import assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree  # noqa: E402

LAM = 0.1


def least_squares(n=40, d=4, seed=0):
  """f_i(w) = (a_i.w - b_i)^2 / 2 + LAM |w|^2 / 2, noisy targets so per-sample gradients do not vanish at w*."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((n, d))
  b = a @ rng.standard_normal(d) + rng.standard_normal(n)
  hess = a.T @ a / n + LAM * np.eye(d)
  w_star = np.linalg.solve(hess, a.T @ b / n)
  return a, b, hess, w_star


def np_grad_i(a, b, w, i):
  return a[i] * (a[i] @ w - b[i]) + LAM * w


def np_full_grad(a, b, w):
  return a.T @ (a @ w - b) / len(b) + LAM * w


def jax_grads(a, b):
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)

  def grad_i(w, i):
    return a32[i] * (a32[i] @ w - b32[i]) + jnp.float32(LAM) * w

  def full_grad(w):
    return a32.T @ (a32 @ w - b32) / jnp.float32(len(b)) + jnp.float32(LAM) * w

  return grad_i, full_grad


# ---------------------------------------------------------------- zero delay: textbook algorithms step for step


def test_svrg_matches_the_textbook_algorithm_step_for_step():
  a, b, _, _ = least_squares()
  n, eta, m, epochs = len(b), 0.05, 25, 3
  grad_i, full_grad = jax_grads(a, b)
  rng = np.random.default_rng(1)
  picks = rng.integers(0, n, size=(epochs, m))

  # Johnson & Zhang 2013, Algorithm 1, option I (the snapshot is the last iterate).
  w_ref = np.zeros(a.shape[1])
  ref_path = []
  for s in range(epochs):
    w_snap = w_ref.copy()
    mu = np_full_grad(a, b, w_snap)
    for i in picks[s]:
      w_ref = w_ref - eta * (np_grad_i(a, b, w_ref, i) - np_grad_i(a, b, w_snap, i) + mu)
      ref_path.append(w_ref)

  tx = optax.chain(dj.svrg(), optax.sgd(eta))
  w = jnp.zeros(a.shape[1], jnp.float32)
  state = tx.init(w)
  path = []
  for s in range(epochs):
    for t, i in enumerate(picks[s]):
      extra = {"full_grad": full_grad(w)} if t == 0 else {}
      snap = w if t == 0 else state[0].snapshot
      u, state = tx.update(grad_i(w, i), state, w, snapshot_grad=grad_i(snap, i), **extra)
      w = optax.apply_updates(w, u)
      path.append(w)
  assert int(state[0].num_snapshots) == epochs
  np.testing.assert_allclose(np.asarray(path), np.asarray(ref_path), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_saga_matches_the_textbook_algorithm_step_for_step(batch):
  a, b, _, _ = least_squares()
  n, eta, steps = len(b), 0.03, 120
  grad_i, _ = jax_grads(a, b)
  rng = np.random.default_rng(2)
  picks = rng.integers(0, n, size=(steps, batch))  # with replacement: minibatches repeat indices
  assert any(len(set(p)) < batch for p in picks) or batch == 1

  # Defazio et al. 2014 (minibatch form: the mean over the batch), table started at zero.
  w_ref, alpha = np.zeros(a.shape[1]), np.zeros((n, a.shape[1]))
  ref_path = []
  for p in picks:
    fresh = np.stack([np_grad_i(a, b, w_ref, i) for i in p])
    v = np.mean(fresh - alpha[p], axis=0) + alpha.mean(axis=0)
    for j, i in enumerate(p):
      alpha[i] = fresh[j]
    w_ref = w_ref - eta * v
    ref_path.append(w_ref)

  tx = optax.chain(dj.saga(n), optax.sgd(eta))
  w = jnp.zeros(a.shape[1], jnp.float32)
  state = tx.init(w)
  update = jax.jit(tx.update)
  path = []
  for p in picks:
    sample_grads = jax.vmap(grad_i, in_axes=(None, 0))(w, jnp.asarray(p))
    if batch == 1:
      u, state = update(sample_grads[0], state, w, sample_indices=jnp.int32(p[0]))
    else:
      u, state = update(sample_grads.mean(0), state, w, sample_indices=jnp.asarray(p, jnp.int32),
                        sample_grads=sample_grads)
    w = optax.apply_updates(w, u)
    path.append(w)
  np.testing.assert_allclose(np.asarray(path), np.asarray(ref_path), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state[0].table), alpha, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state[0].table_sum), alpha.sum(0), rtol=1e-4, atol=1e-4)


def test_saga_scalar_table_matches_full_table_saga_on_logistic_regression():
  rng = np.random.default_rng(3)
  n, d, eta, batch, steps = 30, 3, 0.2, 3, 80
  x = rng.standard_normal((n, d))
  y = np.sign(rng.standard_normal(n))
  picks = rng.integers(0, n, size=(steps, batch))

  def np_scalar(w, i):  # d/dz log(1 + exp(-y z)) at z = x_i.w
    return -y[i] / (1.0 + np.exp(y[i] * (x[i] @ w)))

  # SAGA with a table of the data-fit gradients s_i x_i; the L2 term is exact and not tabled.
  w_ref, alpha = np.zeros(d), np.zeros((n, d))
  ref_path = []
  for p in picks:
    fresh = np.stack([np_scalar(w_ref, i) * x[i] for i in p])
    v = np.mean(fresh - alpha[p], axis=0) + alpha.mean(axis=0) + LAM * w_ref
    for j, i in enumerate(p):
      alpha[i] = fresh[j]
    w_ref = w_ref - eta * v
    ref_path.append(w_ref)

  x32, y32 = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  tx = optax.chain(dj.saga(n, table="scalars"), optax.sgd(eta))
  w = jnp.zeros(d, jnp.float32)
  state = tx.init(w)
  assert state[0].table.shape == (n,)  # n numbers, not n x d
  path = []
  for p in picks:
    idx = jnp.asarray(p, jnp.int32)
    s = -y32[idx] * jax.nn.sigmoid(-y32[idx] * (x32[idx] @ w))
    grad = jnp.mean(s[:, None] * x32[idx], axis=0) + jnp.float32(LAM) * w
    u, state = tx.update(grad, state, w, sample_indices=idx, sample_scalars=s, sample_features=x32[idx])
    w = optax.apply_updates(w, u)
    path.append(w)
  np.testing.assert_allclose(np.asarray(path), np.asarray(ref_path), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- stale reads: linear convergence vs the SGD floor


def stale_read_run(method, tau, a, b, eta, epochs, seed=0, after=None):
  """Update t applies a gradient computed at the parameters of version max(t - tau, 0) (stale read).

  ``after`` is chained after the step (a proximal step).
  """
  n, d = a.shape
  steps = epochs * n
  grad_i, full_grad = jax_grads(a, b)
  picks = jnp.asarray(np.random.default_rng(seed).integers(0, n, size=steps), jnp.int32)
  base = {"sgd": optax.identity(), "svrg": dj.svrg(), "saga": dj.saga(n)}[method]
  tx = optax.chain(base, optax.sgd(eta), after or optax.identity())
  w0 = jnp.zeros(d, jnp.float32)

  def body(carry, t):
    hist, state = carry
    w = hist[t]
    w_read = hist[jnp.maximum(t - tau, 0)]
    i = picks[t]
    g = grad_i(w_read, i)
    if method == "svrg":
      refresh = t % n == 0  # an epoch is n updates; the snapshot is the current server parameters
      snap = jnp.where(refresh, w, state[0].snapshot)
      u, state = tx.update(g, state, w, snapshot_grad=grad_i(snap, i), full_grad=full_grad(w), refresh=refresh)
    elif method == "saga":
      u, state = tx.update(g, state, w, sample_indices=i)
    else:
      u, state = tx.update(g, state, w)
    return (hist.at[t + 1].set(optax.apply_updates(w, u)), state), None

  hist = jnp.zeros((steps + 1, d), jnp.float32).at[0].set(w0)
  (hist, _), _ = jax.jit(lambda h: jax.lax.scan(body, (h, tx.init(w0)), jnp.arange(steps)))(hist)
  return np.asarray(hist[-1], np.float64)


@pytest.mark.parametrize("tau", [0, 4, 16])
def test_variance_reduction_converges_linearly_under_stale_reads_where_sgd_stalls(tau):
  a, b, hess, w_star = least_squares(n=100, d=4, seed=4)
  l_max = np.max(np.sum(a * a, axis=1)) + LAM
  eta, epochs = 1.0 / (5.0 * l_max), 30

  def suboptimality(w):  # f(w) - f* exactly, for a quadratic, without cancellation
    e = w - w_star
    return 0.5 * e @ hess @ e

  start = suboptimality(np.zeros(4))
  sgd = suboptimality(stale_read_run("sgd", tau, a, b, eta, epochs))
  svrg = suboptimality(stale_read_run("svrg", tau, a, b, eta, epochs))
  saga = suboptimality(stale_read_run("saga", tau, a, b, eta, epochs))
  # Linear convergence to below 1e-8 (observed: about 1e-11 from 5.5, float32's floor), while
  # constant-step SGD stays at its noise floor (observed: about 3e-2).
  assert svrg < 1e-8 and saga < 1e-8, (svrg, saga, start)
  assert sgd > 1e-3, (sgd, start)


# ---------------------------------------------------------------- contract: jit, chain, extra arguments, dtypes


def _tree_batch(tree, b):
  return jax.tree.map(lambda x: jnp.stack([x * (k + 1) for k in range(b)]), tree)


def test_jit_traces_once_and_composes():
  params = params_tree()
  like = jax.tree.map(lambda p: 0.5 * p, params)
  svrg_extra = lambda i: {"snapshot_grad": like, "full_grad": params, "refresh": jnp.asarray(i == 0)}  # noqa: E731
  assert_jit_traces_once(dj.svrg(), params, svrg_extra)
  assert_chain_and_unknown_extra_args(dj.svrg(), params, svrg_extra(0))
  saga_extra = lambda i: {"sample_indices": jnp.array([i, 4], jnp.int32), "sample_grads": _tree_batch(like, 2)}  # noqa: E731
  assert_jit_traces_once(dj.saga(5), params, saga_extra)
  assert_chain_and_unknown_extra_args(dj.saga(5), params, saga_extra(1))
  scalar_extra = lambda i: {"sample_indices": jnp.array([i, 4], jnp.int32),  # noqa: E731
                            "sample_scalars": jnp.array([1.0, -2.0]), "sample_features": _tree_batch(like, 2)}
  assert_jit_traces_once(dj.saga(5, table="scalars"), params, scalar_extra)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), params_tree())
  cases = [
      (dj.svrg(), {"snapshot_grad": params, "full_grad": params}),
      (dj.saga(3), {"sample_indices": jnp.array([0, 2], jnp.int32), "sample_grads": _tree_batch(params, 2)}),
      (dj.saga(3, table="scalars"), {"sample_indices": jnp.array([0, 2], jnp.int32),
                                     "sample_scalars": jnp.array([1.0, 2.0]), "sample_features": _tree_batch(params, 2)}),
  ]
  for tx, extra in cases:
    state = tx.init(params)
    for _ in range(2):
      u, state = tx.update(params, state, params, **extra)
      assert all(x.dtype == dtype for x in jax.tree.leaves(u))


def test_states_request_their_inputs():
  w = jnp.zeros(2)
  assert dj.runtime_inputs(optax.chain(dj.svrg(), optax.sgd(0.1)).init(w)) == ("full_grad", "snapshot_grad")
  assert dj.runtime_inputs(dj.saga(3).init(w)) == ("sample_grads", "sample_indices", "sample_mask")
  assert dj.runtime_inputs(dj.saga(3, table="scalars").init(w)) == (
      "sample_features", "sample_indices", "sample_mask", "sample_scalars")


@pytest.mark.parametrize("table", ["gradients", "scalars"])
def test_saga_mask_equals_leaving_the_entries_out(table):
  """Masked entries are neither read nor written: the same as a minibatch without them."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal(3), jnp.float32)
  tx = dj.saga(6, table=table)
  full_idx = jnp.array([1, 4, 1, 2, 4], jnp.int32)  # repeats, one of them masked as the last occurrence
  mask = jnp.array([True, False, True, True, False])
  keep = np.flatnonzero(np.asarray(mask))
  state_a = state_b = tx.init(w)
  for _ in range(3):
    grads = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    scalars = jnp.asarray(rng.standard_normal(5), jnp.float32)
    g = jnp.asarray(rng.standard_normal(3), jnp.float32)
    extra = ({"sample_grads": grads} if table == "gradients" else {"sample_scalars": scalars, "sample_features": grads})
    u_a, state_a = tx.update(g, state_a, w, sample_indices=full_idx, sample_mask=mask, **extra)
    u_b, state_b = tx.update(g, state_b, w, sample_indices=full_idx[keep], **jax.tree.map(lambda x: x[keep], extra))
    np.testing.assert_allclose(u_a, u_b, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- bad input


def test_svrg_bad_input():
  w = jnp.zeros(3)
  tx = dj.svrg()
  state = tx.init(w)
  with pytest.raises(ValueError, match="snapshot_grad="):
    tx.update(w, state, w)
  with pytest.raises(ValueError, match="no full gradient yet"):
    tx.update(w, state, w, snapshot_grad=w)
  with pytest.raises(ValueError, match="refresh= without full_grad="):
    tx.update(w, state, w, snapshot_grad=w, refresh=True)
  with pytest.raises(ValueError, match="snapshot_grad must have the structure"):
    tx.update(w, state, w, snapshot_grad={"w": w}, full_grad=w)
  with pytest.raises(ValueError, match="full_grad leaves must have the shapes"):
    tx.update(w, state, w, snapshot_grad=w, full_grad=jnp.zeros(2))
  with pytest.raises(ValueError, match="needs params when full_grad"):
    tx.update(w, state, snapshot_grad=w, full_grad=w)
  with pytest.raises(ValueError, match="refresh must be a bool scalar"):
    tx.update(w, state, w, snapshot_grad=w, full_grad=w, refresh=jnp.ones(2, jnp.bool_))
  # Under jit the missing first snapshot cannot raise; it shows as NaN instead of a silently biased step.
  u, _ = jax.jit(lambda s: tx.update(w, s, w, snapshot_grad=w))(state)
  assert np.all(np.isnan(np.asarray(u)))


def test_saga_bad_input():
  for bad, err in ((0, ValueError), (2.5, TypeError), (True, TypeError)):
    with pytest.raises(err, match="num_samples"):
      dj.saga(bad)
  with pytest.raises(ValueError, match="table must be one of"):
    dj.saga(3, table="dense")
  w = jnp.zeros(2)
  tx = dj.saga(3)
  state = tx.init(w)
  with pytest.raises(ValueError, match="sample_indices="):
    tx.update(w, state, w)
  for idx in (3, -1, jnp.array([0, 5])):
    with pytest.raises(ValueError, match=r"sample_indices must be in \[0, num_samples\) = \[0, 3\)"):
      tx.update(w, state, w, sample_indices=idx)
  with pytest.raises(TypeError, match="sample_indices must be integers"):
    tx.update(w, state, w, sample_indices=jnp.array([0.0]))
  with pytest.raises(ValueError, match="sample_grads="):
    tx.update(w, state, w, sample_indices=jnp.array([0, 1]))
  with pytest.raises(ValueError, match=r"sample_grads leaves must have shape \[len\(sample_indices\)"):
    tx.update(w, state, w, sample_indices=jnp.array([0, 1]), sample_grads=jnp.zeros((3, 2)))
  scalars = dj.saga(3, table="scalars")
  s_state = scalars.init(w)
  with pytest.raises(ValueError, match="sample_scalars="):
    scalars.update(w, s_state, w, sample_indices=0)
  with pytest.raises(ValueError, match="sample_features="):
    scalars.update(w, s_state, w, sample_indices=0, sample_scalars=1.0)
  with pytest.raises(ValueError, match=r"sample_scalars must have shape"):
    scalars.update(w, s_state, w, sample_indices=jnp.array([0, 1]), sample_scalars=jnp.ones(3),
                   sample_features=jnp.ones((2, 2)))
  with pytest.raises(TypeError, match=r"sample_mask must be a bool array, got dtype int32"):
    tx.update(w, state, w, sample_indices=0, sample_mask=jnp.array([1]))
  with pytest.raises(ValueError, match=r"sample_mask must have shape \[len\(sample_indices\)\] = \(2,\); got \(3,\)"):
    tx.update(w, state, w, sample_indices=jnp.array([0, 1]), sample_grads=jnp.zeros((2, 2)),
              sample_mask=jnp.ones(3, bool))


# ---------------------------------------------------------------- proximal forms: Prox-SVRG, ProxSAGA under stale reads


def elastic_net_problem():
  a, b, hess, _ = least_squares(n=100, d=4, seed=4)
  l1 = float(np.median(np.abs(a.T @ b / len(b))))
  lip = np.linalg.eigvalsh(hess)[-1]
  w = np.zeros(a.shape[1])
  for _ in range(5000):  # ISTA in float64: a contraction with factor about 1 - mu / L per iteration
    z = w - np_full_grad(a, b, w) / lip
    w = np.sign(z) * np.maximum(np.abs(z) - l1 / lip, 0.0)
  return a, b, l1, w


@pytest.mark.parametrize("tau", [0, 16])
def test_proximal_variance_reduction_reaches_the_elastic_net_optimum_under_stale_reads(tau):
  a, b, l1, w_star = elastic_net_problem()
  # The optimum is sparse but not zero, and satisfies the optimality conditions of F + l1 |w|_1.
  grad = np_full_grad(a, b, w_star)
  zero = w_star == 0
  assert 0 < zero.sum() < len(w_star)
  np.testing.assert_allclose(grad[~zero], -l1 * np.sign(w_star[~zero]), atol=1e-12)
  assert np.all(np.abs(grad[zero]) <= l1)

  def objective(w):
    return 0.5 * np.mean((a @ w - b) ** 2) + 0.5 * LAM * w @ w + l1 * np.abs(w).sum()

  eta = 1.0 / (5.0 * (np.max(np.sum(a * a, axis=1)) + LAM))
  after = dj.proximal(dj.prox_l1(l1), eta)
  for method in ("svrg", "saga"):
    w = stale_read_run(method, tau, a, b, eta, 30, after=after)
    assert objective(w) - objective(w_star) < 1e-8, method
    np.testing.assert_array_equal(w[zero], 0.0)  # soft thresholding gives exact zeros
  sgd = stale_read_run("sgd", tau, a, b, eta, 30, after=after)
  assert objective(sgd) - objective(w_star) > 1e-3
