"""ProxASAGA (Pedregosa, Leblond & Lacoste-Julien 2017): the sparse proximal SAGA update, also under stale reads."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax import problems

L1, L2 = 0.02, 0.05


def sparse_problem(n=40, d=12, k=3, seed=0):
  """A sparse logistic problem whose L2 term lives in the prox (lam = 0 in the smooth part)."""
  return problems.make_sparse("logistic", n, d, k, lam=0.0, seed=seed)


def np_prox(z, step, l1, l2):
  return np.sign(z) * np.maximum(np.abs(z) - step * l1, 0.0) / (1.0 + step * l2)


def reference_path(p, picks, delays, gamma, l1, l2):
  """Algorithm 1 of the paper, sequentially, with the read of update t at version t - delays[t], in NumPy.

  Dense indexing throughout (supports as boolean masks), so it shares nothing with the padded-CSR code.
  """
  x = problems.to_dense(p.indices, p.values, p.num_features) if p.sparse else p.features
  n, d = x.shape
  support = x != 0
  counts = support.sum(axis=0)
  dw = np.where(counts > 0, n / np.maximum(counts, 1), 0.0)
  alpha, alpha_bar = np.zeros(n), np.zeros(d)
  history = [np.zeros(d)]
  for t, (i, tau) in enumerate(zip(picks, delays)):
    w_hat = history[t - min(int(tau), t)]
    z = x[i] @ w_hat
    s = -p.targets[i] / (1.0 + np.exp(p.targets[i] * z))
    v = (s - alpha[i]) * x[i] + dw * alpha_bar
    dx = np.where(support[i], np_prox(w_hat - gamma * v, gamma * dw, l1, l2) - w_hat, 0.0)
    alpha_bar = alpha_bar + (s - alpha[i]) * x[i] / n
    alpha[i] = s
    history.append(history[-1] + dx)
  return np.array(history[1:])


def scalar_at(p, w, i):
  """s_i = phi'(a_i.w, y_i) in w's dtype, and sample i's padded CSR row (None for a dense problem)."""
  row = jax.tree.map(lambda a: a[i], p.data(w.dtype))
  s = p.per_sample(w, jax.tree.map(lambda a: a[None], row)).scalars[0]
  return s, ((row["indices"], row["values"]) if p.sparse else None)


def run(p, tx, picks, delays, dtype):
  """The transformation under explicit stale reads, in one jitted lax.scan; returns every iterate."""
  d, ring = p.num_features, int(max(delays)) + 1

  def step(carry, pick):
    w, state, buf, t = carry
    i, tau = pick
    w_hat = buf[(t - jnp.minimum(tau, t)) % ring]
    s, row = scalar_at(p, w_hat, i)
    u, state = tx.update(jnp.zeros_like(w), state, w, sample_indices=i, sample_scalars=s, sample_features=row,
                         stale_params=w_hat)
    w = optax.apply_updates(w, u)
    return (w, state, buf.at[(t + 1) % ring].set(w), t + 1), w

  w0 = jnp.zeros(d, dtype)
  init = (w0, tx.init(w0), jnp.zeros((ring, d), dtype), jnp.int32(0))
  picks = (jnp.asarray(picks, jnp.int32), jnp.asarray(delays, jnp.int32))
  return np.asarray(jax.jit(lambda c, x: jax.lax.scan(step, c, x))(init, picks)[1])


def picks_and_delays(n, steps, tau, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, n, steps), rng.integers(0, tau + 1, steps)


# ---------------------------------------------------------------- the paper's rule, step for step


@pytest.mark.parametrize("tau", [0, 3])
def test_matches_the_papers_sparse_algorithm_step_for_step(tau):
  p = sparse_problem()
  assert p.support_counts().min() < p.num_samples // 2  # genuinely sparse: d_j well above 1
  picks, delays = picks_and_delays(p.num_samples, 120, tau)
  gamma = 0.5
  expected = reference_path(p, picks, delays, gamma, L1, L2)
  with jax.enable_x64(True):
    tx = dj.prox_asaga(p.num_samples, gamma, dj.prox_elastic_net(L1, L2), support_counts=p.support_counts())
    got = run(p, tx, picks, delays, jnp.float64)
  np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
  assert np.any(expected[-1] == 0.0) and np.any(expected[-1] != 0.0)  # the prox does threshold some coordinates


