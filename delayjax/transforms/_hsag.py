"""HSAG: one variance-reduced estimator whose anchors are SAGA's on a set S of indices and SVRG's elsewhere."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._sharding import stacked_zeros
from delayjax.transforms._extra_args import like_updates, require_extra
from delayjax.transforms._hyperparams import check_static_int
from delayjax.transforms._rows import after_reads
from delayjax.transforms._variance_reduction import last_kept, sample_indices_of, sample_mask_of, snapshot_step


class HsagState(NamedTuple):
  """State of :func:`hsag`."""

  snapshot: Any  # pytree like params: the snapshot w~ of the current epoch (the anchor of every i outside S)
  rest_grad: Any  # pytree like params: (1/n) sum over i outside S of grad f_i(w~)
  table: Any  # pytree of [|S|, *shape] per leaf: the last gradient of each index of S (zero until it is drawn)
  table_sum: Any  # pytree like params: the sum of the table's rows
  in_set: jax.Array  # shape=[n], bool: whether index i is in S (constant)
  num_snapshots: jax.Array  # shape=(), int32: snapshots taken so far (0: none yet)

  def runtime_inputs(self) -> tuple[str, ...]:
    # Per-example gradients at the read (the rows of S) and at the snapshot (the anchors outside S), and the
    # full gradient over the indices outside S at epoch starts: only the runtime has the loss and the data.
    return ("full_grad", "sample_grads", "sample_indices", "sample_mask", "sample_snapshot_grads")

  def snapshot_params(self) -> Any:
    """The snapshot parameters at which a runtime computes ``sample_snapshot_grads``."""
    return self.snapshot

  def full_grad_weights(self) -> jax.Array:
    """float32 ``[n]``: a runtime's ``full_grad`` for HSAG is :math:`\\frac1n \\sum_i c_i \\nabla f_i` with these
    :math:`c_i`, 1 outside S and 0 in S."""
    return (~self.in_set).astype(jnp.float32)


def _saga_set(saga_set: Any, n: int) -> np.ndarray:
  """The sorted int64 indices of S, checked: distinct integers in ``[0, n)``."""
  if isinstance(saga_set, (str, bytes)) or not isinstance(saga_set, (list, tuple, range, np.ndarray, jax.Array)):
    raise TypeError(
        f"saga_set must be a sequence or 1-d array of integer indices in [0, num_samples) = [0, {n}), got "
        f"{type(saga_set).__name__} {saga_set!r}.")
  if isinstance(saga_set, jax.core.Tracer):
    raise TypeError("saga_set must be concrete (it sets the shapes of the optimizer state), got a traced array.")
  values = np.asarray(saga_set) if len(saga_set) else np.zeros((0,), np.int64)
  if values.dtype == np.bool_ or not (np.issubdtype(values.dtype, np.integer) or values.dtype == object):
    raise TypeError(
        f"saga_set must hold integer indices in [0, num_samples) = [0, {n}), got dtype {values.dtype} "
        f"(for a bool mask pass np.flatnonzero(mask)).")
  if values.dtype == object:
    try:
      values = np.array([operator.index(v) for v in values.ravel()], np.int64).reshape(values.shape)
    except TypeError:
      raise TypeError(f"saga_set must hold integer indices in [0, num_samples) = [0, {n}), got {saga_set!r}.") from None
  if values.ndim != 1:
    raise ValueError(f"saga_set must be 1-d (a list of indices), got shape {values.shape}.")
  if values.size and (values.min() < 0 or values.max() >= n):
    raise ValueError(
        f"saga_set must hold indices in [0, num_samples) = [0, {n}); got values in [{values.min()}, "
        f"{values.max()}].")
  unique = np.unique(values.astype(np.int64))
  if unique.size != values.size:
    raise ValueError(f"saga_set must hold distinct indices; got {values.size - unique.size} repeated.")
  return unique


def hsag(num_samples: int, saga_set: Any) -> optax.GradientTransformationExtraArgs:
  r"""HSAG: SAGA's per-index anchors on a set :math:`S`, SVRG's epoch snapshot elsewhere (also under staleness).

  The output is a gradient estimate; chain a step after it, e.g.
  ``optax.chain(dj.hsag(n, S), optax.sgd(lr))``. Reddi et al. write
  variance reduction for :math:`F(w) = \frac1n \sum_{i=0}^{n-1} f_i(w)` as
  one estimator with an *anchor point* :math:`\alpha_i` per index,

  .. math::

    v = \nabla f_B(\hat w) - \frac1b \sum_{j=1}^{b} \nabla f_{i_j}(\alpha_{i_j})
        + \frac1n \sum_{i=0}^{n-1} \nabla f_i(\alpha_i),

  and a method is a *schedule* of anchor updates: SVRG sets every anchor to
  the snapshot :math:`\tilde w` at each epoch start, SAGA sets
  :math:`\alpha_{i_j}` to the point its gradient was just taken at. HSAG
  (hybrid stochastic average gradient) splits the indices: for
  :math:`i \in S` the SAGA schedule, for :math:`i \notin S` the SVRG one,

  .. math::

    \alpha_{i_j} \leftarrow \hat w \ (i_j \in S, \text{ after } v), \qquad
    \alpha_i \leftarrow \tilde w \ (i \notin S, \text{ at each epoch start}).

  It stores :math:`|S|` gradients (SAGA stores :math:`n`, SVRG none) and
  its epoch start costs :math:`n - |S|` gradients (SVRG: :math:`n`, SAGA:
  none): :math:`S = \{0..n-1\}` is :func:`saga`, :math:`S = \emptyset` is
  :func:`svrg`. Here :math:`\nabla f_B(\hat w)` is ``updates``, the minibatch
  :math:`B = (i_1, \dots, i_b)` (``sample_indices``) mean gradient at the
  parameters :math:`\hat w` a worker read, and :math:`\nabla f_i(\alpha_i)`
  is held as the table row of :math:`i \in S` (starting at zero, as
  :func:`saga`'s) or, for :math:`i \notin S`, given per example as
  ``sample_snapshot_grads`` (at :math:`\tilde w`), with the running sum
  :math:`\frac1n \sum_{i \notin S} \nabla f_i(\tilde w)` given as
  ``full_grad`` at each epoch start.

  Epochs start as in :func:`svrg`: an update that receives ``full_grad``
  (and ``refresh`` true, the default) first sets :math:`\tilde w \leftarrow`
  ``params`` (the last iterate) and the sum outside :math:`S` to
  ``full_grad``, and its ``sample_snapshot_grads`` are then at ``params``.
  With :math:`S \ne` all indices the first update must start an epoch
  (before any, eager calls raise and traced ones return NaN).

  Asynchronous form: under stale reads, ``updates`` and ``sample_grads`` are
  at the read :math:`\hat w` (the rows of :math:`S` store them, as ASAGA's
  table), ``sample_snapshot_grads`` at the snapshot held when the update is
  applied; the step is applied to the current parameters by the chained
  optimizer. ``dj.simulate`` computes every input with any delay source
  (``dj.workers.Gradient(snapshot_every=m)`` sets the epoch length): the
  per-example gradients in each contribution's lane and the weighted full
  gradient (``HsagState.full_grad_weights()``) at each epoch start.
  Repeated indices in a minibatch and ``sample_mask`` behave as in
  :func:`saga`; a traced index outside ``[0, num_samples)`` makes the update
  NaN and leaves the table unchanged.

  **Provenance: only the paper's abstract (and third-party summaries naming
  HSAG's schedule) could be read when this was written, not its algorithm
  listings. The rule above is the construction the abstract and those
  summaries describe (one estimator over per-index anchors; HSAG's schedule
  SAGA-like on S and SVRG-like elsewhere); its epoch convention is
  dj.svrg's (the snapshot is used from the update that takes it on), which
  may differ by one update from the paper's listing.**

  Args:
    num_samples: :math:`n`, the number of terms of the finite sum (``>= 1``).
    saga_set: :math:`S`, the indices with SAGA anchors: distinct integers in
      ``[0, num_samples)`` (a list, range or 1-d integer array; may be empty).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the extra
    arguments ``sample_indices``; ``sample_grads`` (per-example gradients at
    the read, leading axis ``[b]``; for a scalar index it may be omitted, when
    it is ``updates``) unless :math:`S` is empty; ``sample_snapshot_grads``
    (the same at the snapshot) unless :math:`S` is every index; and takes
    ``full_grad``, ``refresh`` and ``sample_mask``.

  Raises:
    TypeError: for a ``saga_set`` that is not a sequence of integers.
    ValueError: for a ``saga_set`` index outside ``[0, num_samples)``, a
      repeated one or a set that is not 1-d; at update, as :func:`saga` and
      :func:`svrg` for their extra arguments.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.hsag(2, saga_set=[0]), optax.sgd(1.0))
    >>> w = jnp.zeros(1)
    >>> state = tx.init(w)
    >>> # epoch start: the sum outside S is (1/2) grad f_1(w~) = [3]; index 1 is outside S
    >>> u, state = tx.update(jnp.array([6.0]), state, w, sample_indices=1, full_grad=jnp.array([3.0]),
    ...                      sample_snapshot_grads=jnp.array([[6.0]]))
    >>> u  # -(6 - 6 + 0 / 2 + 3)
    Array([-3.], dtype=float32)
    >>> u, state = tx.update(jnp.array([4.0]), state, w + u, sample_indices=0,
    ...                      sample_snapshot_grads=jnp.array([[9.0]]))
    >>> u  # index 0 is in S: its anchor is its (zero) table row; -(4 - 0 + 0 / 2 + 3)
    Array([-7.], dtype=float32)

  References:
    Reddi, Hefny, Sra, Poczos, Smola, `On Variance Reduction in Stochastic
    Gradient Descent and its Asynchronous Variants <https://arxiv.org/abs/1506.06840>`_,
    NeurIPS 2015.
  """
  n = check_static_int("num_samples", num_samples, minimum=1)
  members = _saga_set(saga_set, n)
  k = int(members.size)
  in_set = np.zeros(n, bool)
  in_set[members] = True
  # Row of each index in the table; indices outside S (and a traced out-of-range index, mapped to n) get row
  # k, past the table's end, so their reads fill zeros and their writes are dropped.
  rows_of = np.full(n + 1, k, np.int32)
  rows_of[members] = np.arange(k, dtype=np.int32)
  has_rest = k < n

  def init_fn(params):
    return HsagState(snapshot=jax.tree.map(jnp.array, params), rest_grad=jax.tree.map(jnp.zeros_like, params),
                     table=jax.tree.map(lambda p: stacked_zeros(p, k), params),
                     table_sum=jax.tree.map(jnp.zeros_like, params), in_set=jnp.asarray(in_set),
                     num_snapshots=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, sample_indices=None, sample_grads=None, sample_snapshot_grads=None,
                sample_mask=None, full_grad=None, refresh=None, **extra_args):
    del extra_args
    idx, single, valid = sample_indices_of(sample_indices, n, "hsag")
    b = idx.shape[0]
    keep = sample_mask_of(sample_mask, b, single)
    in_range = None if valid is None else jnp.all(valid | ~keep)
    count = jnp.maximum(jnp.sum(keep.astype(jnp.int32)), 1)
    if has_rest:
      snapshot, rest, num = snapshot_step("hsag", updates, params, full_grad, refresh, state.snapshot,
                                          state.rest_grad, state.num_snapshots)
      require_extra("hsag", "sample_snapshot_grads", sample_snapshot_grads,
                    "the per-example gradients of the minibatch at the snapshot, leading axis [b]",
                    runtime_passes=True)
      snap = like_updates("sample_snapshot_grads", sample_snapshot_grads, updates, batch=b)
    else:
      # Every anchor is SAGA's: no snapshot is needed, and one given changes nothing.
      snapshot, rest, num = state.snapshot, state.rest_grad, state.num_snapshots
    rows = jnp.asarray(rows_of)[idx]
    if k:
      if sample_grads is None:
        if not single:
          require_extra("hsag", "sample_grads", sample_grads,
                        "the per-sample gradients of the minibatch at the read, leading axis [b]")
        sample_grads = jax.tree.map(lambda g: g[None], updates)
      sample_grads = like_updates("sample_grads", sample_grads, updates, batch=b)
      old = jax.tree.map(lambda t: t.at[rows].get(mode="fill", fill_value=0), state.table)
    if k and has_rest:
      member = rows < k
      anchors = jax.tree.map(lambda o, s: jnp.where(member.reshape((b,) + (1,) * (o.ndim - 1)), o, s.astype(o.dtype)),
                             old, snap)
    else:
      anchors = old if k else snap

    def kept_mean(a):
      w = jnp.where(keep, jnp.ones((), a.dtype), jnp.zeros((), a.dtype))
      return jnp.tensordot(w, a, axes=1) / count.astype(a.dtype)

    out = jax.tree.map(lambda g, a: g - kept_mean(a).astype(g.dtype), updates, anchors)
    if k:
      out = jax.tree.map(lambda o, s: o + (s / n).astype(o.dtype), out, state.table_sum)
    if has_rest:
      out = jax.tree.map(lambda o, r: jnp.where(num > 0, o + r.astype(o.dtype), jnp.full_like(o, jnp.nan)), out, rest)
    if in_range is not None:
      out = jax.tree.map(lambda o: jnp.where(in_range, o, jnp.full_like(o, jnp.nan)), out)
    table, table_sum = state.table, state.table_sum
    if k:
      writes = last_kept(idx, keep) & (rows < k)
      if in_range is not None:
        writes = writes & in_range
      diff = jax.tree.map(
          lambda new, o: jnp.where(writes.reshape((b,) + (1,) * (o.ndim - 1)), new.astype(o.dtype) - o,
                                   jnp.zeros_like(o)), sample_grads, old)
      table_sum = jax.tree.map(lambda s, d: s + jnp.sum(d, axis=0).astype(s.dtype), table_sum, diff)
      # Written after everything read from the table, so the table is written in place.
      write = after_reads(rows, k, out, table_sum)
      table = jax.tree.map(lambda t, d: t.at[write].add(d, mode="drop"), table, diff)
    return out, HsagState(snapshot=snapshot, rest_grad=rest, table=table, table_sum=table_sum, in_set=state.in_set,
                          num_snapshots=num)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
