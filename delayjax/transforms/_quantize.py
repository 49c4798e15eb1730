r"""Rounding updates to a tiny floating-point format: Streaming DiLoCo's quantized outer exchange."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from delayjax._checks import check_bool, check_int
from delayjax.transforms._extra_args import stateless_leaf_map

__all__ = ["quantize_float"]

# The widest format this rounds to is float32's own: the rounding is computed in float32 (float64 for float64
# leaves), whose 8 exponent and 23 mantissa bits bound what a format can add.
_MAX_EXPONENT_BITS, _MAX_MANTISSA_BITS = 8, 23


def _times_pow2(x: jax.Array, n: jax.Array) -> jax.Array:
  """``x * 2**n``, exact while the result is a normal number: each factor is built from its bits (``jnp.ldexp``
  takes ``2 ** n`` through a floating-point power, which XLA need not round exactly), and ``n`` is split in two
  in-range factors, the first as large as allowed, so that the partial product lies between ``x`` and the result."""
  info = jnp.finfo(x.dtype)
  bias = int(info.maxexp) - 1
  itype = jnp.int64 if x.dtype == jnp.float64 else jnp.int32

  def pow2(j):
    return jax.lax.bitcast_convert_type((j.astype(itype) + bias) << int(info.nmant), x.dtype)

  first = jnp.clip(n, 1 - bias, bias)
  return x * pow2(first) * pow2(jnp.clip(n - first, 1 - bias, bias))


def quantize_float(exponent_bits: int, mantissa_bits: int, *,
                   scale_by_max: bool = True) -> optax.GradientTransformationExtraArgs:
  r"""Rounds each update leaf to the nearest value of a small floating-point format (sign, E exponent, M mantissa bits).

  The format :math:`F` (``exponent_bits`` :math:`= E \ge 1`,
  ``mantissa_bits`` :math:`= M \ge 0`, bias :math:`b = 2^{E-1} - 1`) has no
  infinities nor NaNs, like OCP's FP4 E2M1: every exponent code is a number,
  code 0 the subnormals,

  .. math::

    F = \{\pm 2^{1-b}\, \tfrac{j}{2^M} : 0 \le j < 2^M\} \cup
        \{\pm 2^{c-b} (1 + \tfrac{j}{2^M}) : 1 \le c \le 2^E - 1,\ 0 \le j < 2^M\},

  largest value :math:`f_{\max} = 2^{2^E - 1 - b} (2 - 2^{-M})`. E3M0 (4 bits)
  is :math:`\{0, \pm\tfrac14, \pm\tfrac12, \pm 1, \pm 2, \pm 4, \pm 8, \pm 16\}`,
  E2M1 is OCP's FP4 :math:`\{0, \pm\tfrac12, \pm 1, \pm\tfrac32, \pm 2, \pm 3, \pm 4, \pm 6\}`.
  With ``scale_by_max`` (the default) each leaf :math:`g` gets its own
  power-of-two scale that puts its largest magnitude in the format's top
  binade, as the shared scale of OCP's Microscaling (MX) formats, one per
  tensor:

  .. math::

    k = \lfloor \log_2 \max_i |g_i| \rfloor, \qquad s = 2^{\,k - (2^E - 1 - b)}, \qquad
    q(g)_i = s \cdot \operatorname{clip}\bigl(\operatorname{rnd}_F(g_i / s),\ -f_{\max},\ f_{\max}\bigr)

  where :math:`\operatorname{rnd}_F` rounds to the nearest value of
  :math:`F`'s grid (extended past :math:`f_{\max}`, then saturated), ties to
  the one whose encoding is even (IEEE 754's roundTiesToEven on the bit
  pattern: the even mantissa, or with :math:`M = 0` the even exponent code).
  A power of two, not :math:`f_{\max} / \max_i |g_i|`, so that scaling is
  exact and a format at least as wide as the leaf's is the identity bit for bit
  (``quantize_float(8, 23)`` on float32); with :math:`M = 0` the top binade
  holds :math:`f_{\max}` only, so the largest magnitude maps to
  :math:`f_{\max}` exactly. Without ``scale_by_max``, :math:`s = 1`: the
  values are :math:`F`'s own. A leaf of zeros, or holding a NaN or an
  infinity, is returned unchanged (the runtime's non-finite checks still see
  it). The rounding is computed in float32 (float64 for float64 leaves) and
  cast back: bfloat16 in, bfloat16 out. Stateless.

  In Streaming DiLoCo each worker quantizes its own outer gradient before the
  all-reduce and the average is taken in full precision; in ``dj.simulate``
  that is ``dj.per_contribution`` around it at the head of the server's chain,
  where each worker's push is one contribution:
  ``optax.chain(dj.per_contribution(dj.quantize_float(3, 0)), dj.per_fragment(outer, fragments))``
  (``dj.per_fragment`` wraps the outer optimizer only: it steps one fragment's
  state per update, so the quantizer, stateless, goes before it).

  Args:
    exponent_bits: :math:`1 \le E \le 8`, the format's exponent bits.
    mantissa_bits: :math:`0 \le M \le 23`, the format's mantissa bits.
    scale_by_max: whether each leaf is scaled by the power of two above
      (``True``), or rounded to the format's own values (``False``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (state ``optax.EmptyState``).

  Raises:
    TypeError, ValueError: naming the argument, if a bit count is not an
      integer in its range or ``scale_by_max`` not a bool (here); TypeError
      if a leaf is not floating point (at the first update).

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.quantize_float(3, 0)  # E3M0: 0, 1/4, ..., 16, times a power of two per leaf
    >>> g = jnp.array([0.3, -0.05, 0.011, 0.0])
    >>> q, _ = tx.update(g, tx.init(g))
    >>> q.tolist()  # s = 2**(-2 - 4): 0.3 / s = 19.2 rounds to 16, 0.011 / s = 0.704 to 1/2
    [0.25, -0.0625, 0.0078125, 0.0]

  References:
    **The paper's section on quantization was not reachable from here;
    third-party summaries of it say the outer gradients are exchanged as
    4-bit floats and accumulated in 32 bits. The format's conventions (no
    infinities, subnormals), the per-tensor power-of-two scale and the ties
    are this module's choices.**
    Douillard, Donchev, Rush, Kale, Sinha, Ballé, Kuncoro, Ranzato, Szlam,
    Lampinen, `Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch <https://arxiv.org/abs/2501.18512>`_, 2025.

    Rouhani et al., `Microscaling Data Formats for Deep Learning
    <https://arxiv.org/abs/2310.10537>`_, 2023 (a power-of-two scale shared
    by a block, here a tensor, putting its largest magnitude in the element
    format's top binade; FP4 E2M1 with no infinities nor NaNs).
  """
  exponent_bits = check_int("exponent_bits", exponent_bits, minimum=1)
  mantissa_bits = check_int("mantissa_bits", mantissa_bits, minimum=0)
  if exponent_bits > _MAX_EXPONENT_BITS:
    raise ValueError(f"exponent_bits must be at most {_MAX_EXPONENT_BITS} (float32's, the precision the rounding is "
                     f"computed in), got {exponent_bits}.")
  if mantissa_bits > _MAX_MANTISSA_BITS:
    raise ValueError(f"mantissa_bits must be at most {_MAX_MANTISSA_BITS} (float32's, the precision the rounding is "
                     f"computed in), got {mantissa_bits}.")
  scale_by_max = check_bool("scale_by_max", scale_by_max)
  bias = 2 ** (exponent_bits - 1) - 1
  top_exponent, bottom_exponent = 2 ** exponent_bits - 1 - bias, 1 - bias

  def leaf(g):
    if not jnp.issubdtype(g.dtype, jnp.floating):
      raise TypeError(f"quantize_float rounds floating-point updates, got a leaf of dtype {g.dtype}.")
    work = jnp.float64 if g.dtype == jnp.float64 else jnp.float32
    x = g.astype(work)
    amax = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), work)
    # frexp: amax = f 2^e with f in [1/2, 1), so floor(log2 amax) = e - 1; a power-of-two shift is exact.
    shift = jnp.frexp(amax)[1] - 1 - top_exponent if scale_by_max else jnp.zeros((), jnp.int32)
    # Each value's quantum is 2^(its binade - M), the binade floored at the format's subnormal one.
    binade = jnp.maximum(jnp.frexp(x)[1] - 1, bottom_exponent + shift)
    t = _times_pow2(x, mantissa_bits - binade)  # in [2^M, 2^(M+1)) (below 2^M for subnormals): exact
    n = jnp.round(t)  # half to even: the even mantissa (M >= 1), or 0 over the smallest subnormal
    if mantissa_bits == 0:
      # With no mantissa, a tie 1.5 * 2^c lies between exponent codes c and c + 1: the even code wins.
      code = binade - shift + bias
      n = jnp.where(jnp.abs(t) == 1.5, jnp.sign(t) * jnp.where(code % 2 == 1, 2.0, 1.0).astype(work), n)
    rounded = _times_pow2(n, binade - mantissa_bits)
    largest = _times_pow2(jnp.asarray(2 ** (mantissa_bits + 1) - 1, work), top_exponent + shift - mantissa_bits)
    rounded = jnp.clip(rounded, -largest, largest)
    # Zeros and non-finite leaves have no scale (and NaN must stay visible): as they are.
    keep = (amax == 0) | ~jnp.isfinite(amax) if scale_by_max else ~jnp.isfinite(x)
    return jnp.where(keep, x, rounded).astype(g.dtype)

  return stateless_leaf_map(leaf)
