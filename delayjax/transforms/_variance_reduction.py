"""Variance-reduced gradient estimators: SVRG (AsySVRG) and SAGA (ASAGA)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._checks import check_choice
from delayjax._sharding import stacked_zeros
from delayjax.transforms._extra_args import like_updates, masked_like, nan_unless, require_extra
from delayjax.transforms._hyperparams import check_static_int
from delayjax.transforms._rows import after_reads

SAGA_TABLES = ("gradients", "scalars")


class SvrgState(NamedTuple):
  """State of :func:`svrg`."""

  snapshot: Any  # pytree like params: the snapshot parameters w~ of the current epoch
  full_grad: Any  # pytree like params: mu, the full gradient at the snapshot
  num_snapshots: jax.Array  # shape=(), int32: snapshots taken so far (0: no full gradient yet)

  def runtime_inputs(self) -> tuple[str, ...]:
    # The snapshot gradient must be computed on each contribution's own minibatch, and the full
    # gradient at epoch starts: only the runtime has the loss and the data.
    return ("full_grad", "snapshot_grad")

  def snapshot_params(self) -> Any:
    """The snapshot parameters at which a runtime computes ``snapshot_grad``."""
    return self.snapshot


class SagaState(NamedTuple):
  """State of :func:`saga`."""

  table: Any  # pytree of [num_samples, *shape] per leaf ("gradients"), or float32 [num_samples] ("scalars")
  table_sum: Any  # pytree like params: the sum over samples of the stored gradients
  count: jax.Array  # shape=(), int32: updates applied so far

  def runtime_inputs(self) -> tuple[str, ...]:
    return ("sample_grads", "sample_indices", "sample_mask")


class SagaScalarsState(SagaState):
  """State of :func:`saga` with ``table="scalars"`` (the table is float32 ``[num_samples]``)."""

  def runtime_inputs(self) -> tuple[str, ...]:
    return ("sample_features", "sample_indices", "sample_mask", "sample_scalars")


def svrg() -> optax.GradientTransformationExtraArgs:
  r"""Stochastic variance-reduced gradient (SVRG), also under staleness (AsySVRG).

  The output is a gradient estimate; chain a step after it, e.g.
  ``optax.chain(dj.svrg(), optax.sgd(lr))``. For a finite sum
  :math:`F(w) = \frac1n \sum_i f_i(w)`, an epoch fixes snapshot parameters
  :math:`\tilde w` and the full gradient :math:`\mu = \nabla F(\tilde w)`;
  each update of the epoch turns the minibatch gradient :math:`g = \nabla
  f_B(\hat w)` (``updates``, computed at the parameters :math:`\hat w` a
  worker read: the current ones when synchronous, stale ones under delays)
  into

  .. math::

    v = \nabla f_B(\hat w) - \nabla f_B(\tilde w) + \mu

  where :math:`\nabla f_B(\tilde w)` is the extra argument ``snapshot_grad``:
  the gradient *on the same minibatch* :math:`B` at the snapshot. Since
  :math:`\mathbb E_B \nabla f_B(\tilde w) = \mu`, :math:`v` is an unbiased
  estimate of :math:`\nabla F(\hat w)` whose variance vanishes as
  :math:`\hat w` and :math:`\tilde w` approach the optimum.

  Epochs: an update that receives ``full_grad`` (and ``refresh`` true, the
  default) first starts a new epoch, :math:`\tilde w \leftarrow w` (the
  ``params`` of that update, the last iterate: Johnson & Zhang's option I,
  as in AsySVRG) and :math:`\mu \leftarrow` ``full_grad``, which the caller
  computed at those parameters; its ``snapshot_grad`` is then at the new
  snapshot, i.e. at ``params``. The textbook epoch is: take a snapshot with
  the full gradient, then :math:`m` updates with ``snapshot_grad`` computed
  at ``state.snapshot``. Under ``jit``/``lax.scan`` pass ``full_grad`` at
  every update and a traced boolean ``refresh`` to choose when it is taken.
  The first update must take a snapshot: before any, eager calls raise and
  traced ones return NaN.

  Asynchronous form (AsySVRG): with delays, ``updates`` is the gradient at
  the stale read :math:`\hat w` and ``snapshot_grad`` the gradient of the same
  minibatch at the snapshot held in the state when the update is applied, so
  that :math:`v` stays unbiased for :math:`\nabla F(\hat w)`; the step is then
  applied to the current parameters by the chained optimizer.

  Parameter-server form (Zhang, Zheng & Kwok's distributed asynchronous
  semi-stochastic gradient method). **Only the paper's abstract could be read
  from a reachable source**: distributed asynchronous workers, variance
  reduction, a constant step and a linear rate. delayjax's reading of that
  design, under which the rule is AsySVRG's: each stage starts with the full
  gradient at the snapshot (the last iterate), summed from the workers' data
  shards; workers then pull the parameters from the servers, compute the
  variance-reduced gradient of a minibatch of their own shard at that stale
  copy and push it, and the servers apply it with the constant step. That is
  this rule with ``optax.sgd(lr)`` chained, ``dj.Sampling(scheme="shard")``
  and a schedule whose reads never precede their stage's snapshot; a test
  pins it against a NumPy re-implementation of that loop.

  Runtimes: the state requests ``full_grad`` and ``snapshot_grad`` through
  the ``runtime_inputs`` hook, and ``dj.simulate`` computes them with any
  delay source: epochs every ``snapshot_every`` updates, the full gradient
  at each epoch start, and every contribution's snapshot gradient on its own
  minibatch, in its worker's lane (AsySVRG). ``dj.delayed`` delays
  ``updates`` but passes extra arguments through at apply time, so it would
  pair a gradient with another minibatch's ``snapshot_grad``: use
  ``dj.simulate``, or write the loop.

  Args:
    (none): the estimator has no hyperparameters; the step size belongs to
      the chained optimizer.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and
    the extra argument ``snapshot_grad`` (a pytree like the updates), and
    takes ``full_grad`` (a pytree like the updates) and ``refresh`` (a bool
    scalar) to start an epoch.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.svrg(), optax.sgd(0.5))
    >>> w = jnp.array([1.0, 2.0])
    >>> state = tx.init(w)
    >>> # epoch start: snapshot = w, mu = full gradient there; v = g - g + mu = mu
    >>> u, state = tx.update(jnp.array([3.0, 0.0]), state, w, snapshot_grad=jnp.array([3.0, 0.0]),
    ...                      full_grad=jnp.array([1.0, 1.0]))
    >>> u
    Array([-0.5, -0.5], dtype=float32)
    >>> u, state = tx.update(jnp.array([2.0, 4.0]), state, w + u, snapshot_grad=jnp.array([1.0, 0.0]))
    >>> u  # -0.5 * ([2, 4] - [1, 0] + [1, 1])
    Array([-1. , -2.5], dtype=float32)

  References:
    Johnson, Zhang, `Accelerating Stochastic Gradient Descent using Predictive
    Variance Reduction
    <https://proceedings.neurips.cc/paper_files/paper/2013/hash/ac1dd209cbcc5e5d1c6e28598e8cbbe8-Abstract.html>`_,
    NeurIPS 2013.

    Zhao, Li, `Fast Asynchronous Parallel Stochastic Gradient Descent: A Lock-Free
    Approach with Convergence Guarantee <https://doi.org/10.1609/aaai.v30i1.10305>`_, AAAI 2016.

    Zhang, Zheng, Kwok, `Asynchronous Distributed Semi-Stochastic Gradient
    Optimization <https://arxiv.org/abs/1508.01633>`_, AAAI 2016.
  """

  def init_fn(params):
    return SvrgState(snapshot=jax.tree.map(jnp.array, params), full_grad=jax.tree.map(jnp.zeros_like, params),
                     num_snapshots=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, snapshot_grad=None, full_grad=None, refresh=None, **extra_args):
    del extra_args
    require_extra("svrg", "snapshot_grad", snapshot_grad,
                  "the gradient of the same minibatch at the snapshot parameters, a pytree like the updates",
                  runtime_passes=False)
    snapshot_grad = like_updates("snapshot_grad", snapshot_grad, updates)
    snapshot, mu, num = snapshot_step("svrg", updates, params, full_grad, refresh, state.snapshot, state.full_grad,
                                      state.num_snapshots)
    ready = num > 0
    out = jax.tree.map(
        lambda g, gs, m: jnp.where(ready, g - gs.astype(g.dtype) + m.astype(g.dtype), jnp.full_like(g, jnp.nan)),
        updates, snapshot_grad, mu)
    return out, SvrgState(snapshot=snapshot, full_grad=mu, num_snapshots=num)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def snapshot_step(transform: str, updates: Any, params: Any, full_grad: Any, refresh: Any, snapshot: Any, mu: Any,
                  num: jax.Array) -> tuple[Any, Any, jax.Array]:
  """An SVRG epoch start: ``(snapshot, mu, num_snapshots)`` after ``full_grad`` (at ``params``) and ``refresh``.

  With ``full_grad`` and ``refresh`` true (the default) the snapshot becomes
  ``params`` and ``mu`` the full gradient; otherwise both are kept. Eager
  calls before any snapshot raise (traced ones leave ``num_snapshots`` 0 for
  the caller to turn into NaN).
  """
  if full_grad is not None:
    if params is None:
      raise ValueError(f"{transform} needs params when full_grad= is given: they become the new snapshot.")
    full_grad = like_updates("full_grad", full_grad, updates)
    if not isinstance(refresh, (type(None), bool, np.bool_, jax.Array, np.ndarray)):
      raise TypeError(f"refresh must be a bool scalar (whether this update starts an epoch), got "
                      f"{type(refresh).__name__} {refresh!r}.")
    take = jnp.asarray(True if refresh is None else refresh)
    if take.shape != () or take.dtype != jnp.bool_:
      raise ValueError(f"refresh must be a bool scalar, got dtype {take.dtype} and shape {take.shape}.")
    mu = jax.tree.map(lambda new, old: jnp.where(take, new.astype(old.dtype), old), full_grad, mu)
    snapshot = jax.tree.map(lambda new, old: jnp.where(take, new.astype(old.dtype), old), params, snapshot)
    num = num + take.astype(jnp.int32)
  elif refresh is not None:
    raise ValueError(f"{transform} got refresh= without full_grad=; a snapshot needs the full gradient at params.")
  if not isinstance(num, jax.core.Tracer) and int(num) == 0:
    raise ValueError(
        f"{transform} has no full gradient yet: the first update must pass full_grad= (the full gradient at "
        f"params) to take the first snapshot.")
  return snapshot, mu, num


def sample_indices_of(sample_indices: Any, num_samples: int,
                      transform: str = "saga") -> tuple[jax.Array, bool, jax.Array | None]:
  """int32 indices of shape [b], whether a scalar (one sample) was given, and which traced ones are in range.

  Concrete indices are checked (the third value is then ``None``); traced
  ones out of range are replaced by ``num_samples``, so that their writes are
  dropped instead of wrapping around to another sample's row.
  """
  require_extra(transform, "sample_indices", sample_indices,
                "int32 index or indices in [0, num_samples) of the minibatch", runtime_passes=False)
  if not jnp.issubdtype(jnp.result_type(sample_indices), jnp.integer):
    raise TypeError(f"sample_indices must be integers, got dtype {jnp.result_type(sample_indices)}.")
  ndim = jnp.ndim(sample_indices)
  if ndim > 1:
    raise ValueError(f"sample_indices must be a scalar or a 1-d array, got shape {jnp.shape(sample_indices)}.")
  if not isinstance(sample_indices, jax.core.Tracer):
    concrete = np.asarray(sample_indices)
    if concrete.size and (concrete.min() < 0 or concrete.max() >= num_samples):
      raise ValueError(
          f"sample_indices must be in [0, num_samples) = [0, {num_samples}); got values in "
          f"[{concrete.min()}, {concrete.max()}].")
  idx = jnp.asarray(sample_indices, jnp.int32)
  idx = idx[None] if ndim == 0 else idx
  if not isinstance(sample_indices, jax.core.Tracer):
    return idx, ndim == 0, None
  valid = (idx >= 0) & (idx < num_samples)
  return jnp.where(valid, idx, jnp.int32(num_samples)), ndim == 0, valid


def sample_mask_of(sample_mask: Any, batch: int, single: bool) -> jax.Array:
  """bool ``[b]``: which minibatch entries count (all of them by default)."""
  if sample_mask is None:
    return jnp.ones((batch,), jnp.bool_)
  mask = jnp.asarray(sample_mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"sample_mask must be a bool array, got dtype {mask.dtype}.")
  if single and mask.ndim == 0:
    mask = mask[None]
  if mask.shape != (batch,):
    raise ValueError(f"sample_mask must have shape [len(sample_indices)] = ({batch},); got {mask.shape}.")
  return mask


def last_kept(idx: jax.Array, keep: jax.Array) -> jax.Array:
  """bool ``[b]``: the last kept occurrence of each index, the only one that writes its table row, so that a
  table and its sum stay consistent when an index repeats within a minibatch."""
  b = idx.shape[0]
  later = jnp.triu(jnp.ones((b, b), jnp.bool_), k=1) & keep[None, :]
  return keep & ~jnp.any((idx[:, None] == idx[None, :]) & later, axis=1)


def saga(num_samples: int, *, table: str = "gradients") -> optax.GradientTransformationExtraArgs:
  r"""SAGA: a table of the last gradient of every sample (also under staleness: ASAGA).

  The output is a gradient estimate; chain a step after it, e.g.
  ``optax.chain(dj.saga(n), optax.sgd(lr))``. For a finite sum
  :math:`F(w) = \frac1n \sum_{i=0}^{n-1} f_i(w)` the state keeps
  :math:`\alpha_i`, the gradient of :math:`f_i` last seen, and their sum.
  An update on the minibatch :math:`B = (i_1, \dots, i_b)`
  (``sample_indices``) with gradient :math:`g` (``updates``, the minibatch
  mean :math:`\frac1b\sum_j \nabla f_{i_j}(\hat w)` at the parameters
  :math:`\hat w` a worker read) gives

  .. math::

    v = g - \frac1b \sum_{j=1}^{b} \alpha_{i_j} + \frac1n \sum_{i=0}^{n-1} \alpha_i,
    \qquad \alpha_{i_j} \leftarrow \nabla f_{i_j}(\hat w)

  with the table read *before* it is written. For :math:`b = 1` and
  :math:`\hat w = w` this is the SAGA of Defazio et al.; with stale reads it
  is ASAGA (Leblond et al.), whose table entries are the gradients at the
  parameters each worker read. Whatever part of ``updates`` is not in the
  table (e.g. a regularizer's gradient) passes through unchanged. The table
  starts at zero. If an index repeats within a minibatch, its last
  occurrence is stored. Indices are checked when concrete; a traced index
  outside ``[0, num_samples)`` (in a kept entry) makes every element of the
  update NaN and leaves the table unchanged, rather than reading a clamped or
  wrapped-around row. The optional
  ``sample_mask`` (bool ``[b]``) leaves entries out: they are neither read
  nor written, and the means above run over the kept entries only (a
  runtime pads minibatches to one static shape this way).
  ``dj.simulate`` computes the inputs at the parameters each worker read
  (ASAGA, with the table held by the server): per-example gradients for
  ``table="gradients"``, and for ``table="scalars"`` the scalars and
  features of its ``sample_terms`` argument; ``dj.delayed`` would pair a
  delayed gradient with the wrong indices.

  Table forms:

  * ``table="gradients"``: one gradient per sample, ``[num_samples, *shape]``
    per leaf. Extra arguments: ``sample_indices`` (int, ``[b]`` or a scalar)
    and ``sample_grads`` (pytree like the updates with a leading ``[b]``
    axis; may be omitted for a scalar index, when it is ``updates``).
  * ``table="scalars"``: for generalized linear models, where
    :math:`\nabla f_i(w) = s_i\, a_i` with a scalar :math:`s_i` (e.g.
    :math:`\phi_i'(x_i^\top w)`) and a fixed data pytree :math:`a_i` (e.g.
    :math:`x_i`), the table holds the :math:`n` scalars (float32) and the
    stored gradient is :math:`\alpha_i = s_i a_i`. Extra arguments:
    ``sample_indices``, ``sample_scalars`` (``[b]``) and ``sample_features``
    (pytree like the updates with a leading ``[b]`` axis).
  * Both forms take ``sample_mask``.

  Args:
    num_samples: :math:`n`, the number of terms of the finite sum (``>= 1``).
    table: ``"gradients"`` or ``"scalars"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the extra
    arguments of its table form.

  Raises:
    ValueError: at update, for a missing extra argument, a batch size or
      leaf shape that does not match ``sample_indices``, or (when the indices
      are concrete) an index outside ``[0, num_samples)``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.saga(2), optax.sgd(1.0))
    >>> w = jnp.zeros(1)
    >>> state = tx.init(w)
    >>> u, state = tx.update(jnp.array([4.0]), state, w, sample_indices=0)
    >>> u  # -(4 - 0 + 0)
    Array([-4.], dtype=float32)
    >>> u, state = tx.update(jnp.array([2.0]), state, w, sample_indices=1)
    >>> u  # -(2 - 0 + (4 + 0) / 2)
    Array([-4.], dtype=float32)

  References:
    Defazio, Bach, Lacoste-Julien, `SAGA: A Fast Incremental Gradient Method
    With Support for Non-Strongly Convex Composite Objectives
    <https://arxiv.org/abs/1407.0202>`_, NeurIPS 2014.

    Leblond, Pedregosa, Lacoste-Julien, `ASAGA: Asynchronous Parallel SAGA
    <https://arxiv.org/abs/1606.04809>`_, AISTATS 2017.
  """
  n = check_static_int("num_samples", num_samples, minimum=1)
  check_choice("table", table, SAGA_TABLES)
  scalars = table == "scalars"
  state_type = SagaScalarsState if scalars else SagaState

  def init_fn(params):
    if scalars:
      tab = jnp.zeros([n], jnp.float32)
    else:
      tab = jax.tree.map(lambda p: stacked_zeros(p, n), params)
    return state_type(table=tab, table_sum=jax.tree.map(jnp.zeros_like, params), count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, sample_indices=None, sample_grads=None, sample_scalars=None,
                sample_features=None, sample_mask=None, **extra_args):
    del params, extra_args
    idx, single, valid = sample_indices_of(sample_indices, n)
    b = idx.shape[0]
    keep = sample_mask_of(sample_mask, b, single)
    last = last_kept(idx, keep)
    # A kept traced index out of range makes the update NaN (see nan_unless) and the tables unchanged.
    in_range = None if valid is None else jnp.all(valid | ~keep)
    if valid is not None:
      last = last & in_range
    count = jnp.maximum(jnp.sum(keep.astype(jnp.int32)), 1)

    def kept_mean(weights, a):
      # Mean over the kept samples of weights_j * a_j (a leading [b] axis).
      w = jnp.where(keep, weights, jnp.zeros((), weights.dtype)).astype(a.dtype)
      return jnp.tensordot(w, a, axes=1) / count.astype(a.dtype)

    if scalars:
      require_extra("saga", "sample_scalars", sample_scalars, "the new per-sample scalars s_i, shape [b]",
                    runtime_passes=False)
      require_extra("saga", "sample_features", sample_features,
                    "the per-sample data a_i with grad f_i = s_i a_i, leading axis [b]", runtime_passes=False)
      s_new = jnp.asarray(sample_scalars).astype(jnp.float32)
      if single and s_new.ndim == 0:
        s_new = s_new[None]
      if s_new.shape != (b,):
        raise ValueError(f"sample_scalars must have shape [len(sample_indices)] = ({b},); got {s_new.shape}.")
      sample_features = masked_like(sample_features, updates)
      if single:
        sample_features = jax.tree.map(lambda a, g: a[None] if jnp.ndim(a) == jnp.ndim(g) else a, sample_features,
                                       updates)
      sample_features = like_updates("sample_features", sample_features, updates, batch=b)
      s_old = state.table[idx]
      delta = jnp.where(last, s_new - s_old, 0.0)
      old_mean = jax.tree.map(lambda a: kept_mean(s_old, a), sample_features)
      added = jax.tree.map(lambda a: jnp.tensordot(delta.astype(a.dtype), a, axes=1), sample_features)
    else:
      if sample_grads is None:
        if not single:
          require_extra("saga", "sample_grads", sample_grads,
                        "the per-sample gradients of the minibatch, leading axis [b]", runtime_passes=False)
        sample_grads = jax.tree.map(lambda g: g[None], updates)
      sample_grads = like_updates("sample_grads", sample_grads, updates, batch=b)
      old = jax.tree.map(lambda t: t[idx], state.table)
      diff = jax.tree.map(lambda new, o: jnp.where(last.reshape((b,) + (1,) * (o.ndim - 1)), new.astype(o.dtype) - o,
                                                   jnp.zeros_like(o)), sample_grads, old)
      old_mean = jax.tree.map(lambda o: kept_mean(jnp.ones((b,), o.dtype), o), old)
      added = jax.tree.map(lambda d: jnp.sum(d, axis=0), diff)
    out = jax.tree.map(
        lambda g, o, s: g - o.astype(g.dtype) + (s / jnp.asarray(nan_unless(in_range, n, s.dtype), s.dtype)).astype(
            g.dtype),
        updates, old_mean, state.table_sum)
    new_sum = jax.tree.map(lambda s, a: s + a.astype(s.dtype), state.table_sum, added)
    # Written after everything read from the table, so the table is written in place.
    write = after_reads(idx, n, out, new_sum)
    if scalars:
      new_table = state.table.at[write].add(delta)
    else:
      new_table = jax.tree.map(lambda t, d: t.at[write].add(d), state.table, diff)
    return out, state_type(table=new_table, table_sum=new_sum, count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
