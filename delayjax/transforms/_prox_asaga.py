"""Sparse proximal SAGA with stale reads (ProxASAGA): reweighted average gradient and prox on the sample's support."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax.transforms._extra_args import nan_unless, require_extra
from delayjax.transforms._hyperparams import check_positive_rate, check_static_int, rate_at
from delayjax.transforms._proximal import ProxFn
from delayjax.transforms._rows import after_reads


class ProxAsagaState(NamedTuple):
  """State of :func:`prox_asaga`."""

  table: jax.Array  # shape=[num_samples], float32 (float64 for float64 params): s_i of each sample's last gradient
  table_sum: jax.Array  # shape=[d], the table's dtype: sum_i s_i a_i, that is n times alpha_bar
  count: jax.Array  # shape=(), int32: updates applied so far (indexes a learning-rate schedule)

  def runtime_inputs(self) -> tuple[str, ...]:
    return ("sample_features", "sample_indices", "sample_mask", "sample_scalars")


def _one(name: str, value: Any, what: str) -> jax.Array:
  """A scalar, or the single entry of a ``[1]`` array, for the one-sample update."""
  value = jnp.asarray(require_extra("prox_asaga", name, value, what, runtime_passes=False))
  if value.shape not in ((), (1,)):
    raise ValueError(f"{name} must be a scalar or have shape [1] (one sample per update), got shape {value.shape}.")
  return value.reshape(())


def _row(sample_features: Any, d: int) -> tuple[jax.Array, jax.Array]:
  """The sample's padded CSR row ``(indices int32 [k], values [k])``, checked when concrete."""
  require_extra("prox_asaga", "sample_features", sample_features,
                "the sample's padded CSR row (indices [k], values [k])", runtime_passes=False)
  if isinstance(sample_features, dict):
    sample_features = (sample_features.get("indices"), sample_features.get("values"))
  if not isinstance(sample_features, (tuple, list)) or len(sample_features) != 2:
    raise TypeError(
        f"sample_features must be a pair (indices, values) or a dict with keys 'indices' and 'values', got "
        f"{type(sample_features).__name__}.")
  indices, values = (jnp.asarray(a) for a in sample_features)
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise TypeError(f"sample_features indices must be integers, got dtype {indices.dtype}.")
  if indices.shape != values.shape or indices.ndim not in (1, 2) or (indices.ndim == 2 and indices.shape[0] != 1):
    raise ValueError(
        f"sample_features indices and values must both have shape [k] or [1, k]; got {indices.shape} and "
        f"{values.shape}.")
  indices, values = indices.reshape(-1), values.reshape(-1)
  if not isinstance(indices, jax.core.Tracer) and not isinstance(values, jax.core.Tracer):
    idx, val = np.asarray(indices), np.asarray(values)
    if idx.size and (idx.min() < 0 or idx.max() >= d):
      raise ValueError(f"sample_features indices must be in [0, d) = [0, {d}); got values in [{idx.min()}, "
                       f"{idx.max()}].")
    support = idx[val != 0]
    if np.unique(support).size != support.size:
      raise ValueError(f"the nonzero slots of sample_features must have distinct indices; got {idx.tolist()}.")
  return indices.astype(jnp.int32), values


def _check_vector(name: str, x: Any, d: int) -> None:
  if not isinstance(x, jax.Array | np.ndarray) or jnp.shape(x) != (d,):
    raise ValueError(
        f"prox_asaga works on one parameter vector: {name} must be an array of shape [d] = ({d},) (d = "
        f"len(support_counts)); got {type(x).__name__} with shape {jnp.shape(x) if hasattr(x, 'shape') else None}.")


