"""dj.problems: finite sums, their float64 Newton optimum and its cache, dense and padded-sparse features."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from delayjax import problems

KINDS = ("logistic", "least_squares")


def with_zeros(kind, seed=0, n=30, d=6):
  """A dense problem with many exact zeros (rows of different lengths, one empty row) and its sparse twin."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)) * (rng.random((n, d)) < 0.4)
  x[3] = 0.0
  y = np.where(rng.random(n) < 0.5, -1.0, 1.0) if kind == "logistic" else rng.standard_normal(n)
  dense = problems.FiniteSum(kind, targets=y, lam=0.05, features=x)
  indices, values = problems.to_sparse(x)
  sparse = problems.FiniteSum(kind, targets=y, lam=0.05, indices=indices, values=values, num_features=d)
  return dense, sparse


# ---------------------------------------------------------------- the optimum


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", ["dense", "sparse"])
def test_newton_reaches_a_gradient_below_1e_10(kind, make):
  p = (problems.make_dense(kind, 300, 12, lam=1e-3, seed=1) if make == "dense"
       else problems.make_sparse(kind, 300, 40, 5, lam=1e-3, seed=1))
  opt = problems.optimum(p, cache=False)
  assert np.linalg.norm(p.gradient(opt.w)) < 1e-10
  assert opt.value == pytest.approx(p.value(opt.w), rel=0, abs=0)
  # A minimum: every nearby point is higher.
  rng = np.random.default_rng(0)
  assert all(p.value(opt.w + 1e-3 * rng.standard_normal(p.num_features)) > opt.value for _ in range(5))


def test_least_squares_optimum_is_the_normal_equations_solution():
  p = problems.make_dense("least_squares", 200, 8, lam=0.01, seed=3)
  x, y = p.features, p.targets
  w_closed = np.linalg.solve(x.T @ x / 200 + 0.01 * np.eye(8), x.T @ y / 200)
  opt = problems.optimum(p, cache=False)
  np.testing.assert_allclose(opt.w, w_closed, rtol=1e-12, atol=1e-14)
  lstsq = np.linalg.lstsq(np.vstack([x / np.sqrt(200), np.sqrt(0.01) * np.eye(8)]),
                          np.concatenate([y / np.sqrt(200), np.zeros(8)]), rcond=None)[0]
  np.testing.assert_allclose(opt.w, lstsq, rtol=1e-10)


def test_suboptimality_is_zero_at_the_optimum_and_the_quadratic_form_away_from_it():
  p = problems.make_dense("least_squares", 100, 5, lam=0.1, seed=0)
  opt = problems.optimum(p, cache=False)
  assert problems.suboptimality(p, opt.w, solution=opt) == 0.0
  e = np.full(5, 1e-3)
  expected = p.value(opt.w + e) - opt.value
  assert problems.suboptimality(p, opt.w + e, solution=opt) == pytest.approx(expected, rel=1e-6)
  q = problems.make_dense("logistic", 100, 5, lam=0.1, seed=0)
  q_opt = problems.optimum(q, cache=False)
  assert problems.suboptimality(q, np.zeros(5), solution=q_opt) == pytest.approx(np.log(2) - q_opt.value)


def test_digits_is_the_bundled_binary_problem():
  pytest.importorskip("sklearn")
  p = problems.digits(lam=1e-4)
  assert (p.num_samples, p.num_features, p.kind) == (1797, 62, "logistic")
  np.testing.assert_allclose(np.linalg.norm(p.features, axis=1), 1.0)
  assert p.smoothness().l_max == pytest.approx(0.25 + 1e-4)
  assert 0.3 < np.mean(p.targets == 1) < 0.7
  assert np.linalg.norm(p.gradient(problems.optimum(p, cache=False).w)) < 1e-10


# ---------------------------------------------------------------- the cache


def test_the_cache_is_read_back_bit_for_bit_without_newton(tmp_path, monkeypatch):
  p = problems.make_sparse("logistic", 80, 10, 3, lam=0.01, seed=0)
  first = problems.optimum(p, cache_dir=tmp_path)
  files = os.listdir(tmp_path)
  assert files == [f"optimum-{problems.cache_key(p)}.npz"]

  def no_newton(problem):
    raise AssertionError("the cached optimum was recomputed")

  monkeypatch.setattr(problems, "_newton", no_newton)
  again = problems.optimum(problems.make_sparse("logistic", 80, 10, 3, lam=0.01, seed=0), cache_dir=tmp_path)
  assert again.w.tobytes() == first.w.tobytes() and again.value == first.value
  # Other data or another lam is another key: it is computed, not read.
  with pytest.raises(AssertionError, match="recomputed"):
    problems.optimum(problems.make_sparse("logistic", 80, 10, 3, lam=0.02, seed=0), cache_dir=tmp_path)


