"""accumulate_sum (Aji & Heafield), fed_async (Xie et al.), fed_buff (Nguyen et al.)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.transforms._aggregation import server_versions_behind
from remedy_checks import (assert_chain_and_unknown_extra_args, assert_jit_traces_once, params_tree,
                           random_like)

# --- accumulate_sum ------------------------------------------------------------------------------------------


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_accumulate_sum_k1_is_inner_bit_for_bit():
  params = params_tree()
  tx, ref = dj.accumulate_sum(optax.adam(1e-2), 1), optax.adam(1e-2)
  s, r = tx.init(params), ref.init(params)
  for i in range(4):
    g = random_like(params, i)
    u, s = tx.update(g, s, params)
    v, r = ref.update(g, r, params)
    chex.assert_trees_all_equal(u, v)


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_accumulate_sum_is_k_times_multisteps_for_sgd():
  # The documented difference: the inner step sees the sum, MultiSteps the mean.
  params, k = params_tree(), 3
  tx = dj.accumulate_sum(optax.sgd(0.1, momentum=0.9), k)
  ms = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), k)
  s, m = tx.init(params), ms.init(params)
  for i in range(2 * k):
    g = random_like(params, i)
    u, s = tx.update(g, s, params)
    v, m = ms.update(g, m, params)
    if (i + 1) % k:
      jax.tree.map(lambda a: np.testing.assert_array_equal(a, 0.0), u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, k * b, rtol=1e-5, atol=1e-7), u, v)


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_accumulate_sum_matches_multisteps_for_adam_without_eps():
  # Adam is invariant to the factor k when eps = 0: sum and mean give the same step.
  params, k = params_tree(), 4
  tx = dj.accumulate_sum(optax.adam(1e-2, eps=0.0), k)
  ms = optax.MultiSteps(optax.adam(1e-2, eps=0.0), k)
  s, m = tx.init(params), ms.init(params)
  for i in range(k):
    g = random_like(params, 10 + i)
    u, s = tx.update(g, s, params)
    v, m = ms.update(g, m, params)
  chex.assert_trees_all_close(u, v, rtol=1e-5)


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_accumulate_sum_leaves_inner_state_untouched_between_steps():
  params = params_tree()
  tx = dj.accumulate_sum(optax.adam(1e-2), 3)
  s0 = tx.init(params)
  _, s1 = tx.update(random_like(params, 1), s0, params)
  _, s2 = tx.update(random_like(params, 2), s1, params)
  chex.assert_trees_all_equal(s2.inner_state, s0.inner_state)
  _, s3 = tx.update(random_like(params, 3), s2, params)
  assert int(s3.inner_state[0].count) == 1
  assert int(s3.count) == 0


def test_accumulate_sum_numpy_reference():
  params, k, lr, beta = params_tree(), 3, 0.05, 0.5
  tx = dj.accumulate_sum(optax.sgd(lr, momentum=beta), k)
  state = tx.init(params)
  summed = {n: np.zeros(p.shape) for n, p in params.items()}
  trace = {n: np.zeros(p.shape) for n, p in params.items()}
  for i in range(7):
    g = random_like(params, 20 + i)
    u, state = tx.update(g, state, params)
    for n in params:
      summed[n] = summed[n] + np.asarray(g[n], np.float64)
      if (i + 1) % k == 0:
        trace[n] = summed[n] + beta * trace[n]
        expected = -lr * trace[n]
        summed[n] = np.zeros_like(summed[n])
      else:
        expected = np.zeros_like(summed[n])
      np.testing.assert_allclose(u[n], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_accumulate_sum_jit_and_chain():
  params = params_tree()
  assert_jit_traces_once(dj.accumulate_sum(optax.adam(1e-2), 2), params, lambda i: {})
  assert_chain_and_unknown_extra_args(dj.accumulate_sum(optax.sgd(0.1), 1), params, {})


@pytest.mark.parametrize("k, err, match", [(0, ValueError, "k must be an integer >= 1, got 0"),
                                           (-2, ValueError, "k must be an integer >= 1"),
                                           (2.5, TypeError, "k must be an integer")])
def test_accumulate_sum_bad_k(k, err, match):
  with pytest.raises(err, match=match):
    dj.accumulate_sum(optax.sgd(0.1), k)


# --- fed_async -----------------------------------------------------------------------------------------------


def test_fed_async_zero_staleness_is_scale_bit_for_bit():
  params = params_tree()
  delta = random_like(params, 3)
  u, _ = dj.fed_async(0.6).update(delta, optax.EmptyState(), params, staleness=0, stale_params=params)
  v, _ = optax.scale(0.6).update(delta, optax.EmptyState(), params)
  chex.assert_trees_all_equal(u, v)


@pytest.mark.parametrize("rule, kw", [("constant", {}), ("polynomial", {"a": 0.5}), ("hinge", {"a": 10.0, "b": 2})])
def test_fed_async_numpy_reference(rule, kw):
  alpha = 0.7

  def s(tau):
    if rule == "constant":
      return 1.0
    if rule == "polynomial":
      return (tau + 1.0) ** -kw["a"]
    return 1.0 if tau <= kw["b"] else 1.0 / (kw["a"] * (tau - kw["b"]) + 1.0)

  tx = dj.fed_async(alpha, rule, **kw)
  rng = np.random.default_rng(0)
  history = [params_tree()]  # server versions
  for t in range(8):
    tau = int(rng.integers(0, len(history)))
    x, x_read = history[-1], history[-1 - tau]
    client_new = random_like(x_read, 100 + t)
    delta = jax.tree.map(lambda a, b: a - b, client_new, x_read)
    u, _ = tx.update(delta, optax.EmptyState(), x, staleness=tau, stale_params=x_read)
    new = optax.apply_updates(x, u)
    a_t = alpha * s(tau)
    for n in x:
      expected = (1 - a_t) * np.asarray(x[n], np.float64) + a_t * np.asarray(client_new[n], np.float64)
      np.testing.assert_allclose(new[n], expected, rtol=1e-5, atol=1e-6)
    history.append(new)


def test_fed_async_per_leaf_staleness():
  params = params_tree()
  stale = random_like(params, 1)
  delta = random_like(params, 2)
  tx = dj.fed_async(0.5, "polynomial", a=1.0)
  u, _ = tx.update(delta, optax.EmptyState(), params, staleness={"w": 0, "b": 3}, stale_params=stale)
  for n, tau in (("w", 0), ("b", 3)):
    expected = 0.5 / (1 + tau) * (np.asarray(stale[n]) + np.asarray(delta[n]) - np.asarray(params[n]))
    np.testing.assert_allclose(u[n], expected, rtol=1e-6, atol=1e-7)


def test_fed_async_jit_chain_and_errors():
  params = params_tree()
  tx = dj.fed_async(0.5, "hinge")
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i), "stale_params": params_tree()})
  assert_chain_and_unknown_extra_args(tx, params, {"staleness": 2, "stale_params": random_like(params, 4)})
  with pytest.raises(ValueError, match="stale_params="):
    tx.update(params, tx.init(params), params, staleness=0)
  with pytest.raises(ValueError, match="staleness="):
    tx.update(params, tx.init(params), params, stale_params=params)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"mixing": 0.0}, ValueError, "mixing must be > 0.0"),
    ({"mixing": 1.5}, ValueError, "mixing must be <= 1.0"),
    ({"rule": "sigmoid"}, ValueError, "rule must be one of"),
    ({"rule": "hinge", "c": 1}, TypeError, "unexpected keyword argument"),
    ({"rule": "hinge", "value": 1}, TypeError, "unexpected arguments"),
])
def test_fed_async_bad_arguments(kwargs, err, match):
  with pytest.raises(err, match=match):
    dj.fed_async(**kwargs)


# --- fed_buff ------------------------------------------------------------------------------------------------


def test_fed_buff_k1_zero_staleness_is_server_optimizer_on_minus_delta():
  params = params_tree()
  tx, ref = dj.fed_buff(optax.sgd(0.7, momentum=0.9), buffer_size=1), optax.sgd(0.7, momentum=0.9)
  s, r = tx.init(params), ref.init(params)
  for i in range(3):
    delta = random_like(params, i)
    u, s = tx.update(delta, s, params, staleness=0)
    v, r = ref.update(jax.tree.map(lambda d: -d, delta), r, params)
    chex.assert_trees_all_equal(u, v)


def test_fed_buff_numpy_reference():
  # K = 3 deltas with staleness weights 1/sqrt(1 + tau), tau given in server versions, then server SGD with momentum.
  params, k, lr, beta = params_tree(), 3, 0.7, 0.9
  tx = dj.fed_buff(optax.sgd(lr, momentum=beta), buffer_size=k, staleness_counts="versions")
  state = tx.init(params)
  rng = np.random.default_rng(5)
  buf = {n: np.zeros(p.shape) for n, p in params.items()}
  mom = {n: np.zeros(p.shape) for n, p in params.items()}
  for i in range(7):
    tau = int(rng.integers(0, 6))
    delta = random_like(params, 30 + i)
    u, state = tx.update(delta, state, params, staleness=tau)
    for n in params:
      buf[n] = buf[n] + np.asarray(delta[n], np.float64) / np.sqrt(1.0 + tau)
      if (i + 1) % k == 0:
        mom[n] = -buf[n] / k + beta * mom[n]
        expected = -lr * mom[n]
        buf[n] = np.zeros_like(buf[n])
      else:
        expected = np.zeros_like(buf[n])
      np.testing.assert_allclose(u[n], expected, rtol=1e-5, atol=1e-6)


def test_fed_buff_per_leaf_staleness_and_untouched_server_state():
  params = params_tree()
  tx = dj.fed_buff(optax.sgd(1.0, momentum=0.5), buffer_size=2)
  s0 = tx.init(params)
  d1, d2 = random_like(params, 1), random_like(params, 2)
  u1, s1 = tx.update(d1, s0, params, staleness={"w": 3, "b": 0})
  jax.tree.map(lambda a: np.testing.assert_array_equal(a, 0.0), u1)
  chex.assert_trees_all_equal(s1[2].inner_state, s0[2].inner_state)
  u2, _ = tx.update(d2, s1, params, staleness=0)
  # 3 calls stale with an empty buffer is ceil(3 / 2) = 2 server versions: weight 1 / sqrt(3).
  np.testing.assert_allclose(u2["w"], (np.asarray(d1["w"]) / np.sqrt(3.0) + np.asarray(d2["w"])) / 2, rtol=1e-6)
  np.testing.assert_allclose(u2["b"], (np.asarray(d1["b"]) + np.asarray(d2["b"])) / 2, rtol=1e-6)


def _numpy_fedbuff_by_seqnum(x0, target, num_clients, k, lr, beta, client_lr, calls, seed):
  """FedBuff as FLSim runs it: a server sequence number that grows by one per server step.

  Clients read (model, seqnum); one arrives at a time, at random; its delta is one local step on
  0.5 |x - target|^2 from its read; its weight is 1 / sqrt(1 + seqnum_now - seqnum_read). Returns, per
  arrival, the call staleness the delayjax runtimes pass (arrivals since the read), the delta and the
  server model after it.
  """
  rng = np.random.default_rng(seed)
  x, mom, buf, filled, seqnum = x0.copy(), np.zeros_like(x0), np.zeros_like(x0), 0, 0
  reads = [(0, seqnum, x.copy()) for _ in range(num_clients)]  # (call index, seqnum, model) at the read
  out = []
  for n in range(calls):
    c = int(rng.integers(num_clients))
    read_call, read_seq, x_read = reads[c]
    delta = -client_lr * (x_read - target)
    buf += delta / np.sqrt(1.0 + (seqnum - read_seq))
    filled += 1
    if filled == k:
      mom = -buf / k + beta * mom
      x = x - lr * mom
      buf, filled, seqnum = np.zeros_like(x0), 0, seqnum + 1
    out.append((n - read_call, delta, x.copy()))
    reads[c] = (n + 1, seqnum, x.copy())
  return out


@pytest.mark.parametrize("k", [1, 3, 4])
def test_fed_buff_counts_server_versions_like_flsim(k):
  """Fed the runtime's staleness (arrivals since the read), dj.fed_buff weights by server versions since it."""
  rng = np.random.default_rng(11)
  x0, target = rng.normal(size=5), rng.normal(size=5)
  lr, beta = 0.8, 0.5
  events = _numpy_fedbuff_by_seqnum(x0, target, 6, k, lr, beta, 0.3, 24, seed=k)
  tx = dj.fed_buff(optax.sgd(lr, momentum=beta), buffer_size=k)
  update = jax.jit(tx.update)
  x = jnp.asarray(x0, jnp.float32)
  state = tx.init(x)
  staler = 0
  for tau, delta, expected in events:
    u, state = update(jnp.asarray(delta, jnp.float32), state, x, staleness=jnp.int32(tau))
    x = optax.apply_updates(x, u)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)
    staler += tau > 0
  assert staler > len(events) // 2  # the stream is asynchronous enough for the unit to matter


