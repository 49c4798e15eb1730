"""DC-ASGD-c and DC-ASGD-a against a NumPy re-implementation of the authors' server update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

DIM, NUM_WORKERS, STEPS = 6, 3, 25


def random_pushes(seed=0):
  """A random sequence of (worker, gradient, params, stale params) as a server would see it."""
  rng = np.random.default_rng(seed)
  workers = rng.integers(0, NUM_WORKERS, STEPS)
  grads = rng.normal(size=(STEPS, DIM)).astype(np.float32)
  shifts = rng.normal(scale=0.1, size=(STEPS, DIM)).astype(np.float32)
  return workers, grads, shifts


def numpy_dcasgd(lr, lam, adaptive, per_worker, mu=0.95, eps=1e-7, seed=0):
  """Zheng et al. 2017, Alg. 3 as in the authors' Multiverso updater, with SGD on top."""
  workers, grads, shifts = random_pushes(seed)
  w = np.zeros(DIM, np.float64)
  ms = np.zeros((NUM_WORKERS if per_worker else 1, DIM))
  out = []
  for t in range(STEPS):
    m = workers[t] if per_worker else 0
    g = grads[t].astype(np.float64)
    w_bak = w - shifts[t]
    if adaptive:
      ms[m] = mu * ms[m] + (1 - mu) * g * g
      coef = lam / np.sqrt(ms[m] + eps)
    else:
      coef = lam
    w = w - lr * (g + coef * g * g * (w - w_bak))
    out.append(w.copy())
  return np.stack(out)


def run_dcasgd(tx, seed=0):
  workers, grads, shifts = random_pushes(seed)

  @jax.jit
  def run(workers, grads, shifts):
    def body(carry, x):
      w, s = carry
      m, g, shift = x
      u, s = tx.update(g, s, w, stale_params=w - shift, worker=m)
      w = optax.apply_updates(w, u)
      return (w, s), w
    w0 = jnp.zeros(DIM)
    return jax.lax.scan(body, (w0, tx.init(w0)), (workers, grads, shifts))[1]

  return run(jnp.asarray(workers, jnp.int32), jnp.asarray(grads), jnp.asarray(shifts))


@pytest.mark.parametrize("adaptive, per_worker, lam", [
    (False, False, 0.04), (False, False, 1.5), (True, False, 2.0), (True, True, 2.0), (True, True, 0.5),
])
def test_matches_numpy_reference(adaptive, per_worker, lam):
  tx = optax.chain(
      dj.delay_compensation(lam, adaptive=adaptive, num_workers=NUM_WORKERS if per_worker else None),
      optax.sgd(0.05))
  got = run_dcasgd(tx)
  np.testing.assert_allclose(got, numpy_dcasgd(0.05, lam, adaptive, per_worker), rtol=1e-5, atol=1e-6)


def test_defaults_follow_the_references():
  _, grads, _ = random_pushes()
  for adaptive, lam in ((False, 0.04), (True, 2.0)):
    default = dj.delay_compensation(adaptive=adaptive)
    explicit = dj.delay_compensation(lam, adaptive=adaptive)
    w, w_bak, g = jnp.ones(DIM), jnp.zeros(DIM), jnp.asarray(grads[0])
    np.testing.assert_array_equal(default.update(g, default.init(w), w, stale_params=w_bak)[0],
                                  explicit.update(g, explicit.init(w), w, stale_params=w_bak)[0])


@pytest.mark.parametrize("adaptive, num_workers", [(False, None), (True, None), (True, NUM_WORKERS)])
def test_zero_staleness_is_plain_sgd_bit_for_bit(adaptive, num_workers):
  # Bit-identical op by op; under jit XLA may fuse the two programs differently, so to rounding.
  tx = optax.chain(dj.delay_compensation(2.0, adaptive=adaptive, num_workers=num_workers),
                   optax.sgd(0.1, momentum=0.9))
  ref = optax.sgd(0.1, momentum=0.9)
  _, grads, _ = random_pushes()
  for update, ref_update, check in (
      (tx.update, ref.update, np.testing.assert_array_equal),
      (jax.jit(tx.update), jax.jit(ref.update), lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6))):
    w, s, r = jnp.ones(DIM), tx.init(jnp.ones(DIM)), ref.init(jnp.ones(DIM))
    for t in range(5):
      u, s = update(jnp.asarray(grads[t]), s, w, stale_params=w, staleness=0, worker=1)
      v, r = ref_update(jnp.asarray(grads[t]), r, w)
      check(u, v)
      w = optax.apply_updates(w, u)


def test_per_worker_mean_square_only_moves_for_the_pushing_worker():
  tx = dj.delay_compensation(adaptive=True, num_workers=4)
  w = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
  state = tx.init(w)
  assert state.mean_square["b"].shape == (4, 2, 2)
  g = jax.tree.map(lambda x: 2 * x, w)
  _, state = tx.update(g, state, w, stale_params=w, worker=2)
  ms = np.asarray(state.mean_square["a"])
  np.testing.assert_allclose(ms[2], np.full(3, 0.05 * 4.0), rtol=1e-6)
  np.testing.assert_array_equal(ms[[0, 1, 3]], np.zeros((3, 3)))


def test_bf16_keeps_dtype():
  tx = dj.delay_compensation(adaptive=True)
  w = jnp.ones(3, jnp.bfloat16)
  u, s = tx.update(w, tx.init(w), w, stale_params=jnp.zeros(3, jnp.bfloat16))
  assert u.dtype == jnp.bfloat16 and s.mean_square.dtype == jnp.bfloat16


@pytest.mark.parametrize("make, exc, match", [
    (lambda: dj.delay_compensation(-1.0), ValueError, "lam must be >= 0.0"),
    (lambda: dj.delay_compensation(1.0, adaptive=True, momentum=1.0), ValueError, "momentum must be < 1"),
    (lambda: dj.delay_compensation(1.0, adaptive=True, momentum=-0.1), ValueError, "momentum must be >= 0.0"),
    (lambda: dj.delay_compensation(1.0, eps=-1e-3), ValueError, "eps must be >= 0.0"),
    (lambda: dj.delay_compensation(1.0, num_workers=0), ValueError, "num_workers must be an integer >= 1"),
    (lambda: dj.delay_compensation(1.0, adaptive="yes"), TypeError, "adaptive must be a bool"),
])
def test_bad_construction(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


def test_missing_or_bad_extra_arguments():
  w = jnp.ones(3)
  tx = dj.delay_compensation(1.0)
  with pytest.raises(ValueError, match="needs the extra argument stale_params="):
    tx.update(w, tx.init(w), w)
  with pytest.raises(ValueError, match="needs the extra argument params="):
    tx.update(w, tx.init(w), stale_params=w)
  with pytest.raises(ValueError, match="structure of the updates"):
    tx.update(w, tx.init(w), w, stale_params={"x": w})
  per_worker = dj.delay_compensation(1.0, adaptive=True, num_workers=2)
  with pytest.raises(ValueError, match="needs the extra argument worker="):
    per_worker.update(w, per_worker.init(w), w, stale_params=w)
  with pytest.raises(ValueError, match=r"worker must be in \[0, 2\), got 5"):
    per_worker.update(w, per_worker.init(w), w, stale_params=w, worker=5)
