"""dj.gem (Hermans & Louppe 2018) against a NumPy re-implementation of the authors' worker and parameter server."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from remedy_checks import assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree


class NumpyGem:
  """The authors' loop: each worker keeps a momentum proxy, its last pull and its local model."""

  def __init__(self, x0, num_workers, lr, mu, kappa, eps=1e-12, max_scale=5.0):
    self.x = {n: np.asarray(v, np.float64) for n, v in x0.items()}
    self.lr, self.mu, self.kappa, self.eps, self.max_scale = lr, mu, kappa, eps, max_scale
    zeros = lambda: {n: np.zeros_like(v) for n, v in self.x.items()}  # noqa: E731
    self.moment = [zeros() for _ in range(num_workers)]
    self.stale = [dict(self.x) for _ in range(num_workers)]  # the first pull
    self.local = [dict(self.x) for _ in range(num_workers)]

  def commit(self, m, grad):
    """Worker m's step from a gradient taken at its local model; returns the server model after it."""
    for n in self.x:
      delta = -self.lr * grad[n]
      self.moment[m][n] = self.mu * self.moment[m][n] + delta
      moved = self.x[n] - self.stale[m][n]  # pull: how far the central variable moved since the last one
      self.stale[m][n] = self.x[n].copy()
      pi = np.clip((self.kappa * np.abs(self.moment[m][n]) - np.abs(moved)) / np.abs(delta + self.eps),
                   0.0, self.max_scale)
      self.x[n] = self.x[n] + pi * delta
      self.local[m][n] = self.x[n].copy()  # the worker adds its own update to the pulled model
    return {n: v.copy() for n, v in self.x.items()}


def _quadratic_grad(params, scale, target):
  return {n: scale[n] * (np.asarray(params[n], np.float64) - target[n]) for n in params}


@pytest.mark.parametrize("kappa, mu", [(1.0, 0.9), (2.0, 0.5)])
def test_gem_matches_numpy_authors_loop_in_random_order(kappa, mu):
  rng = np.random.default_rng(3)
  x0 = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
  scale = {n: rng.uniform(0.5, 2.0, size=v.shape) for n, v in x0.items()}
  target = {n: rng.normal(size=v.shape) for n, v in x0.items()}
  workers, lr = 4, 0.1
  ref = NumpyGem(x0, workers, lr, mu, kappa)
  tx = dj.gem(lr, mu, kappa, num_workers=workers)
  update = jax.jit(tx.update)
  x = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), x0)
  state = tx.init(x)
  clipped = 0
  for _ in range(30):
    m = int(rng.integers(workers))
    grad = _quadratic_grad(ref.local[m], scale, target)
    u, state = update(jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), grad), state, x, worker=jnp.int32(m))
    pis = [np.abs(np.asarray(u[n])) / np.maximum(lr * np.abs(grad[n]), 1e-30) for n in grad]
    clipped += sum(int(np.sum(p < 1e-6)) for p in pis)
    x = optax.apply_updates(x, u)
    expected = ref.commit(m, grad)
    for n in x:
      np.testing.assert_allclose(x[n], expected[n], rtol=2e-5, atol=2e-6)
  assert clipped > 0  # the clip at 0 was exercised: some coordinates had no energy left


@pytest.mark.slow  # compiles a dj.simulate run (about 10 s on 2 cores)
def test_gem_under_simulate_matches_numpy_on_an_asp_schedule():
  """On an ASP schedule each worker reads the model right after its own push, which is GEM's local model
  (the pull plus its own step): dj.simulate with dj.gem equals the authors' loop fed full-batch gradients."""
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((64, 3)).astype(np.float32)
  ys = (xs @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
  data = {"x": jnp.asarray(xs), "y": jnp.asarray(ys)}
  params = {"w": jnp.zeros(3), "b": jnp.zeros([])}

  def loss_fn(p, batch):
    return 0.5 * jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

  workers, lr, mu, steps = 4, 0.2, 0.5, 24
  sched = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(workers, compute="gamma"), steps, seed=0)
  c = sched.contributions
  last = {}
  for u, m, r in zip(c.update, c.worker, c.read_version):
    assert r == last.get(int(m), -1) + 1  # the read right after the worker's own previous push
    last[int(m)] = int(u)
  result = dj.simulate(loss_fn, dj.gem(lr, mu, num_workers=workers), params, data, sched, num_updates=steps,
                       sampling=dj.Sampling(batch_size=64, scheme="epoch"), seed=0)
  ref = NumpyGem(params, workers, lr, mu, 1.0)
  x64, y64 = xs.astype(np.float64), ys.astype(np.float64)
  for m in c.worker:
    local = ref.local[int(m)]
    r = x64 @ local["w"] + local["b"] - y64
    ref.commit(int(m), {"w": x64.T @ r / len(r), "b": np.mean(r)})
  for n in params:
    np.testing.assert_allclose(result.params[n], ref.x[n], rtol=1e-4, atol=1e-5)
  assert float(loss_fn(result.params, data)) < 0.5 * float(loss_fn(params, data))


def test_gem_first_step_with_a_still_server_is_the_plain_step():
  # Nothing moved since the first pull and the proxy is the step itself: pi = 1 (up to eps).
  tx = dj.gem(0.3, momentum=0.9, num_workers=3, eps=0.0)
  g = jnp.array([1.0, -2.0, 0.5])
  u, state = tx.update(g, tx.init(jnp.ones(3)), jnp.ones(3), worker=2)
  np.testing.assert_array_equal(u, -0.3 * g)
  np.testing.assert_array_equal(state.pulled[2], jnp.ones(3))
  np.testing.assert_array_equal(state.momentum[0], jnp.zeros(3))


def test_gem_jit_chain_and_dtype():
  params = params_tree()
  assert_jit_traces_once(dj.gem(0.1, num_workers=3), params, lambda i: {"worker": jnp.int32(i % 3)})
  assert_chain_and_unknown_extra_args(dj.gem(0.1, num_workers=3), params, {"worker": 1})
  half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  tx = dj.gem(0.1, num_workers=2)
  u, state = tx.update(half, tx.init(half), half, worker=1)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((u, state)))
  assert dj.transforms.worker_capacity(state) == 2


def test_gem_traced_worker_out_of_range_poisons_the_update():
  tx = dj.gem(0.1, num_workers=2)
  x = jnp.zeros(2)
  u, _ = jax.jit(tx.update)(jnp.ones(2), tx.init(x), x, worker=jnp.int32(5))
  assert np.all(np.isnan(np.asarray(u)))


@pytest.mark.parametrize("kwargs, err, match", [
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be > 0"),
    ({"momentum": 1.0}, ValueError, "momentum must be"),
    ({"kappa": -1.0}, ValueError, "kappa must be >= 0"),
    ({"max_scale": 0.0}, ValueError, "max_scale must be > 0"),
    ({"num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
])
def test_gem_bad_arguments(kwargs, err, match):
  base = {"learning_rate": 0.1, "num_workers": 2}
  with pytest.raises(err, match=match):
    dj.gem(**{**base, **kwargs})


def test_gem_needs_params_and_a_worker_in_range():
  tx = dj.gem(0.1, num_workers=2)
  x = jnp.zeros(2)
  with pytest.raises(ValueError, match="gem needs the extra argument params="):
    tx.update(jnp.ones(2), tx.init(x), None, worker=0)
  with pytest.raises(ValueError, match="worker"):
    tx.update(jnp.ones(2), tx.init(x), x, worker=2)
