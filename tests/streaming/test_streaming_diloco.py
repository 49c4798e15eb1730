"""Streaming DiLoCo: one fragment is DiLoCo bit for bit; fragments, overlap and alpha against a NumPy reference."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from tests.transforms.test_quantize import numpy_quantize

M, N, D = 3, 16, 4
INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9


def _problem():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D)).astype(np.float32)
  data = {"x": x, "y": (x @ np.arange(1, D + 1) + 0.1 * rng.normal(size=N)).astype(np.float32)}
  params = {"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(D - 2, jnp.float32)}

  def loss_fn(p, batch):
    w = jnp.concatenate([p["a"], p["b"]])
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  return data, params, loss_fn


def _bsp(updates):
  return dj.cluster.simulate(dj.cluster.bsp(), dj.cluster.workers(M, compute="exponential"), updates, seed=0)


def test_one_fragment_without_overlap_is_diloco_bit_for_bit():
  data, params, loss_fn = _problem()
  sched = _bsp(6)
  outer = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
  inner = optax.sgd(INNER_LR, momentum=0.5)  # a kept inner state (optax.adam is not strict-dtype clean)
  sampling = dj.Sampling(batch_size=4)
  diloco = dj.simulate(loss_fn, outer, params, data, sched, seed=3, sampling=sampling,
                       worker=dj.workers.LocalSteps(5, inner, keep_state=True))
  streaming = dj.simulate(loss_fn, dj.per_fragment(outer, [0, 0]), params, data, sched, seed=3, sampling=sampling,
                          worker=dj.workers.StreamingDiLoCo(5, inner))
  for leaf in ("a", "b"):
    np.testing.assert_array_equal(np.asarray(streaming.params[leaf]), np.asarray(diloco.params[leaf]))
  assert not np.array_equal(np.asarray(diloco.params["a"]), 0.0)


def _reference(data, updates, steps, overlap, alpha, eager=False, quantize=None):
  """Streaming DiLoCo on full batches in NumPy: two fragments (a, b), outer Nesterov per fragment.

  ``eager``: after each push, worker m steps its own Nesterov copy (own momentum per fragment) with its own
  outer gradient; the next contribution's first ``overlap`` steps take their gradients at local + e, e being that
  stand-in global fragment minus the local one (zero elsewhere). ``quantize``: applied to each worker's push (one
  leaf) before the average.
  """
  x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
  grad = lambda w: 2 * x.T @ (x @ w - y) / N  # noqa: E731
  frags = [np.arange(0, 2), np.arange(2, D)]
  glob = np.zeros(D)
  mom = [np.zeros(2), np.zeros(D - 2)]
  local = [np.zeros(D) for _ in range(M)]
  acc = [np.zeros(D) for _ in range(M)]
  own_mom = [[np.zeros(2), np.zeros(D - 2)] for _ in range(M)]
  shift = [np.zeros(D) for _ in range(M)]
  for u in range(updates):
    p, q = u % 2, (u - 1) % 2
    pushes = []
    for m in range(M):
      for h in range(steps):
        if h == overlap and u >= 1:
          idx = frags[q]
          local[m][idx] = alpha * local[m][idx] + (1 - alpha) * glob[idx]
          acc[m][idx] = local[m][idx] - glob[idx]
        at = local[m] + shift[m] if eager and h < overlap else local[m]
        d = -INNER_LR * grad(at)
        local[m] += d
        acc[m] += d
      if overlap == steps and u >= 1:
        idx = frags[q]
        local[m][idx] = alpha * local[m][idx] + (1 - alpha) * glob[idx]
        acc[m][idx] = local[m][idx] - glob[idx]
      pushes.append(-acc[m][frags[p]])
      if eager:
        # The stand-in: glob_p + delta with delta the worker's own Nesterov step on its own outer gradient.
        own_mom[m][p] = pushes[-1] + MOMENTUM * own_mom[m][p]
        delta = -OUTER_LR * (pushes[-1] + MOMENTUM * own_mom[m][p])
        shift[m] = np.zeros(D)
        shift[m][frags[p]] = (glob[frags[p]] + delta) - local[m][frags[p]]
    g = np.mean([quantize(x) for x in pushes] if quantize else pushes, axis=0)
    # optax's Nesterov: trace <- g + mu * trace; step = -lr * (g + mu * trace).
    mom[p] = g + MOMENTUM * mom[p]
    glob[frags[p]] -= OUTER_LR * (g + MOMENTUM * mom[p])
  return glob


@pytest.mark.fast_compile
@pytest.mark.parametrize("overlap, alpha", [(2, 0.5), (4, 0.0)])
def test_two_fragments_with_overlap_and_merge_match_numpy(overlap, alpha):
  data, params, loss_fn = _problem()
  sched = _bsp(8)
  outer = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
  # Full-batch minibatches: each is the whole data set, so the reference needs no sampling.
  result = dj.simulate(loss_fn, dj.per_fragment(outer, [0, 1]), params, data, sched, seed=0,
                       sampling=dj.Sampling(batch_size=N, scheme="epoch"),
                       worker=dj.workers.StreamingDiLoCo(4, optax.sgd(INNER_LR), fragments=[0, 1], overlap=overlap,
                                                         alpha=alpha))
  got = np.concatenate([np.asarray(result.params["a"]), np.asarray(result.params["b"])])
  np.testing.assert_allclose(got, _reference(data, 8, 4, overlap, alpha), rtol=2e-4, atol=1e-5)


def _two_fragment_run(overlap, alpha, eager, outer=None, updates=8):
  data, params, loss_fn = _problem()
  outer = outer or optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
  worker = dj.workers.StreamingDiLoCo(4, optax.sgd(INNER_LR), fragments=[0, 1], overlap=overlap, alpha=alpha,
                                      eager=outer if eager else None)
  result = dj.simulate(loss_fn, dj.per_fragment(outer, [0, 1]), params, data, _bsp(updates), seed=0,
                       sampling=dj.Sampling(batch_size=N, scheme="epoch"), worker=worker)
  return data, np.concatenate([np.asarray(result.params["a"]), np.asarray(result.params["b"])])


@pytest.mark.fast_compile
@pytest.mark.parametrize("overlap, alpha", [(2, 0.5), (4, 0.0)])
def test_eager_updates_match_numpy(overlap, alpha):
  data, got = _two_fragment_run(overlap, alpha, eager=True)
  want = _reference(data, 8, 4, overlap, alpha, eager=True)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)
  # The stand-in moves the result: eager is not the non-eager run (whose reference is a distinct number).
  lazy = _reference(data, 8, 4, overlap, alpha)
  assert np.max(np.abs(want - lazy)) > 100 * (2e-4 * np.max(np.abs(want)) + 1e-5)


def test_eager_without_overlap_is_non_eager_bit_for_bit():
  # tau = 0: the average arrives before any step could use the stand-in.
  _, eager = _two_fragment_run(0, 0.5, eager=True)
  _, lazy = _two_fragment_run(0, 0.5, eager=False)
  np.testing.assert_array_equal(eager, lazy)


def test_eager_with_fedavg_outer_is_non_eager_bit_for_bit():
  # Outer SGD with lr 1 and no momentum steps by exactly minus the outer gradient: the stand-in global fragment is
  # the worker's own local fragment, e = 0 exactly, whatever the overlap.
  fedavg = optax.sgd(1.0)
  _, eager = _two_fragment_run(2, 0.5, eager=True, outer=fedavg)
  _, lazy = _two_fragment_run(2, 0.5, eager=False, outer=fedavg)
  np.testing.assert_array_equal(eager, lazy)
  assert np.all(np.isfinite(lazy)) and not np.array_equal(lazy, 0.0)


def test_per_fragment_updates_one_fragment_per_update_with_its_own_state():
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  tx = dj.per_fragment(optax.sgd(0.5, momentum=0.9), [0, 1])
  state = tx.init(params)
  g = {"a": jnp.full(2, 2.0), "b": jnp.full(3, 4.0)}
  u0, state = tx.update(g, state, params)
  u1, state = tx.update(g, state, params)
  u2, state = tx.update(g, state, params)
  np.testing.assert_allclose(np.asarray(u0["a"]), -1.0)
  np.testing.assert_array_equal(np.asarray(u0["b"]), 0.0)
  np.testing.assert_array_equal(np.asarray(u1["a"]), 0.0)
  np.testing.assert_allclose(np.asarray(u1["b"]), -2.0)
  # Fragment a's second step: its own momentum, untouched by update 1: trace = 2 + 0.9 * 2.
  np.testing.assert_allclose(np.asarray(u2["a"]), -0.5 * (2 + 0.9 * 2), rtol=1e-6)


def test_fragment_of_leaves_cuts_contiguous_runs_first_ones_longer():
  params = {"a": jnp.ones(1), "b": jnp.ones(1), "c": jnp.ones(1), "d": jnp.ones(1), "e": jnp.ones(1)}
  assert dj.fragment_of_leaves(params, 2) == (0, 0, 0, 1, 1)
  assert dj.fragment_of_leaves(params, 5) == (0, 1, 2, 3, 4)
  assert dj.fragment_of_leaves(params, 1) == (0,) * 5


def test_bad_streaming_settings_are_refused():
  with pytest.raises(ValueError, match="overlap"):
    dj.workers.StreamingDiLoCo(2, optax.sgd(0.1), overlap=3)
  with pytest.raises(ValueError, match="alpha"):
    dj.workers.StreamingDiLoCo(2, optax.sgd(0.1), alpha=1.5)
  with pytest.raises(TypeError, match="optimizer"):
    dj.workers.StreamingDiLoCo(2, "sgd")
  with pytest.raises(TypeError, match="StreamingDiLoCo.eager.*got bool"):
    dj.workers.StreamingDiLoCo(2, optax.sgd(0.1), overlap=1, eager=True)
  with pytest.raises(ValueError, match="every fragment"):
    dj.per_fragment(optax.sgd(0.1), [0, 2])
  with pytest.raises(ValueError, match="one fragment per leaf"):
    dj.per_fragment(optax.sgd(0.1), [0, 1, 1]).init({"a": jnp.ones(2), "b": jnp.ones(2)})
  with pytest.raises(ValueError, match="at most the number of leaves"):
    dj.fragment_of_leaves({"a": jnp.ones(2)}, 2)


def test_quantized_exchange_matches_numpy_and_a_float32_format_changes_nothing():
  data, params, loss_fn = _problem()
  outer = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)

  def run(server):
    worker = dj.workers.StreamingDiLoCo(4, optax.sgd(INNER_LR), fragments=[0, 1], overlap=2, alpha=0.5)
    result = dj.simulate(loss_fn, server, params, data, _bsp(8), seed=0,
                         sampling=dj.Sampling(batch_size=N, scheme="epoch"), worker=worker)
    return np.concatenate([np.asarray(result.params["a"]), np.asarray(result.params["b"])])

  def quantized(tx):
    # Each worker's push is one contribution: rounded on its own, then averaged in float32.
    return optax.chain(dj.per_contribution(tx), dj.per_fragment(outer, [0, 1]))

  e3m0 = run(quantized(dj.quantize_float(3, 0)))
  want = _reference(data, 8, 4, 2, 0.5, quantize=lambda x: numpy_quantize(x, 3, 0))
  np.testing.assert_allclose(e3m0, want, rtol=2e-4, atol=1e-5)
  exact = _reference(data, 8, 4, 2, 0.5)
  assert np.max(np.abs(want - exact)) > 100 * (2e-4 * np.max(np.abs(want)) + 1e-5)
  # float32's own widths round nothing: the same run as per_contribution of the identity, bit for bit.
  np.testing.assert_array_equal(run(quantized(dj.quantize_float(8, 23))), run(quantized(optax.identity())))
  np.testing.assert_allclose(run(dj.per_fragment(outer, [0, 1])), exact, rtol=2e-4, atol=1e-5)