def test_fed_buff_update_count_differs_from_version_count():
  """The same stream with staleness_counts="versions" fed arrival counts diverges from FLSim's FedBuff."""
  rng = np.random.default_rng(11)
  x0, target = rng.normal(size=5), rng.normal(size=5)
  events = _numpy_fedbuff_by_seqnum(x0, target, 6, 4, 0.8, 0.5, 0.3, 24, seed=4)
  tx = dj.fed_buff(optax.sgd(0.8, momentum=0.5), buffer_size=4, staleness_counts="versions")
  x = jnp.asarray(x0, jnp.float32)
  state = tx.init(x)
  for tau, delta, _ in events:
    u, state = tx.update(jnp.asarray(delta, jnp.float32), state, x, staleness=tau)
    x = optax.apply_updates(x, u)
  assert np.max(np.abs(np.asarray(x) - events[-1][2])) > 1e-3


def test_server_versions_behind_is_the_difference_of_floors():
  # n calls made, n = K * v + c: the delta read after call n - tau is floor(n/K) - floor((n - tau)/K) versions old.
  for k in (1, 2, 5):
    for buffered in range(k):
      taus = np.arange(16)
      n = k * (taus.max() + 2) + buffered
      got = np.asarray(server_versions_behind(jnp.asarray(taus, jnp.int32), jnp.int32(buffered), k))
      np.testing.assert_array_equal(got, n // k - (n - taus) // k)


def test_fed_buff_bad_staleness_counts():
  with pytest.raises(ValueError, match=r"staleness_counts must be one of \('updates', 'versions'\), got 'arrivals'"):
    dj.fed_buff(optax.sgd(0.1), staleness_counts="arrivals")


@pytest.mark.standard_promotion  # optax.adam / MultiSteps mix int32 and floats
def test_fed_buff_jit_and_chain():
  params = params_tree()
  tx = dj.fed_buff(optax.adam(1e-2), buffer_size=2)
  assert_jit_traces_once(tx, params, lambda i: {"staleness": jnp.int32(i)})
  assert_chain_and_unknown_extra_args(dj.fed_buff(optax.sgd(0.1), 1), params, {"staleness": 1})


@pytest.mark.parametrize("kwargs, err, match", [
    ({"buffer_size": 0}, ValueError, "buffer_size must be an integer >= 1, got 0"),
    ({"rule": "nope"}, ValueError, "rule must be one of"),
    ({"rule": "polynomial", "a": -1.0}, ValueError, "a must be >= 0.0"),
])
def test_fed_buff_bad_arguments(kwargs, err, match):
  with pytest.raises(err, match=match):
    dj.fed_buff(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: dj.accumulate_sum(optax.sgd(0.1), 10**12), r"k must be an integer in \[1, 2\*\*31 - 1 = 2147483647\]"),
    (lambda: dj.accumulate_sum(optax.sgd(0.1), np.int64(2**31)), r"k must be an integer in \[1, 2\*\*31 - 1"),
    (lambda: dj.fed_buff(optax.sgd(0.1), buffer_size=2**40), r"buffer_size must be an integer in \[1, 2\*\*31 - 1"),
])
def test_counts_past_int32_are_refused(make, match):
  """The count of summed gradients is int32: a larger k overflowed at the first update, inside the trace."""
  with pytest.raises(ValueError, match=match + r".*got \d+"):
    make()


def test_the_largest_int32_k_sums_without_stepping():
  tx = dj.accumulate_sum(optax.sgd(1.0), 2**31 - 1)
  state = tx.init(jnp.zeros(1))
  u, state = tx.update(jnp.ones(1), state, jnp.zeros(1))
  np.testing.assert_array_equal(u, np.zeros(1))
  assert int(state.count) == 1
