"""dj.quantize_float against a NumPy rounding over the format's enumerated values, ml_dtypes' casts, and identities."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import delayjax as dj


def format_values(exponent_bits, mantissa_bits):
  """The format's non-negative values in code order (code = exponent code * 2^M + mantissa), from the definition."""
  bias = 2 ** (exponent_bits - 1) - 1
  values = []
  for code in range(2 ** (exponent_bits + mantissa_bits)):
    e, j = divmod(code, 2**mantissa_bits)
    frac = j / 2**mantissa_bits
    values.append(2.0 ** (1 - bias) * frac if e == 0 else 2.0 ** (e - bias) * (1 + frac))
  return np.array(values)


def numpy_quantize(x, exponent_bits, mantissa_bits, scale_by_max=True):
  """Nearest of s * values (ties: the even code), s the power of two putting max |x| in the top binade."""
  x = np.asarray(x, np.float64)
  amax = np.max(np.abs(x)) if x.size else 0.0
  if scale_by_max and (amax == 0 or not np.isfinite(amax)):
    return x.copy()
  values = format_values(exponent_bits, mantissa_bits)
  top = 2**exponent_bits - 1 - (2 ** (exponent_bits - 1) - 1)
  scale = 2.0 ** (np.floor(np.log2(amax)) - top) if scale_by_max else 1.0
  grid = values * scale
  out = np.empty_like(x)
  for i, v in enumerate(x.ravel()):
    dist = np.abs(grid - abs(v))
    near = np.flatnonzero(dist == dist.min())
    code = near[0] if len(near) == 1 else next(c for c in near if c % 2 == 0)
    out.ravel()[i] = np.copysign(grid[code], v)
  return out


def apply(tx, updates):
  out, state = jax.jit(tx.update)(updates, tx.init(updates))
  assert isinstance(state, optax.EmptyState)
  return out


def test_e3m0_values_are_the_powers_of_two_from_a_quarter_to_sixteen():
  np.testing.assert_array_equal(format_values(3, 0), [0, 0.25, 0.5, 1, 2, 4, 8, 16])
  np.testing.assert_array_equal(format_values(2, 1), [0, 0.5, 1, 1.5, 2, 3, 4, 6])  # OCP FP4 E2M1


