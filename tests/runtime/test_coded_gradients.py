"""dj.GradientCode, dj.workers.Coded and dj.decode_gradient_code against a NumPy gradient code and NumPy GD."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

# Every comparison is to 1e-10, not bit for bit: XLA's quick compile settings are fine.
pytestmark = pytest.mark.fast_compile

N_WORKERS, N_EXAMPLES, DIM, LAM, LR = 6, 24, 3, 0.1, 0.3


def _problem():
  return dj.problems.make_dense("least_squares", N_EXAMPLES, DIM, lam=LAM, seed=1)


def _np_part_gradients(problem, w, n):
  """float64 [n, d]: the gradient of 0.5 mean (x w - y)^2 + lam/2 |w|^2 on each contiguous part (written here)."""
  x, y = np.asarray(problem.features), np.asarray(problem.targets)
  size = len(y) // n
  return np.stack([x[p * size:(p + 1) * size].T @ (x[p * size:(p + 1) * size] @ w - y[p * size:(p + 1) * size])
                   / size + LAM * w for p in range(n)])


def _np_full_gradient(problem, w):
  x, y = np.asarray(problem.features), np.asarray(problem.targets)
  return x.T @ (x @ w - y) / len(y) + LAM * w


def _np_messages(code, parts):
  """Each worker's message: its row of B on its cyclic parts m, ..., m + s (mod n); the support checked too."""
  b, n = np.asarray(code.matrix), code.num_workers
  out = []
  for m in range(n):
    support = [(m + j) % n for j in range(n - code.k + 1)]
    assert code.parts(m) == support
    assert np.all(b[m, [p for p in range(n) if p not in support]] == 0) and b[m, m] == 1
    out.append(sum(b[m, p] * parts[p] for p in support))
  return np.stack(out)


@pytest.mark.parametrize("k", [1, 3, 4, 5, 6])
def test_decoding_recovers_the_full_gradient_from_every_k_subset(k):
  """decode_gradient_code on the messages of every k-subset (in any order) is the full-data gradient, to 1e-10."""
  problem, code = _problem(), dj.GradientCode(N_WORKERS, k, seed=2)
  w = np.random.default_rng(0).standard_normal(DIM)
  msgs = _np_messages(code, _np_part_gradients(problem, w, N_WORKERS))
  full = _np_full_gradient(problem, w)
  tx = dj.decode_gradient_code(code)
  with jax.enable_x64(True):
    decode = jax.jit(lambda g, m, wt: tx.update(jnp.zeros(DIM), tx.init(jnp.zeros(DIM)), contribution_grads=g,
                                                contribution_workers=m, contribution_weights=wt)[0])
    for subset in itertools.combinations(range(N_WORKERS), k):
      order = np.random.default_rng(sum(subset)).permutation(list(subset))
      got = np.asarray(decode(jnp.asarray(msgs[order]), jnp.asarray(order, jnp.int32), jnp.full(k, 1.0 / k)))
      np.testing.assert_allclose(got, full, rtol=0, atol=1e-10)
      # The host-side decoding vector does the same (a_S^T B_S = 1^T / n).
      np.testing.assert_allclose(code.decoding(order) @ msgs[order], full, rtol=0, atol=1e-10)


def test_left_out_messages_do_not_count_and_too_few_give_nan():
  code = dj.GradientCode(4, 2, seed=0)
  parts = np.arange(1.0, 5.0)[:, None]  # full gradient 2.5
  msgs = np.asarray(code.matrix) @ parts
  tx = dj.decode_gradient_code(code)
  with jax.enable_x64(True):
    traced = jax.jit(lambda g, m, wt: tx.update(jnp.zeros(1), tx.init(jnp.zeros(1)), contribution_grads=g,
                                                contribution_workers=m, contribution_weights=wt)[0][0])

    def decode(workers, weights):
      return float(traced(jnp.asarray(msgs[workers]), jnp.asarray(workers, jnp.int32), jnp.asarray(weights)))
    # Three messages, one left out (weight 0, its message replaced by garbage): decoded from the other two.
    assert decode([0, 1, 3], [0.5, 0.0, 0.5]) == pytest.approx(2.5, abs=1e-12)
    assert np.isnan(decode([0, 1, 3], [1.0, 0.0, 0.0]))


def _gd_reference(problem, w0, steps):
  w = np.array(w0, np.float64)
  for _ in range(steps):
    w = w - LR * _np_full_gradient(problem, w)
  return w


def _schedule(k, steps, seed=4):
  workers = dj.cluster.workers(N_WORKERS, compute="exponential",
                               stragglers=dj.cluster.random_stragglers(0.3, slowdown=10.0))
  return dj.cluster.simulate(dj.cluster.k_sync(k), workers, num_updates=steps, seed=seed)


