"""dj.delayed against Optax (zero delay) and hand-written NumPy delayed-gradient loops."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax import delays

DIM = 5
A = np.diag(np.linspace(0.5, 2.0, DIM)).astype(np.float32)
B = np.linspace(-1.0, 1.0, DIM).astype(np.float32)


def grad_np(w):
  return A @ w - B


def grad_jnp(params):
  return {"w": jnp.asarray(A) @ params["w"] - jnp.asarray(B)}


def run_loop(tx, steps, params=None, grad_fn=grad_jnp):
  """A jitted lax.scan training loop that computes each gradient at the current params."""
  params = {"w": jnp.zeros(DIM, jnp.float32)} if params is None else params

  @jax.jit
  def train(params):
    def body(carry, _):
      p, s = carry
      u, s = tx.update(grad_fn(p), s, p)
      p = optax.apply_updates(p, u)
      return (p, s), p
    (p, s), trajectory = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return p, s, trajectory

  return train(params)


INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(0.05),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
}


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", INNERS)
@pytest.mark.parametrize("model", [delays.constant(0), delays.uniform(0), delays.trace([0, 0])])
def test_zero_delay_is_the_inner_optimizer_bit_for_bit(name, model):
  _, _, expected = run_loop(INNERS[name](), 30)
  _, state, got = run_loop(dj.delayed(INNERS[name](), model), 30)
  np.testing.assert_array_equal(got["w"], expected["w"])
  assert int(state.count) == 30


def numpy_constant_delay_momentum(tau, steps, lr=0.1, beta=0.9):
  """Delayed heavy-ball SGD written out by hand: g_t is applied at step t + tau."""
  w = np.zeros(DIM, np.float32)
  m = np.zeros(DIM, np.float32)
  pending = collections.deque()
  out = []
  for _ in range(steps):
    pending.append(grad_np(w))
    if len(pending) > tau:
      g = pending.popleft()
      m = beta * m + g
      w = w - lr * m
    out.append(w.copy())
  return np.stack(out)


@pytest.mark.fast_compile
@pytest.mark.parametrize("tau", [1, 2, 5, 8])
def test_constant_delay_matches_numpy_loop(tau):
  _, _, got = run_loop(dj.delayed(optax.sgd(0.1, momentum=0.9), delays.constant(tau)), 40)
  np.testing.assert_allclose(got["w"], numpy_constant_delay_momentum(tau, 40), rtol=2e-5, atol=1e-6)


def numpy_random_delay_dc_momentum(delay_draws, steps, lr=0.1, beta=0.5, lam=0.3):
  """DC-ASGD-c + momentum with gradients released at s + d_s, several per call in issue order."""
  w = np.zeros(DIM, np.float32)
  m = np.zeros(DIM, np.float32)
  inflight = []  # (issue step, due step, gradient, params at issue)
  out = []
  for t in range(steps):
    inflight.append((t, t + int(delay_draws[t]), grad_np(w), w.copy()))
    w_start = w.copy()
    current = w.copy()
    for s, due, g, w_read in sorted(inflight, key=lambda x: x[0]):
      if due != t:
        continue
      g_dc = g + lam * g * g * (current - w_read)
      m = beta * m + g_dc
      current = current - lr * m
    inflight = [x for x in inflight if x[1] != t]
    w = w_start + (current - w_start)
    out.append(w.copy())
  return np.stack(out)


def delay_draws(model, steps, seed):
  key = jax.random.PRNGKey(seed)
  return [int(model.sample(jax.random.fold_in(key, t), t)) for t in range(steps)]


@pytest.mark.fast_compile
@pytest.mark.parametrize("model", [delays.uniform(3), delays.geometric(0.4, 5), delays.trace([2, 0, 0, 3, 1, 0])])
def test_random_delays_match_numpy_loop_with_the_same_draws(model):
  steps, seed = 40, 7
  tx = dj.delayed(optax.chain(dj.delay_compensation(0.3), optax.sgd(0.1, momentum=0.5)), model, seed=seed)
  _, _, got = run_loop(tx, steps)
  expected = numpy_random_delay_dc_momentum(delay_draws(model, steps, seed), steps)
  np.testing.assert_allclose(got["w"], expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("model", [delays.uniform(4), delays.constant(3), delays.trace([0, 4, 1, 1, 3])])
def test_every_gradient_is_applied_once_at_its_due_call(model):
  """One-hot gradients and SGD(lr=1): the parameters count the gradients released so far."""
  steps, seed = 30, 11
  tx = dj.delayed(optax.sgd(1.0), model, seed=seed)
  params = {"w": jnp.zeros(steps, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  d = delay_draws(model, steps, seed)
  for t in range(steps):
    u, state = update({"w": jax.nn.one_hot(t, steps, dtype=jnp.float32)}, state, params)
    params = optax.apply_updates(params, u)
    released = np.array([s + d[s] <= t for s in range(steps)]) & (np.arange(steps) <= t)
    np.testing.assert_array_equal(np.asarray(params["w"]), -released.astype(np.float32))


@pytest.mark.standard_promotion
def test_a_call_that_releases_nothing_leaves_inner_state_untouched():
  tx = dj.delayed(optax.adam(0.1), delays.constant(3))
  params = {"w": jnp.ones(DIM)}
  state = tx.init(params)
  for _ in range(3):
    u, state = tx.update(grad_jnp(params), state, params)
    np.testing.assert_array_equal(u["w"], np.zeros(DIM))
  adam_state = state.inner_state[0]
  assert int(adam_state.count) == 0
  np.testing.assert_array_equal(adam_state.mu["w"], np.zeros(DIM))
  _, state = tx.update(grad_jnp(params), state, params)
  assert int(state.inner_state[0].count) == 1


def recording_transform():
  """Turns the update into (staleness, stale_params) so a test can read what inner received."""
  def update_fn(updates, state, params=None, *, staleness=None, stale_params=None, **extra):
    del params, extra
    return jax.tree.map(lambda g, w: jnp.stack([g[0], w[0], staleness.astype(g.dtype)]),
                        updates, stale_params), state
  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)


def test_inner_receives_staleness_and_the_params_of_the_issuing_call():
  tx = dj.delayed(recording_transform(), delays.constant(2))
  state = tx.init({"w": jnp.zeros(3)})
  update = jax.jit(tx.update)
  seen = []
  for t in range(6):
    params = {"w": jnp.full(3, 10.0 * t)}
    u, state = update({"w": jnp.full(3, float(t))}, state, params)
    seen.append(np.asarray(u["w"]))
  for t in range(2, 6):
    np.testing.assert_array_equal(seen[t], [t - 2, 10.0 * (t - 2), 2.0])


def test_per_leaf_constant_delays_match_numpy_and_pass_per_leaf_staleness():
  model = delays.per_leaf({"a": delays.constant(1), "b": delays.constant(3)})
  tx = dj.delayed(optax.chain(dj.scale_by_staleness("inverse"), optax.sgd(0.5)), model)
  steps = 12
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  state = tx.init(params)
  grads = [{"a": jnp.full(2, t + 1.0), "b": jnp.full(2, 2.0 * t)} for t in range(steps)]
  for t in range(steps):
    u, state = tx.update(grads[t], state, params)
    params = optax.apply_updates(params, u)
  for leaf, tau in (("a", 1), ("b", 3)):
    applied = sum(float(grads[s][leaf][0]) for s in range(steps - tau))
    np.testing.assert_allclose(params[leaf], np.full(2, -0.5 * applied / tau), rtol=1e-6)


def test_same_seed_same_run_different_seed_different_run():
  run = lambda seed: run_loop(dj.delayed(optax.sgd(0.1), delays.uniform(4), seed=seed), 25)[2]["w"]
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.array_equal(run(1), run(2))


@pytest.mark.standard_promotion
def test_no_recompilation_on_second_call():
  tx = dj.delayed(optax.adam(0.1), delays.uniform(3))
  params = {"w": jnp.ones(DIM)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  u, state = update(grad_jnp(params), state, params)
  u, state = update(grad_jnp(params), state, params)
  assert update._cache_size() == 1


def test_vmap_over_independent_runs_equals_separate_runs():
  tx = dj.delayed(optax.sgd(0.1, momentum=0.9), delays.uniform(2))
  starts = jnp.stack([jnp.full(DIM, float(i)) for i in range(3)])

  def run(w0):
    return run_loop(tx, 15, params={"w": w0})[0]["w"]

  batched = jax.vmap(run)(starts)
  for i in range(3):
    np.testing.assert_allclose(batched[i], run(starts[i]), rtol=1e-6)


def test_inject_hyperparams_inside_and_learning_rate_change_takes_effect():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  _, _, expected = run_loop(dj.delayed(optax.sgd(0.1), delays.constant(2)), 20)
  _, state, got = run_loop(dj.delayed(inner, delays.constant(2)), 20)
  np.testing.assert_array_equal(got["w"], expected["w"])
  tx = dj.delayed(inner, delays.constant(0))
  params = {"w": jnp.ones(DIM)}
  state = tx.init(params)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
  u, _ = tx.update({"w": jnp.ones(DIM)}, state, params)
  np.testing.assert_allclose(u["w"], -0.5 * np.ones(DIM))


@pytest.mark.standard_promotion
def test_multisteps_outside_delays_the_averaged_gradients():
  k, tau, steps = 2, 2, 24
  tx = optax.MultiSteps(dj.delayed(optax.sgd(0.2), delays.constant(tau)), every_k_schedule=k)
  _, _, got = run_loop(tx, steps)
  w = np.zeros(DIM, np.float32)
  acc, pending, expected = [], collections.deque(), []
  for _ in range(steps):
    acc.append(grad_np(w))
    if len(acc) == k:
      pending.append(np.mean(acc, axis=0))
      acc = []
      if len(pending) > tau:
        w = w - 0.2 * pending.popleft()
    expected.append(w.copy())
  np.testing.assert_allclose(got["w"], np.stack(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("inner", [optax.sgd(0.1, momentum=0.9), optax.adam(0.01)])
def test_bf16_params_keep_their_dtype(inner):
  tx = dj.delayed(inner, delays.uniform(2))
  params = {"w": jnp.ones(DIM, jnp.bfloat16)}
  state = tx.init(params)
  assert state.grads["w"].dtype == jnp.bfloat16 and state.stale_params["w"].dtype == jnp.bfloat16
  for _ in range(4):
    u, state = jax.jit(tx.update)({"w": jnp.ones(DIM, jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, u)
  assert u["w"].dtype == jnp.bfloat16 and params["w"].dtype == jnp.bfloat16


def test_store_stale_params_off_saves_the_ring_and_withholds_stale_params():
  tx = dj.delayed(optax.sgd(0.1), delays.constant(4), store_stale_params=False)
  assert tx.init({"w": jnp.ones(DIM)}).stale_params == ()
  _, _, expected = run_loop(dj.delayed(optax.sgd(0.1), delays.constant(4)), 12)
  np.testing.assert_array_equal(run_loop(tx, 12)[2]["w"], expected["w"])
  dc = dj.delayed(optax.chain(dj.delay_compensation(0.1), optax.sgd(0.1)), delays.constant(1),
                  store_stale_params=False)
  with pytest.raises(ValueError, match="stale_params"):
    run_loop(dc, 2)


def test_extra_arguments_reach_inner():
  tx = dj.delayed(optax.chain(dj.delay_compensation(adaptive=True, num_workers=2), optax.sgd(0.1)),
                  delays.constant(1))
  params = {"w": jnp.ones(DIM)}
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(grad_jnp(params), state, params, worker=1)
  ms = state.inner_state[0].mean_square["w"]
  assert np.all(np.asarray(ms[1]) > 0) and np.all(np.asarray(ms[0]) == 0)


def test_nnx_optimizer_drop_in():
  from flax import nnx

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros(DIM))

  model = Linear()
  tx = dj.delayed(optax.sgd(0.1, momentum=0.9), delays.constant(3))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda m: 0.5 * m.w[...] @ jnp.asarray(A) @ m.w[...] - jnp.asarray(B) @ m.w[...])(model)
    optimizer.update(model, grads)

  for _ in range(20):
    train_step(model, optimizer)
  np.testing.assert_allclose(model.w[...], numpy_constant_delay_momentum(3, 20)[-1], rtol=2e-5, atol=1e-6)


def test_linen_train_state_with_apply_gradients_helper():
  from flax.training import train_state

  tx = dj.delayed(optax.chain(dj.delay_compensation(adaptive=True, num_workers=2), optax.sgd(0.1)),
                  delays.constant(1))
  state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(DIM)}, tx=tx)
  state = dj.apply_gradients(state, grads=grad_jnp(state.params), worker=1)
  state = dj.apply_gradients(state, grads=grad_jnp(state.params), worker=1)
  assert int(state.step) == 2
  ms = state.opt_state.inner_state[0].mean_square["w"]
  assert np.all(np.asarray(ms[1]) > 0) and np.all(np.asarray(ms[0]) == 0)
  plain = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(DIM)},
                                        tx=dj.delayed(optax.sgd(0.1), delays.constant(1)))
  helper = dj.apply_gradients(plain, grads=grad_jnp(plain.params))
  builtin = plain.apply_gradients(grads=grad_jnp(plain.params))
  np.testing.assert_array_equal(helper.params["w"], builtin.params["w"])


@pytest.mark.parametrize("make, exc, match", [
    (lambda: dj.delayed("sgd", delays.constant(1)), TypeError, "inner must be an optax.GradientTransformation"),
    (lambda: dj.delayed(optax.sgd(0.1), 3), TypeError, "delays must be a delay model"),
    (lambda: dj.delayed(optax.sgd(0.1), delays.constant(1), seed=1.5), TypeError, "seed must be an integer"),
    (lambda: dj.delayed(optax.sgd(0.1), delays.constant(1), store_stale_params=1), TypeError,
     "store_stale_params must be a bool"),
    (lambda: dj.delayed(optax.sgd(0.1), delays.per_leaf({"x": delays.constant(1)})).init({"w": jnp.ones(1)}),
     ValueError, "not a prefix of the parameter tree"),
])
def test_bad_construction(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


def test_bad_update_calls():
  tx = dj.delayed(optax.sgd(0.1), delays.constant(1))
  params = {"w": jnp.ones(DIM)}
  state = tx.init(params)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, state)
  with pytest.raises(TypeError, match="staleness"):
    tx.update(params, state, params, staleness=1)
  with pytest.raises(ValueError, match="structure of params"):
    tx.update({"v": jnp.ones(DIM)}, state, params)