@pytest.mark.parametrize("bits", [(3, 0), (2, 1), (4, 3), (1, 2), (3, 2)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_numpy_on_random_values_zeros_negatives_and_ties(bits, dtype):
  e, m = bits
  rng = np.random.default_rng(e * 10 + m)
  random = rng.normal(size=40) * 10.0 ** rng.uniform(-3, 1, size=40)
  # Every midpoint between neighbouring values (and their negatives), scaled by the leaf's own scale 2^-3:
  # the largest magnitude is f_max * 2^-3, put in as the first entry.
  values = format_values(e, m)
  ties = (values[:-1] + values[1:]) / 2 * 2.0**-3
  leaf = np.concatenate([[values[-1] * 2.0**-3, 0.0, -0.0], ties, -ties]).astype(dtype)
  updates = {"random": jnp.asarray(random, dtype), "ties": jnp.asarray(leaf), "zeros": jnp.zeros(3, dtype)}
  out = apply(dj.quantize_float(e, m), updates)
  for name, u in updates.items():
    assert out[name].dtype == dtype
    want = numpy_quantize(np.asarray(u, np.float64), e, m)
    np.testing.assert_array_equal(np.asarray(out[name], np.float64), want, err_msg=name)
  # Each tie went to one of its two neighbours, and not all the same way (the even code decides).
  got = np.asarray(out["ties"], np.float64)[3:3 + len(ties)] / 2.0**-3
  up, down = got == values[1:], got == values[:-1]
  assert np.all(up | down) and up.any() and down.any()


def test_e3m0_worked_example():
  # s = 2^(floor(log2 0.3) - 4) = 2^-6: 0.3 / s = 19.2 -> 16; -0.05 / s = -3.2 -> -4; 0.011 / s = 0.704 -> 1/2;
  # 0.0044 / s = 0.28 -> 1/4; 0.003 / s = 0.192 -> 1/4 (nearer than 0); 0.0019 / s = 0.12 -> 0.
  g = jnp.array([0.3, -0.05, 0.011, 0.0044, 0.003, 0.0019])
  want = np.array([16, -4, 0.5, 0.25, 0.25, 0]) * 2.0**-6
  np.testing.assert_array_equal(np.asarray(apply(dj.quantize_float(3, 0), g)), want.astype(np.float32))


@pytest.mark.parametrize("bits, target", [((2, 1), ml_dtypes.float4_e2m1fn), ((2, 3), ml_dtypes.float6_e2m3fn),
                                          ((3, 2), ml_dtypes.float6_e3m2fn)])
def test_unscaled_is_ml_dtypes_cast_within_range(bits, target):
  # ml_dtypes' OCP formats have no infinities nor NaNs either: without the scale, within +-f_max, the same cast.
  fmax = float(ml_dtypes.finfo(target).max)
  x = np.random.default_rng(1).uniform(-fmax, fmax, size=500).astype(np.float32)
  got = np.asarray(apply(dj.quantize_float(*bits, scale_by_max=False), jnp.asarray(x)))
  np.testing.assert_array_equal(got, x.astype(target).astype(np.float32))
  # Beyond f_max it saturates.
  big = np.asarray(apply(dj.quantize_float(*bits, scale_by_max=False), jnp.asarray([3 * fmax, -5 * fmax])))
  np.testing.assert_array_equal(big, [fmax, -fmax])


@pytest.mark.parametrize("bits, dtype, bit_dtype", [((8, 23), jnp.float32, np.uint32),
                                                    ((8, 7), jnp.bfloat16, np.uint16),
                                                    ((5, 10), jnp.float16, np.uint16)])
def test_the_leaf_own_format_is_the_identity_bit_for_bit(bits, dtype, bit_dtype):
  rng = np.random.default_rng(2)
  span = 30 if dtype == jnp.float32 else 3  # float32 spans 2^+-30 here; half formats less (their own range)
  x = rng.normal(size=300) * 2.0 ** rng.integers(-span, span, size=300)
  x[:5] = 0.0
  x = jnp.asarray(x, dtype)
  got = apply(dj.quantize_float(*bits), {"w": x, "neg": -x})
  for k, want in (("w", x), ("neg", -x)):
    assert got[k].dtype == dtype
    np.testing.assert_array_equal(np.asarray(got[k]).view(bit_dtype), np.asarray(want).view(bit_dtype))


def test_zero_and_nonfinite_leaves_are_unchanged_and_empty_leaves_pass():
  tx = dj.quantize_float(3, 0)
  out = apply(tx, {"z": jnp.zeros(3), "nan": jnp.array([1.0, jnp.nan]), "inf": jnp.array([0.3, -jnp.inf]),
                   "empty": jnp.zeros((0,))})
  np.testing.assert_array_equal(np.asarray(out["z"]), 0.0)
  np.testing.assert_array_equal(np.asarray(out["nan"]), [1.0, np.nan])
  np.testing.assert_array_equal(np.asarray(out["inf"]), np.float32([0.3, -np.inf]))
  assert out["empty"].shape == (0,)


def test_each_leaf_has_its_own_scale_and_extra_args_are_accepted():
  tx = dj.quantize_float(3, 0)
  g = {"big": jnp.array([100.0, 3.0]), "small": jnp.array([1e-3, 3e-4])}
  out, _ = tx.update(g, tx.init(g), g, staleness=jnp.int32(2), worker=jnp.int32(0))
  for k in g:
    np.testing.assert_array_equal(np.asarray(out[k]), numpy_quantize(np.asarray(g[k]), 3, 0).astype(np.float32))
  assert float(out["small"][0]) != 0.0


def test_jit_scan_no_recompile_and_inside_a_chain():
  tx = optax.chain(dj.quantize_float(3, 0), optax.sgd(0.1))
  params = jnp.array([1.0, -2.0, 0.5])

  def step(carry, _):
    p, s = carry
    u, s = tx.update(2 * p, s, p)
    return (optax.apply_updates(p, u), s), p

  (final, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=3)
  p = np.asarray(params, np.float64)
  for _ in range(3):
    p = p - 0.1 * numpy_quantize(2 * p, 3, 0)
  np.testing.assert_allclose(np.asarray(final), p, rtol=1e-6)
  update = jax.jit(dj.quantize_float(3, 0).update)
  update(params, optax.EmptyState())
  update(params + 1.0, optax.EmptyState())
  assert update._cache_size() == 1


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(exponent_bits=0, mantissa_bits=0), ValueError, "exponent_bits must be an integer >= 1, got 0"),
    (dict(exponent_bits=9, mantissa_bits=0), ValueError, "exponent_bits must be at most 8"),
    (dict(exponent_bits=3, mantissa_bits=-1), ValueError, "mantissa_bits must be an integer >= 0, got -1"),
    (dict(exponent_bits=3, mantissa_bits=24), ValueError, "mantissa_bits must be at most 23"),
    (dict(exponent_bits=3.0, mantissa_bits=0), TypeError, "exponent_bits must be an integer, got 3.0"),
    (dict(exponent_bits=3, mantissa_bits=True), TypeError, "mantissa_bits must be an integer, got True"),
    (dict(exponent_bits=3, mantissa_bits=0, scale_by_max="yes"), TypeError, "scale_by_max must be a bool"),
])
def test_bad_arguments_are_named(kwargs, error, words):
  with pytest.raises(error, match=words):
    dj.quantize_float(**kwargs)


def test_integer_leaf_is_refused():
  tx = dj.quantize_float(3, 0)
  with pytest.raises(TypeError, match="floating-point updates, got a leaf of dtype int32"):
    tx.update(jnp.arange(3, dtype=jnp.int32), optax.EmptyState())