def test_the_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("DELAYJAX_CACHE", str(tmp_path / "here"))
  p = problems.make_dense("least_squares", 20, 3, lam=0.1, seed=0)
  problems.optimum(p)
  assert os.listdir(tmp_path / "here") == [f"optimum-{problems.cache_key(p)}.npz"]


def test_an_unwritable_cache_dir_only_means_no_cache(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  p = problems.make_dense("logistic", 40, 3, lam=0.1, seed=0)
  opt = problems.optimum(p, cache_dir=blocker / "cache")
  assert np.linalg.norm(p.gradient(opt.w)) < 1e-10


def test_a_corrupt_cache_file_is_recomputed(tmp_path):
  p = problems.make_dense("logistic", 40, 3, lam=0.1, seed=0)
  (tmp_path / f"optimum-{problems.cache_key(p)}.npz").write_bytes(b"garbage")
  opt = problems.optimum(p, cache_dir=tmp_path)
  assert np.linalg.norm(p.gradient(opt.w)) < 1e-10


# ---------------------------------------------------------------- the JAX side


@pytest.mark.parametrize("kind", KINDS)
def test_padded_sparse_loss_equals_the_dense_loss(kind):
  dense, sparse = with_zeros(kind)
  assert sparse.indices.shape[1] < dense.num_features  # padded rows, not a dense copy
  np.testing.assert_array_equal(problems.to_dense(sparse.indices, sparse.values, 6), dense.features)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(6), jnp.float32)
  loss = jax.jit(dense.loss_fn)
  for rows in (slice(None), slice(0, 7), 3):  # the whole set, a minibatch, one (empty) row
    d_batch = jax.tree.map(lambda a: a[rows], dense.data())
    s_batch = jax.tree.map(lambda a: a[rows], sparse.data())
    np.testing.assert_allclose(sparse.loss_fn(w, s_batch), loss(w, d_batch), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(sparse.loss_fn)(w, s_batch), jax.grad(dense.loss_fn)(w, d_batch),
                               rtol=1e-5, atol=1e-7)
  assert dense.value(np.asarray(w, np.float64)) == pytest.approx(float(loss(w, dense.data())), rel=1e-6)
  assert sparse.value(np.asarray(w, np.float64)) == pytest.approx(dense.value(np.asarray(w, np.float64)), rel=1e-14)
  np.testing.assert_allclose(sparse.gradient(np.asarray(w, np.float64)), dense.gradient(np.asarray(w, np.float64)),
                             rtol=1e-13, atol=1e-15)
  np.testing.assert_allclose(sparse.hessian(np.asarray(w, np.float64)), dense.hessian(np.asarray(w, np.float64)),
                             rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_per_sample_terms_give_the_per_sample_gradient(kind, form):
  p = dict(zip(("dense", "sparse"), with_zeros(kind)))[form]
  w = jnp.asarray(np.random.default_rng(2).standard_normal(6), jnp.float32)
  batch = jax.tree.map(lambda a: a[:9], p.data())
  terms = p.per_sample(w, batch)
  assert terms.scalars.shape == (9,) and terms.features.shape == (9, 6)
  from_terms = terms.scalars[:, None] * terms.features + jnp.float32(p.lam) * w
  autodiff = jax.vmap(jax.grad(p.loss_fn), in_axes=(None, 0))(w, batch)
  np.testing.assert_allclose(from_terms, autodiff, rtol=1e-5, atol=1e-6)


def test_float64_data_under_x64():
  p = problems.make_dense("logistic", 10, 3, lam=0.1, seed=0)
  with jax.enable_x64(True):
    data = p.data(jnp.float64)
    assert data["x"].dtype == jnp.float64
    w = jnp.asarray([0.3, -0.2, 0.1], jnp.float64)
    assert float(p.loss_fn(w, data)) == pytest.approx(p.value(np.asarray(w)), rel=1e-14)


def test_smoothness_and_strong_convexity_bound_the_hessian():
  for p in (problems.make_dense("least_squares", 50, 4, lam=0.1, seed=0),
            problems.make_sparse("logistic", 50, 8, 3, lam=0.1, seed=0)):
    s, mu = p.smoothness(), p.strong_convexity()
    eig = np.linalg.eigvalsh(p.hessian(np.zeros(p.num_features)))
    assert mu <= eig[0] + 1e-12 and eig[-1] <= s.l + 1e-12 and s.l <= s.l_max
  ls = problems.make_dense("least_squares", 50, 4, lam=0.1, seed=0)
  eig = np.linalg.eigvalsh(ls.hessian(np.zeros(4)))
  assert (ls.strong_convexity(), ls.smoothness().l) == (pytest.approx(eig[0]), pytest.approx(eig[-1]))


def test_generators_are_deterministic_and_support_counts_count_rows():
  a = problems.make_sparse("logistic", 60, 12, 4, lam=0.0, seed=7)
  b = problems.make_sparse("logistic", 60, 12, 4, lam=0.0, seed=7)
  assert a.indices.tobytes() == b.indices.tobytes() and a.values.tobytes() == b.values.tobytes()
  assert a.targets.tobytes() == b.targets.tobytes()
  assert not np.array_equal(a.values, problems.make_sparse("logistic", 60, 12, 4, lam=0.0, seed=8).values)
  assert all(len(set(row)) == 4 for row in a.indices.tolist())
  dense = problems.to_dense(a.indices, a.values, 12)
  np.testing.assert_array_equal(a.support_counts(), np.count_nonzero(dense, axis=0))
  assert a.support_counts().sum() == 60 * 4


def test_to_sparse_round_trips_and_pads():
  x = np.array([[0.0, 2.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
  indices, values = problems.to_sparse(x, nnz_per_row=3)
  assert indices.dtype == np.int32 and indices.shape == (3, 3)
  np.testing.assert_array_equal(values, [[2.0, 3.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
  np.testing.assert_array_equal(problems.to_dense(indices, values, 4), x)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kind="hinge"), ValueError, "kind must be one of"),
    (dict(lam=-0.1), ValueError, "lam must be >= 0"),
    (dict(targets=np.ones(4)), ValueError, "one entry per row"),
    (dict(targets=np.array([1.0, 0.0, 1.0])), ValueError, "logistic targets must be -1 or \\+1"),
    (dict(features=np.ones(3)), ValueError, "features must have shape \\[n, d\\]"),
    (dict(num_features=5), ValueError, "num_features must be features.shape\\[1\\] = 2"),
])
def test_bad_dense_input_is_refused(kwargs, error, match):
  args = dict(kind="logistic", targets=np.array([1.0, -1.0, 1.0]), lam=0.1, features=np.ones((3, 2)))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    problems.FiniteSum(**args)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(indices=np.array([[0, 4], [1, 2]])), ValueError, "indices must be in \\[0, num_features\\) = \\[0, 4\\)"),
    (dict(indices=np.array([[0, -1], [1, 2]])), ValueError, "indices must be in"),
    (dict(indices=np.array([[1, 1], [1, 2]])), ValueError, "row 0 repeats a column"),
    (dict(indices=np.array([[0.0, 1.0], [1.0, 2.0]])), TypeError, "indices must be integers"),
    (dict(values=np.ones((2, 3))), ValueError, "indices and values must both have shape"),
    (dict(num_features=None), ValueError, "needs indices, values and num_features"),
    (dict(features=np.ones((2, 4))), ValueError, "either features"),
])
def test_bad_sparse_input_is_refused(kwargs, error, match):
  args = dict(kind="least_squares", targets=np.array([1.0, 2.0]), lam=0.1, indices=np.array([[0, 3], [1, 2]]),
              values=np.ones((2, 2)), num_features=4)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    problems.FiniteSum(**args)