def test_stale_reads_change_the_path():
  p = sparse_problem()
  picks, delays = picks_and_delays(p.num_samples, 60, 3)
  stale = reference_path(p, picks, delays, 0.5, L1, L2)
  fresh = reference_path(p, picks, np.zeros_like(delays), 0.5, L1, L2)
  assert np.abs(stale[-1] - fresh[-1]).max() > 1e-3  # so the stale-read comparison above tests something


def test_with_full_supports_it_is_dense_prox_saga():
  p = problems.make_dense("logistic", 15, 4, lam=0.0, seed=2)
  sparse = problems.FiniteSum("logistic", targets=p.targets, lam=0.0, num_features=4,
                              **dict(zip(("indices", "values"), problems.to_sparse(p.features))))
  np.testing.assert_array_equal(sparse.support_counts(), np.full(4, 15))
  gamma, prox = 0.3, dj.prox_elastic_net(L1, L2)
  tx = dj.prox_asaga(15, gamma, prox, support_counts=sparse.support_counts())
  dense = optax.chain(dj.saga(15, table="scalars"), optax.sgd(gamma), dj.proximal(prox, gamma))
  x = jnp.asarray(p.features, jnp.float32)
  w = v = jnp.zeros(4, jnp.float32)
  s_sparse, s_dense = tx.init(w), dense.init(v)
  for i in np.random.default_rng(0).integers(0, 15, 40):
    s, row = scalar_at(sparse, w, i)
    u, s_sparse = tx.update(jnp.zeros_like(w), s_sparse, w, sample_indices=i, sample_scalars=s, sample_features=row)
    w = w + u
    s_v = scalar_at(p, v, i)[0]
    u, s_dense = dense.update(s_v * x[i], s_dense, v, sample_indices=i, sample_scalars=s_v, sample_features=x[i])
    v = v + u
    np.testing.assert_allclose(w, v, rtol=2e-5, atol=1e-6)
  assert float(jnp.abs(w).max()) > 0.05


# ---------------------------------------------------------------- convergence to the composite optimum


def composite_optimum(p, l1, l2):
  """Proximal gradient descent in float64 NumPy to a fixed point: argmin F(w) + l1 |w|_1 + l2 |w|^2 / 2."""
  step = 1.0 / p.smoothness().l
  w = np.zeros(p.num_features)
  for _ in range(20_000):
    new = np_prox(w - step * p.gradient(w), step, l1, l2)
    if np.abs(new - w).max() < 1e-15:
      break
    w = new
  return new


@pytest.mark.parametrize("tau", [0, 4])
def test_converges_to_the_composite_optimum(tau):
  p = sparse_problem(n=60, d=15, k=3, seed=1)
  w_star = composite_optimum(p, L1, L2)
  assert np.sum(w_star == 0) >= 1 and np.sum(w_star != 0) >= 3
  gamma = 1.0 / (3 * p.smoothness().l_max)
  picks, delays = picks_and_delays(p.num_samples, 150 * p.num_samples, tau, seed=3)
  with jax.enable_x64(True):
    tx = dj.prox_asaga(p.num_samples, gamma, dj.prox_elastic_net(L1, L2), support_counts=p.support_counts())
    path = run(p, tx, picks, delays, jnp.float64)
  np.testing.assert_allclose(path[-1], w_star, atol=1e-9)
  np.testing.assert_array_equal(path[-1] == 0, w_star == 0)  # the same sparsity pattern, exact zeros
  early = np.abs(path[10 * p.num_samples] - w_star).max()
  assert early > 1e3 * np.abs(path[-1] - w_star).max()  # it got there by converging, not by starting there


# ---------------------------------------------------------------- the Optax contract (params are one vector)


