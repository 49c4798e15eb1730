"""Delay models: ranges, exact distributions, determinism, per-leaf draws and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from delayjax import delays

NUM_DRAWS = 20_000


def draws(model, num=NUM_DRAWS, seed=0):
  key = jax.random.PRNGKey(seed)
  steps = jnp.arange(num, dtype=jnp.int32)
  return np.asarray(jax.jit(jax.vmap(lambda t: model.sample(jax.random.fold_in(key, t), t)))(steps))


@pytest.mark.parametrize("model", [
    delays.constant(0), delays.constant(5), delays.uniform(0), delays.uniform(6),
    delays.geometric(0.3, 8), delays.geometric(1.0, 3), delays.categorical([0.5, 0.0, 0.25, 0.25]),
])
def test_empirical_distribution_matches_pmf(model):
  d = draws(model)
  assert d.dtype == np.int32
  assert d.min() >= 0 and d.max() <= model.max_delay
  p = model.pmf()
  assert p.shape == (model.max_delay + 1,)
  np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-12)
  freq = np.bincount(d, minlength=model.max_delay + 1) / d.size
  # Five binomial standard deviations: fails for a wrong distribution, not by chance.
  tol = 5 * np.sqrt(p * (1 - p) / d.size) + 1e-12
  assert np.all(np.abs(freq - p) <= tol), (freq, p)
  np.testing.assert_allclose(model.mean(), np.dot(np.arange(p.size), p))


def test_geometric_pmf_is_the_truncated_closed_form():
  p, s = 0.25, 6
  k = np.arange(s + 1)
  expected = p * (1 - p) ** k / np.sum(p * (1 - p) ** k)
  np.testing.assert_allclose(delays.geometric(p, s).pmf(), expected, rtol=1e-12)


def test_trace_replays_in_order_and_cycles():
  logged = [3, 0, 2, 5, 1]
  d = draws(delays.trace(logged), num=12)
  np.testing.assert_array_equal(d, np.resize(logged, 12))
  assert delays.trace(logged).max_delay == 5
  np.testing.assert_allclose(delays.trace(logged).pmf(), np.bincount(logged, minlength=6) / 5)


def test_same_seed_same_draws_different_seed_different_draws():
  model = delays.uniform(7)
  np.testing.assert_array_equal(draws(model, 500, seed=3), draws(model, 500, seed=3))
  assert not np.array_equal(draws(model, 500, seed=3), draws(model, 500, seed=4))


def test_is_constant():
  assert delays.constant(3).is_constant and delays.uniform(0).is_constant
  assert delays.trace([2, 2]).is_constant and not delays.trace([2, 1]).is_constant
  assert not delays.uniform(2).is_constant and not delays.geometric(0.5, 2).is_constant
  assert delays.per_leaf({"a": delays.constant(1), "b": delays.constant(2)}).is_constant


def test_per_leaf_draws_independently_and_broadcasts_to_subtrees():
  model = delays.per_leaf({"enc": delays.uniform(9), "dec": delays.uniform(9)})
  assert model.max_delay == 9
  params = {"enc": {"w": jnp.ones(2), "b": jnp.ones(1)}, "dec": jnp.ones(3)}
  key = jax.random.PRNGKey(0)
  per_step = [delays.sample_for(model, jax.random.fold_in(key, t), t, params) for t in range(200)]
  enc_w = np.array([int(d["enc"]["w"]) for d in per_step])
  enc_b = np.array([int(d["enc"]["b"]) for d in per_step])
  dec = np.array([int(d["dec"]) for d in per_step])
  np.testing.assert_array_equal(enc_w, enc_b)  # one draw per covering model
  assert np.mean(enc_w == dec) < 0.3  # independent: equal about 1/10 of the time
  leaf_models = delays.leaf_models(model, params)
  assert leaf_models["enc"]["w"] is model.models["enc"] and leaf_models["dec"] is model.models["dec"]


def test_plain_model_broadcasts_to_every_leaf():
  params = {"a": jnp.ones(2), "b": [jnp.ones(1), jnp.ones(1)]}
  models = delays.leaf_models(delays.constant(2), params)
  assert all(m == delays.constant(2) for m in jax.tree.leaves(models, is_leaf=lambda x: isinstance(x, dj.delays.DelayModel)))


@pytest.mark.parametrize("make, exc, match", [
    (lambda: delays.constant(-1), ValueError, "tau must be an integer >= 0, got -1"),
    (lambda: delays.constant(1.5), TypeError, "tau must be an integer"),
    (lambda: delays.uniform(-2), ValueError, "max_delay must be an integer >= 0"),
    (lambda: delays.geometric(0.0, 3), ValueError, "p must be > 0.0"),
    (lambda: delays.geometric(1.5, 3), ValueError, "p must be <= 1.0"),
    (lambda: delays.geometric(float("nan"), 3), ValueError, "p must be finite"),
    (lambda: delays.trace([]), ValueError, "non-empty"),
    (lambda: delays.trace([1, -1]), ValueError, "delays must be >= 0"),
    (lambda: delays.trace([1.5]), ValueError, "integers"),
    (lambda: delays.categorical([0.0, 0.0]), ValueError, "not all zero"),
    (lambda: delays.categorical([0.5, -0.1]), ValueError, "non-negative"),
    (lambda: delays.per_leaf({"a": 3}), TypeError, "leaves are delay models"),
    (lambda: delays.per_leaf({}), ValueError, "at least one"),
    (lambda: delays.leaf_models(delays.per_leaf({"x": delays.constant(1)}), {"y": 1}), ValueError,
     "not a prefix of the parameter tree"),
    (lambda: delays.leaf_models("constant", {"y": 1}), TypeError, "delay model"),
])
def test_bad_input(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


INT32_RANGE = r"must be (an integer|integers) in \[0, 2\*\*31 - 2 = 2147483646\] \(delays and the max_delay \+ 1 buffer slots"


@pytest.mark.parametrize("make, name, given", [
    (lambda: delays.constant(2**31), "tau", 2**31),
    (lambda: delays.constant(2**31 - 1), "tau", 2**31 - 1),
    (lambda: delays.uniform(10**10), "max_delay", 10**10),
    (lambda: delays.geometric(0.5, 2**40), "max_delay", 2**40),
    (lambda: delays.trace([1, 2**31]), "delays", 2**31),
    (lambda: delays.trace(np.array([3, 2**33], np.int64)), "delays", 2**33),
])
def test_delays_past_int32_are_refused_by_name(make, name, given):
  """Delays are int32 in the traced code: ``trace([2**31])`` overflowed at its first draw and ``uniform(10**10)``
  at its first sample, and ``geometric(p, 2**40)`` tried to allocate 2**40 probabilities."""
  with pytest.raises(ValueError, match=rf"^{name} {INT32_RANGE}.*got {given}\.$"):
    make()


def test_the_largest_int32_delay_is_drawn_exactly():
  top = 2**31 - 2
  assert int(delays.constant(top).sample(jax.random.PRNGKey(0), 0)) == top
  assert int(delays.trace([top, 0]).sample(None, 0)) == top
  d = draws(delays.uniform(top), num=64)
  assert d.min() >= 0 and d.max() <= top and d.max() > 2**30


@pytest.mark.parametrize("p, max_delay", [(0.5, 5000), (1e-6, 1_100_000)])
def test_geometric_built_in_blocks_is_the_closed_form_bit_for_bit(p, max_delay):
  """The table is built in blocks of 2**20 and stops once the tail has underflowed: the same probabilities as
  ``p (1 - p)^k`` for every ``k`` at once, normalized (one case underflows, one spans two blocks)."""
  direct = p * (1.0 - p) ** np.arange(max_delay + 1)
  direct = direct[: np.flatnonzero(direct)[-1] + 1]
  np.testing.assert_array_equal(np.asarray(delays.geometric(p, max_delay).probs), direct / direct.sum())
  assert delays.geometric(p, max_delay).max_delay == max_delay


@pytest.mark.parametrize("make, exc, match", [
    (lambda: delays.trace([True, False]), TypeError, r"delays must hold integers, got entries of dtype bool"),
    (lambda: delays.trace(["1", "2"]), TypeError, r"delays must hold integers, got entries of dtype <U1 \(e.g. '1'\)"),
    (lambda: delays.trace(3), TypeError, r"delays must be a non-empty 1-D sequence of integers, got 3 of type int"),
    (lambda: delays.trace(None), TypeError, r"delays must be a non-empty 1-D sequence of integers, got None"),
    (lambda: delays.trace([[1], [2, 3]]), TypeError, r"delays must be a non-empty 1-D sequence of integers"),
    (lambda: delays.trace([1, float("inf")]), ValueError, r"delays must be integers .*got inf"),
    (lambda: delays.categorical([True, False]), TypeError, r"probs must hold probabilities, got entries of dtype bool"),
    (lambda: delays.categorical(["a"]), TypeError, r"probs must hold probabilities"),
    (lambda: delays.categorical(0.5), TypeError, r"probs must be a non-empty 1-D sequence of probabilities, got 0.5"),
    (lambda: delays.trace([1, 2]).sample(None, 1.5), TypeError, r"step must be an integer scalar .*got 1.5"),
    (lambda: delays.trace([1, 2]).sample(None, -1), ValueError, r"step must be in \[0, 2\*\*31 - 1\] .*got -1"),
    (lambda: delays.sample_for(3, jax.random.PRNGKey(0), 0, {"w": 1}), TypeError, r"model must be a delay model"),
])
def test_inputs_that_were_silent_or_obscure(make, exc, match):
  """Booleans were taken as delays 1 and 0 (a mask passed by mistake), strings and scalars failed inside NumPy,
  and a negative or fractional step of a trace wrapped around or was truncated."""
  with pytest.raises(exc, match=match):
    make()