def test_padding_may_repeat_an_index():
  p = problems.FiniteSum("least_squares", targets=np.array([1.0]), lam=0.0, indices=np.array([[2, 0, 0]]),
                         values=np.array([[1.5, 0.0, 0.0]]), num_features=3)
  np.testing.assert_array_equal(p.support_counts(), [0, 0, 1])


def test_bad_generator_and_conversion_arguments_are_refused():
  with pytest.raises(ValueError, match="nnz_per_row must be <= d = 5, got 6"):
    problems.make_sparse("logistic", 10, 5, 6, lam=0.1, seed=0)
  with pytest.raises(ValueError, match="nnz_per_row must be an integer >= 1"):
    problems.make_sparse("logistic", 10, 5, 0, lam=0.1, seed=0)
  with pytest.raises(ValueError, match="kind must be one of"):
    problems.make_dense("probit", 10, 5, lam=0.1, seed=0)
  with pytest.raises(ValueError, match="lam must be >= 0"):
    problems.make_dense("logistic", 10, 5, lam=-1.0, seed=0)
  with pytest.raises(ValueError, match="nnz_per_row must be >= the most nonzeros of a row \\(2\\)"):
    problems.to_sparse(np.array([[1.0, 1.0, 0.0]]), nnz_per_row=1)
  with pytest.raises(ValueError, match="nnz_per_row must be <= d = 3"):
    problems.to_sparse(np.array([[1.0, 1.0, 0.0]]), nnz_per_row=4)
  with pytest.raises(ValueError, match="w must have shape \\[num_features\\] = \\(5,\\)"):
    problems.make_dense("logistic", 10, 5, lam=0.1, seed=0).value(np.zeros(4))
  with pytest.raises(TypeError, match="problem must be a FiniteSum"):
    problems.optimum("digits")


def test_it_is_exported():
  assert dj.problems is problems