def contract_setup():
  p = sparse_problem()
  w = jnp.asarray(np.random.default_rng(0).standard_normal(p.num_features) * 0.1, jnp.float32)

  def extras(t, w):
    i = jnp.int32(t % p.num_samples)
    s, row = scalar_at(p, w, i)
    return {"sample_indices": i, "sample_scalars": s, "sample_features": row}

  return p, w, extras


def make(p, learning_rate=0.5):
  return dj.prox_asaga(p.num_samples, learning_rate, dj.prox_l1(L1), support_counts=p.support_counts())


def test_jit_scan_and_no_recompilation():
  p, w0, extras = contract_setup()
  tx = make(p)

  def body(carry, t):
    w, state = carry
    u, state = tx.update(jnp.zeros_like(w), state, w, **extras(t, w))
    return (optax.apply_updates(w, u), state), None

  scanned = jax.jit(lambda w: jax.lax.scan(body, (w, tx.init(w)), jnp.arange(30))[0][0])(w0)
  w, state = w0, tx.init(w0)
  for t in range(30):
    (w, state), _ = body((w, state), t)
  np.testing.assert_allclose(scanned, w, rtol=1e-6, atol=1e-7)
  update = jax.jit(tx.update)
  state = tx.init(w0)
  for t in range(3):
    _, state = update(w0, state, w0, **extras(t, w0))
  assert update._cache_size() == 1
  assert int(state.count) == 3


def test_unknown_extra_arguments_are_ignored():
  p, w, extras = contract_setup()
  tx = make(p)
  a, _ = tx.update(w, tx.init(w), w, **extras(1, w))
  b, _ = tx.update(w, tx.init(w), w, **extras(1, w), staleness=jnp.int32(2), worker=jnp.int32(0), other=3)
  np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(a).max()) > 0
  chained = optax.chain(optax.identity(), tx)
  c, _ = chained.update(w, chained.init(w), w, **extras(1, w))
  np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved(dtype):
  p, w, extras = contract_setup()
  w = w.astype(dtype)
  tx = make(p)
  state = tx.init(w)
  assert state.table.dtype == jnp.float32
  for t in range(2):
    u, state = tx.update(w, state, w, **extras(t, w))
    assert u.dtype == dtype
    w = w + u


@pytest.mark.standard_promotion  # MultiSteps and inject_hyperparams mix int32 and floats
def test_inject_hyperparams_and_multisteps_wrap_it():
  p, w0, extras = contract_setup()
  injected = optax.inject_hyperparams(lambda learning_rate: make(p, learning_rate))(learning_rate=0.5)
  plain = make(p, 0.5)
  for tx_a, tx_b in ((injected, plain),):
    wa, wb, sa, sb = w0, w0, tx_a.init(w0), tx_b.init(w0)
    for t in range(5):
      ua, sa = tx_a.update(wa, sa, wa, **extras(t, wa))
      ub, sb = tx_b.update(wb, sb, wb, **extras(t, wb))
      wa, wb = wa + ua, wb + ub
    np.testing.assert_allclose(wa, wb, rtol=1e-6)
  multi = optax.MultiSteps(plain, every_k_schedule=2)
  state = multi.init(w0)
  u1, state = multi.update(w0, state, w0, **extras(0, w0))
  np.testing.assert_array_equal(u1, np.zeros_like(u1))
  u2, _ = multi.update(w0, state, w0, **extras(1, w0))
  direct, _ = plain.update(w0, plain.init(w0), w0, **extras(1, w0))
  np.testing.assert_allclose(u2, direct, rtol=1e-6)


def test_a_learning_rate_schedule_indexes_the_update_count():
  p, w, extras = contract_setup()
  tx = make(p, optax.constant_schedule(0.5))
  a, _ = tx.update(w, tx.init(w), w, **extras(2, w))
  b, _ = make(p, 0.5).update(w, tx.init(w), w, **extras(2, w))
  np.testing.assert_array_equal(a, b)


def test_the_state_asks_the_runtime_for_its_inputs():
  p, w, _ = contract_setup()
  assert set(dj.runtime_inputs(make(p).init(w))) == {"sample_features", "sample_indices", "sample_mask",
                                                     "sample_scalars"}