@pytest.mark.parametrize("k", [3, 6])
def test_k_sync_run_with_stragglers_is_full_batch_gradient_descent(k):
  """Under k_sync(k) with random stragglers, the coded run's iterates are NumPy full-batch GD's, to 1e-10."""
  problem, steps = _problem(), 12
  schedule = _schedule(k, steps)
  arrived = schedule.contributes.sum(axis=1)
  assert np.all(arrived == k)
  # Different workers arrive first in different updates: the decoding really depends on who arrived.
  assert k == N_WORKERS or len({tuple(np.flatnonzero(row)) for row in schedule.contributes}) > 1
  code = dj.GradientCode(N_WORKERS, k, seed=0)
  with jax.enable_x64(True):
    data = problem.data(jnp.float64)
    w0 = jnp.asarray(np.linspace(-1.0, 1.0, DIM))
    tx = optax.chain(dj.decode_gradient_code(code), optax.sgd(LR))
    result = dj.simulate(problem.loss_fn, tx, w0, data, schedule, seed=0, worker=dj.workers.Coded(code, data),
                         record=dj.Record(eval_fn=lambda w: w, every=1),
                         execution=dj.Execution(lanes=N_WORKERS))
    path = np.asarray(result.history.eval_metrics, np.float64)
  for u in (1, steps // 2, steps):
    np.testing.assert_allclose(path[u], _gd_reference(problem, np.asarray(w0), u), rtol=0, atol=1e-10)
  np.testing.assert_allclose(np.asarray(result.params), _gd_reference(problem, np.asarray(w0), steps), rtol=0,
                             atol=1e-10)


def test_uncoded_k_sync_is_the_mean_of_the_arrived_parts():
  """k = n (B = I) under k_sync(k' < n) with the runtime's average: the mean of the arrived workers' own parts."""
  problem, steps, k = _problem(), 5, 4
  schedule = _schedule(k, steps, seed=7)
  code = dj.GradientCode(N_WORKERS, N_WORKERS)
  with jax.enable_x64(True):
    data = problem.data(jnp.float64)
    w0 = jnp.zeros(DIM, jnp.float64)
    result = dj.simulate(problem.loss_fn, optax.sgd(LR), w0, data, schedule, seed=0,
                         worker=dj.workers.Coded(code, data), execution=dj.Execution(lanes=N_WORKERS))
  w = np.zeros(DIM)
  for row in schedule.contributes:
    w = w - LR * _np_part_gradients(problem, w, N_WORKERS)[row].mean(axis=0)
  np.testing.assert_allclose(np.asarray(result.params), w, rtol=0, atol=1e-10)
  assert np.abs(w - _gd_reference(problem, np.zeros(DIM), steps)).max() > 1e-4  # it is not GD


def test_bad_inputs():
  with pytest.raises(ValueError, match=r"k must be in \[1, num_workers\] = \[1, 4\].*k=5"):
    dj.GradientCode(4, 5)
  with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
    dj.GradientCode(4, 0)
  with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
    dj.GradientCode(0, 1)
  with pytest.raises(TypeError, match="k must be an integer"):
    dj.GradientCode(4, 2.5)
  code = dj.GradientCode(4, 3)
  with pytest.raises(ValueError, match="at least k=3 distinct"):
    code.decoding([0, 1])
  with pytest.raises(TypeError, match="code must be a dj.GradientCode"):
    dj.decode_gradient_code("cyclic")
  with pytest.raises(TypeError, match="Coded.code must be a dj.GradientCode"):
    dj.workers.Coded(None, {"x": np.zeros((8, 2))})
  with pytest.raises(ValueError, match="multiple of code.num_workers = 4 examples.*got 6"):
    dj.workers.Coded(code, {"x": np.zeros((6, 2)), "y": np.zeros(6)})
  with pytest.raises(ValueError, match="share one leading"):
    dj.workers.Coded(code, {"x": np.zeros((8, 2)), "y": np.zeros(4)})
  with pytest.raises(ValueError, match="contribution_grads, contribution_workers"):
    tx = dj.decode_gradient_code(code)
    tx.update(jnp.zeros(2), tx.init(jnp.zeros(2)))


def test_schedule_with_other_worker_count_is_refused():
  problem = _problem()
  code = dj.GradientCode(4, 3)
  data = problem.data()
  with pytest.raises(ValueError, match="Coded.code has num_workers=4, but the schedule has 6 workers"):
    dj.simulate(problem.loss_fn, optax.chain(dj.decode_gradient_code(code), optax.sgd(LR)), jnp.zeros(DIM), data,
                _schedule(5, 2), worker=dj.workers.Coded(code, data))
