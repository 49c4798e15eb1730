"""Non-finite values are never silent: reported in the history and by a warning, and skipped on request."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._sampling import minibatch_indices

N, UPDATES, SEED, BAD = 8, 40, 1, 3


def _loss(w, batch):
  return jnp.mean(batch["c"]) * jnp.sum(w)  # gradient c (the minibatch's one example) for every entry


def _data(value):
  c = np.ones(N, np.float32)
  c[BAD] = value
  return {"c": c}


def _draws():
  # The stale-read model with delay 0: one worker, update t draws the worker's t-th minibatch.
  return np.array([int(minibatch_indices(SEED, t, 0, t, num_examples=N, batch_size=1)[0]) for t in range(UPDATES)])


def _run(tx, data, nonfinite="report"):
  return dj.simulate(_loss, tx, jnp.zeros(2), data, dj.delays.constant(0), num_updates=UPDATES,
                     sampling=dj.Sampling(batch_size=1), seed=SEED, execution=dj.Execution(chunk_size=8),
                     record=dj.Record(nonfinite=nonfinite))


def test_a_nan_gradient_is_reported_with_its_update_and_worker():
  first = int(np.argmax(_draws() == BAD))
  with pytest.warns(RuntimeWarning, match=f"gradients were not finite, the first at update {first} from worker 0"):
    result = _run(optax.sgd(0.1), _data(np.nan))
  assert result.history.nonfinite[0].tolist() == [first, 0]
  # The NaN reached the parameters in the chunk of that update.
  lo, hi = result.history.nonfinite_state
  assert lo <= first <= hi


def _adam_skipping_reference(data, lr):
  """Plain Optax Adam over the same minibatches, an update skipped when it or the new state is not finite."""
  tx = optax.adam(lr)
  params, state, skipped = jnp.zeros(2), tx.init(jnp.zeros(2)), []
  for t, i in enumerate(_draws()):
    updates, new_state = tx.update(jnp.full(2, data["c"][i]), state, params)
    if all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((updates, new_state))
           if jnp.issubdtype(x.dtype, jnp.inexact)):
      params, state = optax.apply_updates(params, updates), new_state
    else:
      skipped.append(t)
  return params, skipped


@pytest.mark.standard_promotion
def test_adam_second_moment_overflow_is_reported_and_skipped():
  # A finite but huge gradient: g * g overflows float32, Adam's second moment becomes inf and its updates
  # 0, so the run would stall with finite parameters and finite gradients.
  data = _data(1e25)
  first = int(np.argmax(_draws() == BAD))
  with pytest.warns(RuntimeWarning, match="optimizer state became non-finite"):
    stalled = _run(optax.adam(0.1), data)
  assert len(stalled.history.nonfinite) == 0
  lo, hi = stalled.history.nonfinite_state
  assert lo <= first <= hi

  with pytest.warns(RuntimeWarning, match=f"updates were skipped .* the first at update {first}"):
    skipping = _run(optax.adam(0.1), data, nonfinite="skip")
  params, skipped = _adam_skipping_reference(data, 0.1)
  assert skipping.history.skipped[:, 0].tolist() == skipped
  assert skipping.history.nonfinite_state is None
  np.testing.assert_allclose(np.asarray(skipping.params), np.asarray(params), rtol=1e-6)


@pytest.mark.standard_promotion
def test_a_finite_run_stays_quiet():
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    result = _run(optax.adam(0.1), _data(2.0), nonfinite="skip")
  assert result.history.nonfinite_state is None and len(result.history.skipped) == 0


@pytest.mark.parametrize("lead", [0, 1])
def test_the_finiteness_flag_of_a_tree_equals_numpy(lead):
  # One reduction per dtype over the leaves joined (not one per leaf): the flags must still be those of every
  # entry, per row of the leading axis with lead=1, whichever leaf and dtype holds the NaN or the infinity.
  from delayjax.runtime._simulate import _all_finite
  rng = np.random.default_rng(0)
  tree = {"a": rng.normal(size=(4, 3, 2)).astype(np.float32), "b": rng.normal(size=(4, 5)).astype(jnp.bfloat16),
          # Entries near float32's largest: finite, though their sum is not.
          "c": np.full((4, 3), 3e38, np.float32), "empty": np.zeros((4, 0), np.float32)}
  tree["a"][1, 2, 0] = np.nan
  tree["b"][2, 4] = np.inf
  tree["c"][3, 1] = -np.inf
  expected = np.array([all(np.all(np.isfinite(np.asarray(x[r], np.float64))) for x in tree.values())
                       for r in range(4)])
  got = np.asarray(_all_finite(jax.tree.map(jnp.asarray, tree), lead=lead))
  np.testing.assert_array_equal(got, expected if lead else expected.all())
  assert not expected.all() and expected[0]
  np.testing.assert_array_equal(_all_finite({"empty": jnp.zeros((4, 0))}, lead=lead), np.ones((4,) * lead, bool))


@pytest.mark.parametrize("options", [None, {"xla_cpu_use_fusion_emitters": False}], ids=["default", "elemental"])
@pytest.mark.parametrize("size", [3, 700, 5000])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_finiteness_flag_finds_one_bad_entry_in_a_leaf_of_any_size(options, size, bad):
  # Reductions on the CPU may drop a NaN (a max of |x| over a leaf of 5,000 entries with one NaN gave 1.0): the
  # flag must not depend on one.
  from delayjax.runtime._simulate import _all_finite

  rng = np.random.default_rng(size)
  tree = {"big": rng.normal(size=(4, size)).astype(np.float32), "half": rng.normal(size=(4, 5)).astype(np.float16),
          "count": np.arange(8, dtype=np.int32).reshape(4, 2)}
  tree["big"][2, size // 2] = bad
  tree["half"][0, 1] = bad
  flags = jax.jit(lambda t: _all_finite(t, lead=1), compiler_options=options)(tree)
  want = np.array([np.isfinite(tree["big"][r]).all() and np.isfinite(tree["half"][r]).all() for r in range(4)])
  np.testing.assert_array_equal(np.asarray(flags), want)
  whole = jax.jit(_all_finite, compiler_options=options)({"big": tree["big"][1:2], "count": tree["count"]})
  assert bool(whole)


def test_one_nan_entry_of_a_large_gradient_is_reported_from_the_first_update():
  # The square root's gradient at 0 times 0 is NaN in entry 5 of every gradient; the loss stays finite.
  n = 5000
  x = np.random.default_rng(0).normal(size=(64, n)).astype(np.float32)

  def loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2) + jnp.sqrt(w[5] - w[5]) * 0.0

  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(2, seed=0), num_updates=4, seed=0)
  with pytest.warns(RuntimeWarning, match="4 gradients were not finite, the first at update 0"):
    result = dj.simulate(loss, optax.sgd(0.01), jnp.zeros(n), {"x": x, "y": x[:, 0]}, schedule,
                         sampling=dj.Sampling(batch_size=8))
  assert result.history.nonfinite.shape[0] == 4