def prox_asaga(num_samples: int, learning_rate: float | optax.Schedule, prox: ProxFn, *,
               support_counts: Any) -> optax.GradientTransformationExtraArgs:
  r"""Sparse proximal SAGA (ProxASAGA): each update touches only the sample's support.

  A complete optimizer (step and prox) for the composite objective
  :math:`F(w) + g(w)`, :math:`F(w) = \frac1n \sum_i f_i(w)` a generalized
  linear model with :math:`\nabla f_i(w) = s_i\, a_i`, and :math:`g`
  separable, :math:`g(w) = \sum_j g_j(w_j)`. The state keeps the scalar
  :math:`\alpha_i` (so that sample :math:`i`'s stored gradient is
  :math:`\alpha_i a_i`) and :math:`\bar\alpha = \frac1n \sum_i \alpha_i a_i`.
  Let :math:`T_i` be the support of :math:`a_i` (its nonzero features),
  :math:`n_j` the number of samples whose support contains :math:`j`
  (``support_counts``) and :math:`D_i` the diagonal matrix with
  :math:`d_j = n / n_j` on :math:`T_i` and 0 elsewhere. An update on sample
  :math:`i` whose scalar :math:`s_i` was computed at the parameters
  :math:`\hat w` a worker read (``stale_params``; the current ``params``
  when synchronous) is, on :math:`T_i` only,

  .. math::

    v_{T_i} = (s_i - \alpha_i)\, [a_i]_{T_i} + [D_i \bar\alpha]_{T_i}, \qquad
    \delta w_{T_i} = \big[\text{prox}_{\gamma \varphi_i}(\hat w - \gamma v)\big]_{T_i} - \hat w_{T_i},

    w_{T_i} \leftarrow w_{T_i} + \delta w_{T_i}, \qquad
    \alpha_i \leftarrow s_i, \qquad \varphi_i(x) = \sum_{j \in T_i} d_j\, g_j(x_j)

  and the output is :math:`\delta w` (zero off :math:`T_i`), to be added to
  ``params`` with ``optax.apply_updates``. Since
  :math:`\mathbb E_i D_i = I`, :math:`v` is an unbiased estimate of
  :math:`\nabla F` and :math:`\varphi_i` of :math:`g`; the prox of
  :math:`\varphi_i` is the prox of :math:`g` with the step
  :math:`\gamma d_j` on coordinate :math:`j`. This is Algorithm 1 of
  Pedregosa, Leblond & Lacoste-Julien (ProxASAGA) with consistent reads:
  :math:`\delta w` is computed from the stale :math:`\hat w` and added to
  the current :math:`w`, while the table and :math:`\bar\alpha` are read when
  the update is applied (the server's state, as in ``dj.saga``); the
  inconsistent (partially written) reads of lock-free threads are not
  modelled. With every support full (:math:`d_j = 1`) and no staleness it is
  the dense ProxSAGA ``optax.chain(dj.saga(n, table="scalars"),
  optax.sgd(lr), dj.proximal(prox, lr))``.

  Put an L2 term of the objective in the prox
  (``dj.prox_elastic_net(l1, lam)``), not in :math:`s_i`: it is separable,
  so it is reweighted like the L1 term. (The authors' code instead takes the
  reweighted gradient step :math:`d_j \lambda w_j`; both are unbiased.)
  ``prox`` is called on the ``[k]`` values of the support with a ``[k]``
  array of steps, so it must act coordinate-wise and accept an array step:
  ``dj.prox_l1``, ``dj.prox_elastic_net`` and ``dj.prox_box`` with scalar
  bounds do. Coordinates outside every support are never changed.

  Extra arguments (one sample per update): ``sample_indices`` (the sample
  :math:`i`, an int scalar or ``[1]``), ``sample_scalars`` (:math:`s_i =
  \phi'(a_i^\top \hat w, y_i)`, a scalar or ``[1]``), ``sample_features``
  (the padded CSR row of :math:`a_i`: a pair ``(indices [k], values [k])``
  or a dict with those keys, as in ``dj.problems``; slots with value 0 are
  padding), and optionally ``stale_params`` (:math:`\hat w`; default
  ``params``). The values of ``updates`` are not used (pass e.g. the
  gradient or zeros): the sparse step needs only :math:`s_i`; the output
  has ``updates``' dtype. Indices are checked when concrete; a traced
  ``sample_indices`` outside ``[0, n)`` makes the update NaN on the
  sample's support and writes no table entry. An optional
  ``sample_mask`` (bool, a scalar or ``[1]``) false makes the update change
  nothing. ``dj.simulate`` computes these inputs with ``batch_size=1`` and
  one contribution per update (ASP, stale reads) when given
  ``sample_terms=lambda w, b: (problem.per_sample(w, b).scalars,
  {"indices": b["indices"], "values": b["values"]})`` for a sparse
  ``dj.problems`` problem; ``stale_params`` are then the worker's read.

  Args:
    num_samples: :math:`n` (``>= 1``).
    learning_rate: :math:`\gamma`, a number ``> 0``, a scalar array or a schedule of the
      update count (the paper's analysis takes :math:`\gamma = 1/(5L)`).
    prox: ``(x, step) -> prox_{step g}(x)``, coordinate-wise (see above).
    support_counts: :math:`n_j`, integers ``[d]`` in ``[0, n]``, e.g.
      ``dj.problems.FiniteSum.support_counts()``; ``d`` is the length of the
      parameter vector.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` on a single parameter
    vector ``[d]`` that needs ``params`` and the extra arguments above.

  Raises:
    ValueError: at update, for a missing extra argument, params that are not
      one ``[d]`` vector, or (when concrete) an index outside ``[0, n)`` or
      ``[0, d)``, a repeated feature index, or a feature with
      :math:`n_j = 0`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> # two samples: a_0 = (1, 0, 0), a_1 = (0, 2, 0); n_j = (1, 1, 0)
    >>> tx = dj.prox_asaga(2, 0.5, dj.prox_l1(0.1), support_counts=jnp.array([1, 1, 0]))
    >>> w = jnp.zeros(3)
    >>> state = tx.init(w)
    >>> u, state = tx.update(w, state, w, sample_indices=0, sample_scalars=-1.0,
    ...                      sample_features=(jnp.array([0]), jnp.array([1.0])))
    >>> u  # v_0 = -1 - 0 + 2 * 0; soft-threshold 0.5 by 0.5 * 2 * 0.1
    Array([0.4, 0. , 0. ], dtype=float32)
    >>> u, state = tx.update(w, state, w + u, sample_indices=1, sample_scalars=1.0,
    ...                      sample_features=(jnp.array([1]), jnp.array([2.0])))
    >>> u  # v_1 = 2 + 2 * (0 / 2): w_1 = soft(0 - 1, 0.1)
    Array([ 0. , -0.9,  0. ], dtype=float32)

  References:
    Pedregosa, Leblond, Lacoste-Julien, `Breaking the Nonsmooth Barrier: A
    Scalable Parallel Method for Composite Optimization
    <https://arxiv.org/abs/1707.06468>`_, NeurIPS 2017.

    Defazio, Bach, Lacoste-Julien, `SAGA: A Fast Incremental Gradient Method
    With Support for Non-Strongly Convex Composite Objectives
    <https://arxiv.org/abs/1407.0202>`_, NeurIPS 2014.
  """
  n = check_static_int("num_samples", num_samples, minimum=1)
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  if not callable(prox):
    raise TypeError(f"prox must be a callable (x, step) -> x, got {prox!r}.")
  counts = np.asarray(support_counts)
  if not np.issubdtype(counts.dtype, np.integer):
    raise TypeError(f"support_counts must be integers (the n_j), got dtype {counts.dtype}.")
  if counts.ndim != 1 or counts.size == 0:
    raise ValueError(f"support_counts must have shape [d] with d >= 1, got {counts.shape}.")
  if counts.min() < 0 or counts.max() > n:
    raise ValueError(
        f"support_counts must be in [0, num_samples] = [0, {n}]; got values in [{counts.min()}, {counts.max()}].")
  d = int(counts.size)
  # d_j = n / n_j; 0 where no sample has feature j (the authors' choice; such a coordinate is never touched).
  weights = np.where(counts > 0, n / np.maximum(counts, 1), 0.0)

  def init_fn(params):
    _check_vector("params", params, d)
    dtype = jnp.float64 if jnp.result_type(params) == jnp.float64 else jnp.float32  # bfloat16 sums badly
    return ProxAsagaState(table=jnp.zeros([n], dtype), table_sum=jnp.zeros([d], dtype),
                          count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, sample_indices=None, sample_scalars=None, sample_features=None,
                sample_mask=None, stale_params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("prox_asaga needs params: the step is taken from the parameters on the sample's support.")
    _check_vector("params", params, d)
    _check_vector("updates", updates, d)
    read = params if stale_params is None else stale_params
    _check_vector("stale_params", read, d)
    i = _one("sample_indices", sample_indices, "the sample's index in [0, num_samples), an int scalar")
    if not jnp.issubdtype(i.dtype, jnp.integer):
      raise TypeError(f"sample_indices must be an integer, got dtype {i.dtype}.")
    if not isinstance(i, jax.core.Tracer) and not 0 <= int(i) < n:
      raise ValueError(f"sample_indices must be in [0, num_samples) = [0, {n}), got {int(i)}.")
    dtype = state.table.dtype
    s_new = _one("sample_scalars", sample_scalars, "s_i = phi'(a_i.w, y_i) at the read parameters").astype(dtype)
    cols, vals = _row(sample_features, d)
    if not isinstance(cols, jax.core.Tracer) and not isinstance(vals, jax.core.Tracer):
      empty = np.asarray(cols)[(np.asarray(vals) != 0) & (counts[np.asarray(cols)] == 0)]
      if empty.size:
        raise ValueError(f"sample_features has features {empty.tolist()} whose support_counts are 0; "
                         "support_counts must count the data's nonzeros.")
    # A masked sample (a runtime's padding or a skipped contribution) changes nothing.
    keep = jnp.asarray(True) if sample_mask is None else _one("sample_mask", sample_mask, "bool, whether it counts")
    if keep.dtype != jnp.bool_:
      raise TypeError(f"sample_mask must be a bool, got dtype {keep.dtype}.")
    # A kept traced index out of range makes the step NaN (see nan_unless) and writes nothing, rather than
    # reading a clamped row or writing a wrapped-around one.
    shown = (vals != 0) & keep  # the coordinates the update moves
    on_support, recorded, in_range = shown, keep, None  # ... and the tables record
    if isinstance(i, jax.core.Tracer):
      valid = (i >= 0) & (i < n)
      i = jnp.where(valid, i, jnp.asarray(n, i.dtype))
      on_support, recorded, in_range = shown & valid, keep & valid, valid | ~keep
    vals = vals.astype(dtype)
    d_t = jnp.asarray(weights, dtype)[cols]
    step = jnp.asarray(nan_unless(in_range, rate_at(learning_rate, state.count), dtype), dtype)
    delta_alpha = (s_new - state.table[i]) * vals
    v = delta_alpha + d_t * state.table_sum[cols] / jnp.asarray(n, dtype)
    w_hat = read[cols].astype(dtype)
    moved = jnp.where(shown, prox(w_hat - step * v, step * d_t) - w_hat, jnp.zeros_like(w_hat))
    # Padding slots add zero, whatever index they repeat.
    out = jnp.zeros([d], updates.dtype).at[cols].add(moved.astype(updates.dtype))
    # Both tables are written after everything read from them, so in place inside loops (see after_reads).
    table_sum = state.table_sum.at[after_reads(cols, d, out)].add(
        jnp.where(on_support, delta_alpha, jnp.zeros_like(delta_alpha)))
    table = state.table.at[after_reads(i, n, out, table_sum)].set(jnp.where(recorded, s_new, state.table[i]))
    return out, ProxAsagaState(table=table, table_sum=table_sum, count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