def test_a_masked_sample_changes_nothing():
  p, w, extras = contract_setup()
  tx = make(p)
  state = tx.init(w)
  _, state = tx.update(w, state, w, **extras(0, w))  # a nonzero table, so a write would show
  for t in (1, 2):
    out, masked = tx.update(w, state, w, sample_mask=jnp.array([False]), **extras(t, w))
    np.testing.assert_array_equal(np.asarray(out), np.zeros_like(np.asarray(w)))
    for a, b in zip(jax.tree.leaves(masked), jax.tree.leaves(state)):
      if a.shape:  # the tables; the count still counts the update
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kept, _ = tx.update(w, state, w, sample_mask=jnp.array([True]), **extras(t, w))
    unmasked, _ = tx.update(w, state, w, **extras(t, w))
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(unmasked))
    assert np.any(np.asarray(kept) != 0)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_samples=0), ValueError, "num_samples must be an integer >= 1"),
    (dict(learning_rate=0.0), ValueError, "learning_rate must be > 0"),
    (dict(prox=0.1), TypeError, "prox must be a callable"),
    (dict(support_counts=np.array([1.0, 2.0])), TypeError, "support_counts must be integers"),
    (dict(support_counts=np.array([[1, 2]])), ValueError, "support_counts must have shape \\[d\\]"),
    (dict(support_counts=np.array([1, 5])), ValueError, "support_counts must be in \\[0, num_samples\\] = \\[0, 4\\]"),
])
def test_bad_construction_is_refused(kwargs, error, match):
  args = dict(num_samples=4, learning_rate=0.1, prox=dj.prox_l1(0.1), support_counts=np.array([1, 2]))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    dj.prox_asaga(**args)


def test_bad_updates_are_refused():
  tx = dj.prox_asaga(4, 0.1, dj.prox_l1(0.1), support_counts=np.array([1, 2, 0]))
  w = jnp.zeros(3)
  state = tx.init(w)
  row = (jnp.array([0, 1]), jnp.array([1.0, 2.0]))
  good = dict(sample_indices=1, sample_scalars=0.5, sample_features=row)
  cases = [
      (dict(good, sample_indices=4), ValueError, "sample_indices must be in \\[0, num_samples\\) = \\[0, 4\\), got 4"),
      (dict(good, sample_indices=jnp.array([0, 1])), ValueError, "one sample per update"),
      (dict(good, sample_indices=1.0), TypeError, "sample_indices must be an integer"),
      (dict(good, sample_features=(jnp.array([0, 3]), jnp.array([1.0, 2.0]))), ValueError,
       "indices must be in \\[0, d\\) = \\[0, 3\\)"),
      (dict(good, sample_features=(jnp.array([1, 1]), jnp.array([1.0, 2.0]))), ValueError, "distinct indices"),
      (dict(good, sample_features=(jnp.array([0, 2]), jnp.array([1.0, 2.0]))), ValueError,
       "features \\[2\\] whose support_counts are 0"),
      (dict(good, sample_features=(jnp.array([0]), jnp.array([1.0, 2.0]))), ValueError, "must both have shape"),
      (dict(good, sample_features=jnp.ones(3)), TypeError, "sample_features must be a pair"),
      (dict(good, sample_scalars=None), ValueError, "prox_asaga needs the extra argument sample_scalars="),
      (dict(good, stale_params=jnp.zeros(4)), ValueError, "stale_params must be an array of shape \\[d\\] = \\(3,\\)"),
  ]
  for kwargs, error, match in cases:
    with pytest.raises(error, match=match):
      tx.update(w, state, w, **kwargs)
  with pytest.raises(ValueError, match="prox_asaga needs params"):
    tx.update(w, state, **good)
  with pytest.raises(ValueError, match="params must be an array of shape \\[d\\] = \\(3,\\)"):
    tx.update({"w": w}, state, {"w": w}, **good)
  # Padding slots (value 0) may repeat any index, even one no sample has.
  u, _ = tx.update(w, state, w, **dict(good, sample_features=(jnp.array([1, 2, 2]), jnp.array([2.0, 0.0, 0.0]))))
  assert float(u[0]) == 0.0 and float(u[2]) == 0.0 and float(u[1]) != 0.0
