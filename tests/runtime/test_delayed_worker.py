"""dj.delayed gives inner the worker that computed each gradient, not the worker of the call that applies it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

DIM = 4
A = np.diag(np.linspace(0.5, 2.0, DIM)).astype(np.float32)
B = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
LAM, MU, EPS, LR = 2.0, 0.9, 1e-7, 0.1


def numpy_dc_asgd_a(tau, workers, steps):
  """Hand loop: call t computes a gradient at w_t on worker workers[t]; it is applied at call t + tau with the
  mean square of the worker that computed it (DC-ASGD-a, one row per worker), then SGD."""
  w, ms, pending = np.zeros(DIM, np.float32), np.zeros((2, DIM), np.float32), []
  for t in range(steps):
    pending.append((A @ w - B, w.copy(), workers[t]))
    if t >= tau:
      g, w_bak, m = pending.pop(0)
      ms[m] = MU * ms[m] + (1 - MU) * g * g
      g = g + LAM / np.sqrt(ms[m] + EPS) * g * g * (w - w_bak)
      w = w - LR * g
  return w, ms


@pytest.mark.parametrize("tau", [1, 3])
def test_each_gradient_updates_the_mean_square_of_the_worker_that_computed_it(tau):
  workers = [t % 2 for t in range(12)]
  tx = dj.delayed(optax.chain(dj.delay_compensation(LAM, adaptive=True, momentum=MU, eps=EPS, num_workers=2),
                              optax.sgd(LR)), dj.delays.constant(tau))
  params = {"w": jnp.zeros(DIM)}
  state = tx.init(params)
  update = jax.jit(lambda g, s, p, m: tx.update(g, s, p, worker=m))
  for m in workers:
    u, state = update({"w": jnp.asarray(A) @ params["w"] - jnp.asarray(B)}, state, params, jnp.int32(m))
    params = optax.apply_updates(params, u)
  w, ms = numpy_dc_asgd_a(tau, workers, len(workers))
  np.testing.assert_allclose(state.inner_state[0].mean_square["w"], ms, rtol=1e-5)
  np.testing.assert_allclose(params["w"], w, rtol=1e-5, atol=1e-6)
  # With an odd delay the applying call's worker is always the other one: the old behaviour differs.
  if tau % 2:
    wrong_ms = numpy_dc_asgd_a(tau, [1 - m for m in workers], len(workers))[1]
    assert not np.allclose(wrong_ms, ms)


def test_uniform_delays_carry_each_gradients_worker_through_the_loop_over_releases():
  """With random delays several gradients land in one call; each must see its own worker's row."""
  tx = dj.delayed(optax.chain(dj.delay_compensation(LAM, adaptive=True, momentum=MU, eps=EPS, num_workers=3),
                              optax.sgd(LR)), dj.delays.uniform(3), seed=1)
  params = {"w": jnp.zeros(DIM)}
  state = tx.init(params)
  # Worker 2 computes only the gradient of call 0, so only the call that releases it may touch row 2.
  workers = [2] + [0] * 9
  assert int(dj.delays.uniform(3).sample(jax.random.fold_in(jax.random.PRNGKey(1), 0), 0)) > 0  # not call 0's own
  for m in workers:
    _, state = tx.update({"w": jnp.ones(DIM)}, state, params, worker=m)
  rows = np.asarray(state.inner_state[0].mean_square["w"])
  # Row 2 saw exactly one gradient of ones: (1 - mu) * 1.
  np.testing.assert_allclose(rows[2], np.full(DIM, 1 - MU), rtol=1e-6)
  assert np.all(rows[1] == 0) and np.all(rows[0] > 0)


def test_a_worker_with_per_leaf_delays_or_of_the_wrong_type_is_refused():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  per_leaf = dj.delayed(optax.sgd(0.1), dj.delays.per_leaf({"a": dj.delays.constant(1), "b": dj.delays.constant(2)}))
  with pytest.raises(ValueError, match="per-leaf delays .* cannot carry worker"):
    per_leaf.update(params, per_leaf.init(params), params, worker=0)
  tx = dj.delayed(optax.sgd(0.1), dj.delays.constant(1))
  for bad in (1.5, jnp.ones(2, jnp.int32), "0"):
    with pytest.raises(TypeError, match="worker .* must be an integer scalar"):
      tx.update(params, tx.init(params), params, worker=bad)
