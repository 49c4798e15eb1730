"""scale_by_staleness and staleness_weight against each rule's formula."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

TAUS = np.arange(0, 40)

FORMULAS = [
    ("inverse", {}, lambda t: 1.0 / np.maximum(t, 1)),
    ("polynomial", {}, lambda t: (1.0 + t) ** -0.5),
    ("polynomial", {"a": 2.0}, lambda t: (1.0 + t) ** -2.0),
    ("hinge", {}, lambda t: np.where(t <= 4, 1.0, 1.0 / (10.0 * (t - 4) + 1.0))),
    ("hinge", {"a": 0.5, "b": 10}, lambda t: np.where(t <= 10, 1.0, 1.0 / (0.5 * np.maximum(t - 10, 0) + 1.0))),
    ("exponential", {}, lambda t: np.exp(-0.1 * t)),
    ("exponential", {"a": 1.5}, lambda t: np.exp(-1.5 * t)),
    ("constant", {}, lambda t: np.ones_like(t, dtype=np.float64)),
    ("constant", {"value": 0.3}, lambda t: np.full(t.shape, 0.3)),
    ("drop", {"threshold": 7}, lambda t: (t <= 7).astype(np.float64)),
]


@pytest.mark.parametrize("rule, kwargs, formula", FORMULAS)
def test_weight_matches_formula(rule, kwargs, formula):
  w = jax.jit(dj.staleness_weight(rule, **kwargs))(jnp.asarray(TAUS, jnp.int32))
  assert w.dtype == jnp.float32
  np.testing.assert_allclose(w, formula(TAUS.astype(np.float64)), rtol=2e-6)


@pytest.mark.parametrize("rule, kwargs, formula", FORMULAS)
def test_scaled_update_matches_formula(rule, kwargs, formula):
  tx = dj.scale_by_staleness(rule, **kwargs)
  g = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(2)}
  update = jax.jit(tx.update)
  for tau in (0, 3, 5, 17):
    u, _ = update(g, tx.init(g), None, staleness=tau)
    s = formula(np.asarray(float(tau)))
    np.testing.assert_allclose(u["w"], np.asarray(g["w"]) * s, rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose(u["b"], np.asarray(g["b"]) * s, rtol=2e-6)


def test_callable_rule():
  tx = dj.scale_by_staleness(lambda tau: 1.0 / (1.0 + tau.astype(jnp.float32)) ** 2)
  u, _ = tx.update(jnp.full(3, 2.0), optax.EmptyState(), staleness=3)
  np.testing.assert_allclose(u, np.full(3, 2.0 / 16.0))


@pytest.mark.parametrize("rule, kwargs", [(r, k) for r, k, _ in FORMULAS if r != "constant" or not k])
def test_zero_staleness_passes_updates_bit_for_bit(rule, kwargs):
  # Op by op (no jit) the arithmetic is the same, so the results are bit-identical; under jit XLA
  # may fuse the two programs differently (e.g. fused multiply-adds), so they agree to rounding.
  tx = optax.chain(dj.scale_by_staleness(rule, **kwargs), optax.sgd(0.1, momentum=0.9))
  ref = optax.sgd(0.1, momentum=0.9)
  g = jax.random.normal(jax.random.PRNGKey(0), (8,))
  for update, ref_update, check in (
      (tx.update, ref.update, np.testing.assert_array_equal),
      (jax.jit(tx.update), jax.jit(ref.update), lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6))):
    s, r = tx.init(g), ref.init(g)
    for _ in range(3):
      u, s = update(g, s, g, staleness=0)
      v, r = ref_update(g, r, g)
      check(u, v)


def test_per_leaf_staleness_scales_each_leaf_by_its_own_weight():
  tx = dj.scale_by_staleness("inverse")
  g = {"enc": jnp.ones(3), "dec": jnp.ones(2)}
  u, _ = tx.update(g, tx.init(g), staleness={"enc": 4, "dec": 2})
  np.testing.assert_allclose(u["enc"], np.full(3, 0.25))
  np.testing.assert_allclose(u["dec"], np.full(2, 0.5))


def test_drop_gives_exact_zero_even_for_non_finite_gradients():
  tx = dj.scale_by_staleness("drop", threshold=2)
  g = jnp.array([jnp.inf, jnp.nan, 1.0])
  u, _ = tx.update(g, optax.EmptyState(), staleness=3)
  np.testing.assert_array_equal(u, np.zeros(3))
  u, _ = tx.update(g, optax.EmptyState(), staleness=2)
  np.testing.assert_array_equal(u, np.asarray(g))


def test_bf16_updates_keep_their_dtype():
  tx = dj.scale_by_staleness("polynomial", a=1.0)
  u, _ = tx.update(jnp.ones(4, jnp.bfloat16), optax.EmptyState(), staleness=1)
  assert u.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(u, np.float32), np.full(4, 0.5))


@pytest.mark.parametrize("make, exc, match", [
    (lambda: dj.scale_by_staleness("linear"), ValueError, "rule must be one of 'inverse'"),
    (lambda: dj.scale_by_staleness("inverse", a=1.0), TypeError, "takes: none"),
    (lambda: dj.scale_by_staleness("hinge", c=1.0), TypeError, r"unexpected keyword argument 'c'"),
    (lambda: dj.scale_by_staleness("hinge", value=1.0), TypeError, r"unexpected arguments \['value'\]; it takes: a, b"),
    (lambda: dj.scale_by_staleness("polynomial", a=jnp.ones(2)), ValueError, r"a must be a scalar, got shape \(2,\)"),
    (lambda: dj.scale_by_staleness("polynomial", a=jnp.float32(-1)), ValueError, "a must be >= 0.0"),
    (lambda: dj.scale_by_staleness("drop", threshold=jnp.float32(1.5)), TypeError, "threshold must be an integer"),
    (lambda: dj.scale_by_staleness("drop"), TypeError, r"needs the argument\(s\) \['threshold'\]"),
    (lambda: dj.scale_by_staleness("drop", threshold=-1), ValueError, "threshold must be an integer >= 0"),
    (lambda: dj.scale_by_staleness("polynomial", a=-1.0), ValueError, "a must be >= 0.0"),
    (lambda: dj.scale_by_staleness("exponential", a=float("nan")), ValueError, "a must be finite"),
    (lambda: dj.scale_by_staleness(lambda t: t, a=1), TypeError, "callable staleness rule takes no keyword"),
])
def test_bad_construction(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


def test_missing_or_mismatched_staleness():
  tx = dj.scale_by_staleness()
  g = {"a": jnp.ones(2), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match="needs the extra argument staleness="):
    tx.update(g, tx.init(g))
  with pytest.raises(ValueError, match="structure of the updates"):
    tx.update(g, tx.init(g), staleness={"a": 1})
  with pytest.raises(ValueError, match="scalar or a pytree of scalars"):
    tx.update(g, tx.init(g), staleness=jnp.ones(2, jnp.int32))


@pytest.mark.parametrize("staleness, exc, match", [
    (-3, ValueError, "staleness must be an integer >= 0 .*got -3"),
    (2.7, ValueError, "staleness must be an integer >= 0 .*got 2.7"),
    (jnp.float32(jnp.nan), ValueError, "staleness must be an integer >= 0"),
    (np.array(-1, np.int64), ValueError, "got -1"),
    (True, TypeError, "staleness must be an integer >= 0"),
    ({"a": 1, "b": -2}, ValueError, "got -2"),
])
def test_concrete_staleness_must_be_a_non_negative_integer(staleness, exc, match):
  g = {"a": jnp.ones(2), "b": jnp.ones(2)}
  for tx in (dj.scale_by_staleness("polynomial"), dj.fed_buff(optax.sgd(1.0), 2), dj.async_adam(0.1, staleness_rule="inverse"),
             dj.delay_adaptive_sgd(0.1, 0.2), dj.mindthestep(0.1, 4, target_momentum=0.5)):
    with pytest.raises(exc, match=match):
      tx.update(g, tx.init(g), g, staleness=staleness, stale_params=g)
  with pytest.raises(exc, match=match):
    dj.staleness_weight("inverse")(staleness["b"] if isinstance(staleness, dict) else staleness)


def test_whole_float_staleness_is_that_integer():
  tx = dj.scale_by_staleness("polynomial", a=1.0)
  g = jnp.ones(2)
  np.testing.assert_array_equal(tx.update(g, tx.init(g), staleness=3.0)[0], tx.update(g, tx.init(g), staleness=3)[0])


STALENESS_RULES = (lambda: dj.scale_by_staleness("polynomial"), lambda: dj.fed_buff(optax.sgd(1.0), 2),
                   lambda: dj.async_adam(0.1, staleness_rule="inverse"), lambda: dj.delay_adaptive_sgd(0.1, 0.2),
                   lambda: dj.mindthestep(0.1, 4, target_momentum=0.5))


@pytest.mark.parametrize("staleness, shown", [
    (np.int64(2**32 + 5), "4294967301"),
    (np.float64(1e10), "10000000000.0"),
    (2**40, "1099511627776"),
    (2**31, "2147483648"),
    (2**70, str(2**70)),
    ({"a": 1, "b": np.int64(2**33)}, "8589934592"),
])
def test_staleness_past_int32_is_refused_showing_the_value_given(staleness, shown):
  """Every rule casts staleness to int32: 2**32 + 5 acted as 5 and 1e10 was reported as -2147483648."""
  g = {"a": jnp.ones(2), "b": jnp.ones(2)}
  match = rf"staleness must be an integer in \[0, 2\*\*31 - 1 = 2147483647\] \(it is int32\), got {shown}\."
  for make in STALENESS_RULES:
    tx = make()
    with pytest.raises(ValueError, match=match):
      tx.update(g, tx.init(g), g, staleness=staleness, stale_params=g)


def test_the_largest_int32_staleness_is_its_own_weight():
  tau = 2**31 - 1
  u, _ = dj.scale_by_staleness("inverse").update(jnp.ones(2), optax.EmptyState(), staleness=np.int64(tau))
  np.testing.assert_allclose(u, np.full(2, 1.0 / tau), rtol=1e-6)


def test_pipemare_checks_its_staleness_like_every_staleness_rule():
  """PipeMare took a missing staleness as 0 and a negative one as 1 (no rescheduling, no error)."""
  g = {"w": jnp.ones(2)}
  tx = dj.pipemare(0.1, warmup_steps=4)
  state = tx.init(g)
  with pytest.raises(ValueError, match="pipemare needs the extra argument staleness="):
    tx.update(g, state, g)
  for bad, match in ((-1, "got -1"), (float("nan"), "got nan"), (2.5, "got 2.5"),
                     (np.int64(2**32 + 5), r"\[0, 2\*\*31 - 1 = 2147483647\].*got 4294967301")):
    with pytest.raises(ValueError, match=f"staleness must be an integer.*{match}"):
      tx.update(g, state, g, staleness=bad)
  with pytest.raises(ValueError, match=r"staleness must be a scalar \(one delay per stage\), got shape \(2,\)"):
    tx.update(g, state, g, staleness=jnp.ones(2, jnp.int32))
  # At t = 0 the step is alpha / tau.
  np.testing.assert_allclose(tx.update(g, state, g, staleness=4)[0]["w"], np.full(2, -0.1 / 4), rtol=1e-6)
  corrected = dj.pipemare(0.1, warmup_steps=4, discrepancy_decay=0.5)
  with pytest.raises(ValueError, match="pipemare needs the extra argument backward_staleness="):
    corrected.update(g, corrected.init(g), g, staleness=4)
  with pytest.raises(ValueError, match="backward_staleness must be an integer >= 0.*got -2"):
    corrected.update(g, corrected.init(g), g, staleness=4, backward_staleness=-2)
