r"""Finite sums with a known optimum: L2-regularized logistic regression and least squares, dense or sparse.

A :class:`FiniteSum` is the objective of a generalized linear model,

.. math::

  F(w) = \frac1n \sum_{i=0}^{n-1} \phi(x_i^\top w, y_i) + \frac{\lambda}{2} \|w\|^2,
  \qquad f_i(w) = \phi(x_i^\top w, y_i) + \frac{\lambda}{2} \|w\|^2,

with :math:`\phi(z, y) = \log(1 + e^{-yz})` (``kind="logistic"``, labels
:math:`y \in \{-1, +1\}`) or :math:`\phi(z, y) = (z - y)^2 / 2`
(``kind="least_squares"``). Features are dense, ``[n, d]``, or sparse in a
padded CSR form: ``indices`` int32 ``[n, k]`` and ``values`` ``[n, k]``, row
``i`` holding its nonzeros ``values[i, s]`` at columns ``indices[i, s]``; a
slot whose value is zero is padding (its index is ignored but must be in
``[0, d)``), and the nonzero slots of a row have distinct indices.

:func:`optimum` computes :math:`w^\star` and :math:`F^\star` once, by
Newton's method in float64 NumPy, and caches them on disk, so that
:func:`suboptimality` :math:`F(w) - F^\star` can be plotted on a log scale.
The JAX side (:meth:`FiniteSum.data`, :meth:`FiniteSum.loss_fn`,
:meth:`FiniteSum.per_sample`) feeds ``dj.simulate``, ``dj.saga`` (scalar
table) and ``dj.prox_asaga``.

:func:`strict_saddle` is the nonconvex one: a quadratic with one direction of negative curvature plus a
quartic term, whose strict saddle, minima and Hessians are known in closed form (escaping saddle points).

:func:`contextual_bandit` is the reinforcement-learning counterpart: a
bandit with a known optimum whose contexts take time to answer in proportion
to their length, for stale data in asynchronous RL (``dj.workers.Rollouts``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import os
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from delayjax import _memory
from delayjax._checks import check_bool, check_choice, check_float, check_int, check_number_array, check_seed

KINDS = ("logistic", "least_squares")
# Newton stops at this gradient norm, or earlier where float64 rounding stops it from decreasing.
_GRAD_TOL = 1e-12
# Above this, the optimum is not trusted (bad scaling or a non-converging problem): optimum() raises.
_GRAD_FAIL = 1e-9
_CACHE_VERSION = b"delayjax-optimum-v1"


class SampleTerms(NamedTuple):
  """Per-sample gradients of a generalized linear model: :math:`\\nabla f_i(w) = s_i a_i + \\lambda w`."""

  scalars: jax.Array  # shape=[b], w's dtype: s_i = phi'(x_i.w, y_i)
  features: jax.Array  # shape=[b, d], w's dtype: a_i = x_i, dense (sparse rows scattered)


class Smoothness(NamedTuple):
  """Lipschitz constants of the gradients."""

  l_max: float  # max_i of the smoothness constant of f_i: c |x_i|^2 + lam
  l: float  # the smoothness constant of F: c lambda_max(X'X / n) + lam


class Optimum(NamedTuple):
  """The minimizer of a :class:`FiniteSum`, in float64."""

  w: np.ndarray  # shape=[d], float64: w*
  value: float  # F(w*)
  grad_norm: float  # |grad F(w*)|, what Newton's method reached


def _numbers(name: str, value: Any, shape: str) -> np.ndarray:
  """``value`` as a float64 array, or a TypeError naming ``name`` when it does not hold (real) numbers."""
  return check_number_array(f"{name} must be an array of numbers of shape {shape}", value)


def _check_sparse(indices: Any, values: Any, num_features: int) -> tuple[np.ndarray, np.ndarray]:
  """The padded CSR arrays as (int32 [n, k], float64 [n, k]), or raises naming what is wrong."""
  indices, values = np.asarray(indices), _numbers("values", values, "[n, k]")
  if not np.issubdtype(indices.dtype, np.integer):
    raise TypeError(f"indices must be integers, got dtype {indices.dtype}.")
  if indices.ndim != 2 or indices.shape != values.shape:
    raise ValueError(
        f"indices and values must both have shape [n, k]; got indices {indices.shape} and values {values.shape}.")
  if indices.size and (indices.min() < 0 or indices.max() >= num_features):
    raise ValueError(
        f"indices must be in [0, num_features) = [0, {num_features}); got values in [{indices.min()}, "
        f"{indices.max()}].")
  values = values.astype(np.float64)
  if not np.all(np.isfinite(values)):
    raise ValueError("values must be finite.")
  # Nonzero slots of a row must name distinct columns; padding slots (value 0) may repeat any index.
  keys = np.where(values != 0, indices.astype(np.int64), -1 - np.arange(indices.shape[1]))
  ordered = np.sort(keys, axis=1)
  repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
  if repeated.any():
    row = int(np.flatnonzero(repeated.any(axis=1))[0])
    raise ValueError(f"the nonzero slots of a row must have distinct indices; row {row} repeats a column.")
  return indices.astype(np.int32), values


def to_sparse(x: Any, nnz_per_row: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The padded CSR form of a dense matrix.

  Args:
    x: ``[n, d]`` features.
    nnz_per_row: ``k``, the width of the padded rows (``1 <= k <= d``);
      default the largest number of nonzeros of a row (at least 1).

  Returns:
    ``(indices, values)``: int32 ``[n, k]`` and float64 ``[n, k]``, each row's
    nonzeros in increasing column order, then padding (index 0, value 0).

  Examples:
    >>> import numpy as np
    >>> from delayjax.problems import to_sparse
    >>> indices, values = to_sparse(np.array([[0.0, 2.0, 3.0], [4.0, 0.0, 0.0]]))
    >>> indices
    array([[1, 2],
           [0, 0]], dtype=int32)
    >>> values
    array([[2., 3.],
           [4., 0.]])
  """
  x = np.asarray(x, np.float64)
  if x.ndim != 2:
    raise ValueError(f"x must have shape [n, d], got {x.shape}.")
  nonzero = x != 0
  widest = max(1, int(nonzero.sum(axis=1).max(initial=0)))
  k = widest if nnz_per_row is None else check_int("nnz_per_row", nnz_per_row, minimum=1)
  if k > x.shape[1]:
    raise ValueError(f"nnz_per_row must be <= d = {x.shape[1]}, got {k}.")
  if k < widest:
    raise ValueError(f"nnz_per_row must be >= the most nonzeros of a row ({widest}), got {k}.")
  order = np.argsort(~nonzero, axis=1, kind="stable")[:, :k]  # nonzero columns first, in increasing order
  values = np.take_along_axis(x, order, axis=1)
  return np.where(values != 0, order, 0).astype(np.int32), values


def to_dense(indices: Any, values: Any, num_features: int) -> np.ndarray:
  """The dense float64 ``[n, d]`` matrix of a padded CSR form (see :func:`to_sparse`)."""
  d = check_int("num_features", num_features, minimum=1)
  indices, values = _check_sparse(indices, values, d)
  out = np.zeros((indices.shape[0], d))
  np.add.at(out, (np.arange(indices.shape[0])[:, None], indices), values)
  return out


def _densify(indices: jax.Array, values: jax.Array, num_features: int) -> jax.Array:
  """Padded CSR rows ``[..., k]`` as dense rows ``[..., d]`` (JAX, jittable)."""
  flat_i, flat_v = indices.reshape(-1, indices.shape[-1]), values.reshape(-1, values.shape[-1])
  dense = jax.vmap(lambda i, v: jnp.zeros(num_features, v.dtype).at[i].add(v))(flat_i, flat_v)
  return dense.reshape(indices.shape[:-1] + (num_features,))


@dataclasses.dataclass(frozen=True, eq=False)
class FiniteSum:
  r"""An L2-regularized generalized linear model: logistic regression or least squares.

  .. math::

    F(w) = \frac1n \sum_{i=0}^{n-1} \phi(x_i^\top w, y_i) + \frac{\lambda}{2} \|w\|^2

  Give either dense ``features`` or the sparse pair ``indices`` /
  ``values`` with ``num_features`` (the module docstring describes the
  padded CSR form). Arrays are copied to read-only float64 (int32 indices).

  Args:
    kind: ``"logistic"`` (targets in {-1, +1}) or ``"least_squares"``.
    targets: :math:`y`, ``[n]``.
    lam: :math:`\lambda \ge 0`.
    features: dense :math:`x`, ``[n, d]``.
    indices: sparse column indices, integer ``[n, k]``.
    values: sparse values, ``[n, k]``.
    num_features: :math:`d` (required with the sparse form; checked against
      ``features`` otherwise).

  Examples:
    >>> import numpy as np
    >>> import delayjax as dj
    >>> p = dj.problems.FiniteSum("least_squares", targets=np.array([1.0, 2.0]), lam=0.0,
    ...                           features=np.array([[1.0, 0.0], [0.0, 2.0]]))
    >>> p.value(np.array([1.0, 1.0]))  # (0 + 0) / 2
    0.0
    >>> p.gradient(np.zeros(2))  # -(x' y) / n
    array([-0.5, -2. ])
  """

  kind: str
  targets: np.ndarray
  lam: float
  features: np.ndarray | None = None
  indices: np.ndarray | None = None
  values: np.ndarray | None = None
  num_features: int | None = None

  def __post_init__(self):
    check_choice("kind", self.kind, KINDS)
    lam = check_float("lam", self.lam, minimum=0.0)
    y = _numbers("targets", self.targets, "[n]")
    if y.ndim != 1 or y.size == 0:
      raise ValueError(f"targets must have shape [n] with n >= 1, got {y.shape}.")
    if not np.all(np.isfinite(y)):
      raise ValueError("targets must be finite.")
    if self.kind == "logistic" and not np.all(np.abs(y) == 1):
      raise ValueError(f"logistic targets must be -1 or +1, got values {np.unique(y)[:5]}.")
    sparse = self.indices is not None or self.values is not None
    if sparse == (self.features is not None):
      raise ValueError("give either features (dense) or indices and values (sparse), not both and not neither.")
    if sparse:
      if self.indices is None or self.values is None or self.num_features is None:
        raise ValueError("the sparse form needs indices, values and num_features.")
      d = check_int("num_features", self.num_features, minimum=1)
      indices, values = _check_sparse(self.indices, self.values, d)
      rows = indices.shape[0]
      arrays = {"indices": indices, "values": values}
    else:
      x = _numbers("features", self.features, "[n, d]")
      if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"features must have shape [n, d] with d >= 1, got {x.shape}.")
      if not np.all(np.isfinite(x)):
        raise ValueError("features must be finite.")
      if self.num_features is not None and check_int("num_features", self.num_features) != x.shape[1]:
        raise ValueError(f"num_features must be features.shape[1] = {x.shape[1]}, got {self.num_features}.")
      d, rows = x.shape[1], x.shape[0]
      arrays = {"features": x}
    if rows != y.shape[0]:
      raise ValueError(f"targets must have one entry per row of the features ({rows}), got {y.shape[0]}.")
    arrays["targets"] = y
    for name, array in arrays.items():
      array = np.array(array)  # a private copy, frozen
      array.setflags(write=False)
      object.__setattr__(self, name, array)
    object.__setattr__(self, "lam", lam)
    object.__setattr__(self, "num_features", d)

  # ---------------------------------------------------------------- shape

  @property
  def num_samples(self) -> int:
    """:math:`n`."""
    return int(self.targets.shape[0])

  @property
  def sparse(self) -> bool:
    """Whether the features are in the padded CSR form."""
    return self.features is None

  def support_counts(self) -> np.ndarray:
    """int64 ``[d]``: :math:`n_j`, the number of samples with a nonzero feature ``j`` (``dj.prox_asaga``)."""
    if self.sparse:
      return np.bincount(self.indices[self.values != 0], minlength=self.num_features).astype(np.int64)
    return np.count_nonzero(self.features, axis=0).astype(np.int64)

  # ---------------------------------------------------------------- JAX side

  def data(self, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """The data as JAX arrays with a leading ``[n]`` axis, e.g. ``dj.simulate``'s ``data``.

    Args:
      dtype: of the float arrays (``jnp.float64`` needs ``jax.enable_x64``).

    Returns:
      ``{"x": [n, d], "y": [n]}`` (dense) or ``{"indices": int32 [n, k],
      "values": [n, k], "y": [n]}`` (sparse).
    """
    out = {"y": jnp.asarray(self.targets, dtype)}
    if self.sparse:
      out.update(indices=jnp.asarray(self.indices, jnp.int32), values=jnp.asarray(self.values, dtype))
    else:
      out["x"] = jnp.asarray(self.features, dtype)
    return out

  @staticmethod
  def _check_batch(batch: Any) -> None:
    """Raises naming ``batch`` unless it holds ``"y"`` and the features of :meth:`data` (dense or sparse)."""
    if not isinstance(batch, collections.abc.Mapping):
      raise TypeError(f"batch must be a dict like data()'s ({{'x', 'y'}} or {{'indices', 'values', 'y'}}), "
                      f"got {type(batch).__name__}.")
    if "y" not in batch or not ("x" in batch or ("indices" in batch and "values" in batch)):
      raise ValueError("batch must hold 'y' and either 'x' (dense) or 'indices' and 'values' (sparse), as data() "
                       f"does; got keys {sorted(map(str, batch))}.")

  def _margins(self, w: jax.Array, batch: dict[str, Any]) -> jax.Array:
    self._check_batch(batch)
    if "x" in batch:
      return jnp.asarray(batch["x"]).astype(w.dtype) @ w
    values = jnp.asarray(batch["values"]).astype(w.dtype)
    return jnp.sum(values * w[jnp.asarray(batch["indices"])], axis=-1)

  def loss_fn(self, w: jax.Array, batch: dict[str, Any]) -> jax.Array:
    r"""The mean of :math:`f_i(w)` over a batch (a slice of :meth:`data`, or one row of it); jittable.

    Args:
      w: ``[d]`` parameters.
      batch: a dict like :meth:`data`'s, with or without a leading batch axis.

    Returns:
      :math:`\frac1b \sum_{i \in B} \phi(x_i^\top w, y_i) + \frac{\lambda}{2}\|w\|^2`, a scalar in ``w``'s dtype.
    """
    z = self._margins(w, batch)
    y = jnp.asarray(batch["y"]).astype(w.dtype)
    fit = jax.nn.softplus(-y * z) if self.kind == "logistic" else 0.5 * jnp.square(z - y)
    return jnp.mean(fit) + jnp.asarray(0.5 * self.lam, w.dtype) * jnp.vdot(w, w)

  def per_sample(self, w: jax.Array, batch: dict[str, Any]) -> SampleTerms:
    r"""The scalars and features with :math:`\nabla f_i(w) = s_i a_i + \lambda w` (``dj.saga(table="scalars")``).

    Args:
      w: ``[d]`` parameters.
      batch: a dict like :meth:`data`'s with a leading batch axis ``[b]``.

    Returns:
      :class:`SampleTerms`: :math:`s_i = \phi'(x_i^\top w, y_i)` ``[b]`` and
      :math:`a_i = x_i` ``[b, d]`` (sparse rows made dense).
    """
    z = self._margins(w, batch)
    y = jnp.asarray(batch["y"]).astype(w.dtype)
    s = -y * jax.nn.sigmoid(-y * z) if self.kind == "logistic" else z - y
    if "x" in batch:
      features = jnp.asarray(batch["x"]).astype(w.dtype)
    else:
      features = _densify(jnp.asarray(batch["indices"]), jnp.asarray(batch["values"]).astype(w.dtype),
                          self.num_features)
    return SampleTerms(scalars=s, features=features)

  # ---------------------------------------------------------------- float64 NumPy side

  def _np_margins(self, w: np.ndarray) -> np.ndarray:
    if self.sparse:
      return np.sum(self.values * w[self.indices], axis=1)
    return self.features @ w

  def _np_transpose_times(self, s: np.ndarray) -> np.ndarray:
    """:math:`X^\\top s`."""
    if self.sparse:
      return np.bincount(self.indices.ravel(), weights=(self.values * s[:, None]).ravel(),
                         minlength=self.num_features)
    return self.features.T @ s

  def _np_gram(self, h: np.ndarray) -> np.ndarray:
    """:math:`X^\\top \\text{diag}(h) X / n`, float64 ``[d, d]``."""
    if not self.sparse:
      return (self.features * h[:, None]).T @ self.features / self.num_samples
    d = self.num_features
    pairs = (self.indices[:, :, None].astype(np.int64) * d + self.indices[:, None, :]).ravel()
    weights = (self.values[:, :, None] * self.values[:, None, :] * h[:, None, None]).ravel()
    return np.bincount(pairs, weights=weights, minlength=d * d).reshape(d, d) / self.num_samples

  def _w64(self, w: Any, name: str = "w") -> np.ndarray:
    w = _numbers(name, w, f"[num_features] = ({self.num_features},)")
    if w.shape != (self.num_features,):
      raise ValueError(f"{name} must have shape [num_features] = ({self.num_features},), got {w.shape}.")
    return w

  def value(self, w: Any) -> float:
    """:math:`F(w)` in float64."""
    w = self._w64(w)
    z = self._np_margins(w)
    fit = np.logaddexp(0.0, -self.targets * z) if self.kind == "logistic" else 0.5 * (z - self.targets) ** 2
    return float(np.mean(fit) + 0.5 * self.lam * w @ w)

  def _np_scalars(self, z: np.ndarray) -> np.ndarray:
    if self.kind == "logistic":
      return -self.targets * np.exp(-np.logaddexp(0.0, self.targets * z))  # -y sigmoid(-y z)
    return z - self.targets

  def gradient(self, w: Any) -> np.ndarray:
    r""":math:`\nabla F(w)` in float64, ``[d]``."""
    w = self._w64(w)
    return self._np_transpose_times(self._np_scalars(self._np_margins(w))) / self.num_samples + self.lam * w

  def hessian(self, w: Any) -> np.ndarray:
    r""":math:`\nabla^2 F(w)` in float64, ``[d, d]``."""
    w = self._w64(w)
    if self.kind == "logistic":
      p = np.exp(-np.logaddexp(0.0, -self._np_margins(w)))  # sigmoid(z); phi'' = p (1 - p) whatever y
      h = p * (1.0 - p)
    else:
      h = np.ones(self.num_samples)
    return self._np_gram(h) + self.lam * np.eye(self.num_features)

  def _curvature_bound(self) -> float:
    return 0.25 if self.kind == "logistic" else 1.0  # sup of phi''

  def smoothness(self) -> Smoothness:
    r""":math:`L_{\max} = \max_i c\|x_i\|^2 + \lambda` and :math:`L = c\,\lambda_{\max}(X^\top X/n) + \lambda`.

    :math:`c = 1/4` (logistic) or 1 (least squares) bounds :math:`\phi''`.
    """
    c = self._curvature_bound()
    sq = np.sum(self.values ** 2, axis=1) if self.sparse else np.sum(self.features ** 2, axis=1)
    top = float(np.linalg.eigvalsh(self._np_gram(np.ones(self.num_samples)))[-1])
    return Smoothness(l_max=float(c * sq.max() + self.lam), l=float(c * top + self.lam))

  def strong_convexity(self) -> float:
    r"""A strong-convexity constant :math:`\mu` of :math:`F`.

    Least squares: :math:`\lambda_{\min}(X^\top X / n) + \lambda` (exact).
    Logistic: :math:`\lambda` (the global bound; :math:`\phi''` has no positive
    lower bound).
    """
    if self.kind == "logistic":
      return self.lam
    return float(max(np.linalg.eigvalsh(self._np_gram(np.ones(self.num_samples)))[0], 0.0) + self.lam)


# ---------------------------------------------------------------- the optimum, cached


def _newton(problem: FiniteSum) -> Optimum:
  """Damped Newton's method from zero, in float64, to a gradient norm of 1e-12 or float64's floor."""
  w = np.zeros(problem.num_features)
  f, g = problem.value(w), problem.gradient(w)
  for _ in range(100):
    g_norm = float(np.linalg.norm(g))
    if g_norm <= _GRAD_TOL:
      break
    direction = np.linalg.solve(problem.hessian(w), g)
    decrement = float(g @ direction)
    step = 1.0
    # Far from w*, backtrack (Armijo); near it, the full Newton step, since F's rounding hides the decrease.
    while decrement > 1e-12 and step > 1e-10 and problem.value(w - step * direction) > f - 0.25 * step * decrement:
      step *= 0.5
    w_new = w - step * direction
    g_new = problem.gradient(w_new)
    if decrement <= 1e-12 and np.linalg.norm(g_new) >= g_norm:
      break  # float64 rounding: no further progress
    w, f, g = w_new, problem.value(w_new), g_new
  g_norm = float(np.linalg.norm(g))
  if g_norm > _GRAD_FAIL:
    raise RuntimeError(
        f"Newton's method stopped at gradient norm {g_norm:.3g} > {_GRAD_FAIL:g}; the problem may be badly "
        "scaled (normalize the features) or lam too small for the data to determine w*.")
  return Optimum(w=w, value=f, grad_norm=g_norm)


def cache_key(problem: FiniteSum) -> str:
  """A SHA-256 hex digest of the problem's kind, lam and arrays: the name of its cached optimum."""
  h = hashlib.sha256(_CACHE_VERSION)
  h.update(f"{problem.kind}|{problem.lam.hex()}|{problem.num_features}".encode())
  arrays = (problem.indices, problem.values) if problem.sparse else (problem.features,)
  for array in arrays + (problem.targets,):
    h.update(f"|{array.dtype.str}{array.shape}|".encode())
    h.update(np.ascontiguousarray(array).tobytes())
  return h.hexdigest()


def default_cache_dir() -> str:
  """``$DELAYJAX_CACHE``, else ``$XDG_CACHE_HOME/delayjax``, else ``~/.cache/delayjax``."""
  if os.environ.get("DELAYJAX_CACHE"):
    return os.environ["DELAYJAX_CACHE"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "delayjax")


def _load(path: str, key: str, d: int) -> Optimum | None:
  try:
    with np.load(path) as f:
      if str(f["key"]) != key or f["w"].shape != (d,):
        return None
      return Optimum(w=np.array(f["w"], np.float64), value=float(f["value"]), grad_norm=float(f["grad_norm"]))
  except (OSError, KeyError, ValueError):
    return None


def _save(path: str, key: str, opt: Optimum) -> None:
  """Writes atomically (a temporary file renamed into place); an unwritable directory only means no cache."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz.tmp")
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez(f, key=np.array(key), w=opt.w, value=np.float64(opt.value), grad_norm=np.float64(opt.grad_norm))
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  except OSError:
    pass


def optimum(problem: FiniteSum, *, cache_dir: str | os.PathLike[str] | None = None, cache: bool = True) -> Optimum:
  r"""The minimizer :math:`w^\star` and minimum :math:`F^\star`, by Newton's method in float64, cached on disk.

  Newton's method (exact Hessian, backtracking far from the optimum) runs
  from :math:`w = 0` to :math:`\|\nabla F(w)\| \le 10^{-12}`, or until float64
  rounding stops the gradient from decreasing; it needs the ``[d, d]``
  Hessian, so ``d`` should be at most a few thousand. The result is saved
  as ``optimum-<key>.npz`` in ``cache_dir`` (key: :func:`cache_key`, a hash
  of the kind, ``lam`` and the arrays), and a later call on the same data
  loads it. A cache directory that cannot be written is not an error: the
  optimum is then computed and returned, not saved.

  Args:
    problem: a :class:`FiniteSum`.
    cache_dir: where to cache; default :func:`default_cache_dir`.
    cache: ``False`` neither reads nor writes the cache.

  Returns:
    An :class:`Optimum` ``(w, value, grad_norm)``.

  Raises:
    RuntimeError: if Newton's method ends above a gradient norm of 1e-9.

  Examples:
    >>> import numpy as np
    >>> import delayjax as dj
    >>> p = dj.problems.make_dense("logistic", 50, 3, lam=0.1, seed=0)
    >>> opt = dj.problems.optimum(p, cache=False)
    >>> bool(np.linalg.norm(p.gradient(opt.w)) < 1e-10)
    True
  """
  if not isinstance(problem, FiniteSum):
    raise TypeError(f"problem must be a FiniteSum, got {type(problem).__name__}.")
  if not check_bool("cache", cache):
    return _newton(problem)
  if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
    raise TypeError(f"cache_dir must be None or a path (str or os.PathLike), got {type(cache_dir).__name__} "
                    f"{cache_dir!r}.")
  key = cache_key(problem)
  path = os.path.join(os.fspath(default_cache_dir() if cache_dir is None else cache_dir), f"optimum-{key}.npz")
  found = _load(path, key, problem.num_features)
  if found is not None:
    return found
  opt = _newton(problem)
  _save(path, key, opt)
  return opt


def suboptimality(problem: FiniteSum, w: Any, *, solution: Optimum | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> float:
  r""":math:`F(w) - F^\star` in float64 (at least 0).

  For least squares it is evaluated as :math:`\frac12 (w - w^\star)^\top H (w
  - w^\star)`, exact for a quadratic and free of the cancellation of
  :math:`F(w) - F^\star` near the optimum; for logistic regression it is the
  difference, accurate to about :math:`10^{-16} F^\star`.

  Args:
    problem: a :class:`FiniteSum`.
    w: ``[d]`` parameters (any float dtype).
    solution: the problem's :class:`Optimum`; default :func:`optimum` (cached).
    cache_dir: passed to :func:`optimum`.

  Returns:
    A Python float.
  """
  if not isinstance(problem, FiniteSum):
    raise TypeError(f"problem must be a FiniteSum, got {type(problem).__name__}.")
  if solution is not None and not isinstance(solution, Optimum):
    raise TypeError(f"solution must be None or an Optimum (from dj.problems.optimum(problem)), got "
                    f"{type(solution).__name__} {solution!r}.")
  w = problem._w64(w)
  if solution is not None:
    solution = solution._replace(w=problem._w64(solution.w, "solution.w"))
  opt = optimum(problem, cache_dir=cache_dir) if solution is None else solution
  if problem.kind == "least_squares":
    e = w - opt.w
    gap = 0.5 * e @ problem.hessian(opt.w) @ e
  else:
    gap = problem.value(w) - opt.value
  return float(max(gap, 0.0))


# ---------------------------------------------------------------- generators


def _targets(kind: str, z: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
  """Targets of a planted model with margins ``z``: noisy values, or the signs of noisy margins."""
  y = z + noise * rng.standard_normal(z.shape)
  return np.where(y >= 0, 1.0, -1.0) if kind == "logistic" else y


def make_dense(kind: str, n: int, d: int, *, lam: float, seed: int, noise: float = 1.0) -> FiniteSum:
  r"""A seeded synthetic dense problem: Gaussian features scaled to unit row norm in expectation.

  Features :math:`x_{ij} \sim \mathcal N(0, 1/d)`, a planted
  :math:`w_0 \sim \mathcal N(0, I_d)`, and targets :math:`x_i^\top w_0 +
  \text{noise}\,\varepsilon_i` (least squares) or their signs (logistic).

  Args:
    kind: ``"logistic"`` or ``"least_squares"``.
    n: samples (``>= 1``).
    d: features (``>= 1``).
    lam: :math:`\lambda \ge 0`.
    seed: the same seed gives the same problem.
    noise: :math:`\ge 0`, the standard deviation of :math:`\varepsilon`.

  Returns:
    A dense :class:`FiniteSum`.
  """
  check_choice("kind", kind, KINDS)
  n, d = check_int("n", n, minimum=1), check_int("d", d, minimum=1)
  noise = check_float("noise", noise, minimum=0.0)
  check_seed("seed", seed)
  # The features, their scaled copy and FiniteSum's frozen copy: three float64 [n, d] arrays at once.
  _memory.check_fits(f"make_dense with n={n} x d={d} (three float64 [n, d] feature arrays at once)",
                     3 * 8 * n * d, _memory.available_memory())
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)) / np.sqrt(d)
  return FiniteSum(kind, targets=_targets(kind, x @ rng.standard_normal(d), noise, rng), lam=lam, features=x)


def make_sparse(kind: str, n: int, d: int, nnz_per_row: int, *, lam: float, seed: int,
                noise: float = 1.0) -> FiniteSum:
  r"""A seeded synthetic sparse problem: each row has ``nnz_per_row`` nonzeros at random distinct columns.

  Values :math:`\sim \mathcal N(0, 1/k)` (rows of unit norm in expectation),
  a planted :math:`w_0 \sim \mathcal N(0, I_d)`, targets as in
  :func:`make_dense`. No row is padded.

  Args:
    kind: ``"logistic"`` or ``"least_squares"``.
    n: samples (``>= 1``).
    d: features (``>= 1``).
    nnz_per_row: :math:`k`, ``1 <= k <= d``.
    lam: :math:`\lambda \ge 0`.
    seed: the same seed gives the same problem.
    noise: :math:`\ge 0`, the standard deviation of :math:`\varepsilon`.

  Returns:
    A sparse :class:`FiniteSum` (``indices`` ``[n, k]`` sorted in each row).

  Examples:
    >>> import delayjax as dj
    >>> p = dj.problems.make_sparse("least_squares", 100, 20, 3, lam=0.01, seed=0)
    >>> p.indices.shape, p.num_features, p.sparse
    ((100, 3), 20, True)
  """
  check_choice("kind", kind, KINDS)
  n, d = check_int("n", n, minimum=1), check_int("d", d, minimum=1)
  k = check_int("nnz_per_row", nnz_per_row, minimum=1)
  if k > d:
    raise ValueError(f"nnz_per_row must be <= d = {d}, got {k}.")
  noise = check_float("noise", noise, minimum=0.0)
  check_seed("seed", seed)
  # The random keys float64 [n, d] and argpartition's int64 [n, d] pick the columns; the rest is [n, k].
  _memory.check_fits(f"make_sparse with n={n} x d={d} (a float64 and an int64 [n, d] array to draw the columns)",
                     2 * 8 * n * d + 6 * 8 * n * k, _memory.available_memory())
  rng = np.random.default_rng(seed)
  indices = np.sort(np.argpartition(rng.random((n, d)), k - 1, axis=1)[:, :k], axis=1)
  values = rng.standard_normal((n, k)) / np.sqrt(k)
  z = np.sum(values * rng.standard_normal(d)[indices], axis=1)
  return FiniteSum(kind, targets=_targets(kind, z, noise, rng), lam=lam, indices=indices, values=values,
                   num_features=d)


def digits(*, lam: float = 1e-4, threshold: int = 5) -> FiniteSum:
  r"""Logistic regression on scikit-learn's bundled digits (1797 images; no download): is the digit < threshold?

  The 64 pixels are standardized (constant pixels dropped), a constant
  feature is appended and every row is scaled to unit norm, so that
  :math:`L_{\max} = 1/4 + \lambda`. Labels: +1 for a digit below
  ``threshold``, -1 otherwise.

  Args:
    lam: :math:`\lambda \ge 0`.
    threshold: an integer in 1..9.

  Returns:
    A dense logistic :class:`FiniteSum` (n = 1797, d = 62).

  Raises:
    ImportError: if scikit-learn is not installed.
  """
  threshold = check_int("threshold", threshold, minimum=1)
  if threshold > 9:
    raise ValueError(f"threshold must be in 1..9, got {threshold}.")
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:
    raise ImportError(
        "dj.problems.digits needs scikit-learn (pip install scikit-learn, or delayjax[experiments]).") from e
  pixels, digit = load_digits(return_X_y=True)
  pixels = pixels.astype(np.float64)
  keep = pixels.std(axis=0) > 0
  x = (pixels[:, keep] - pixels[:, keep].mean(axis=0)) / pixels[:, keep].std(axis=0)
  x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return FiniteSum("logistic", targets=np.where(digit < threshold, 1.0, -1.0), lam=lam, features=x)


# ---------------------------------------------------------------- a contextual bandit whose rollouts take time


@dataclasses.dataclass(frozen=True, eq=False)
class ContextualBandit:
  r"""A contextual bandit with a known optimum, whose contexts (prompts) take time to answer.

  Context :math:`s` (of :math:`S`) has mean rewards :math:`\bar r(s, a)` for
  its :math:`A` actions and a *length* :math:`L_s`, the tokens a rollout of it
  generates, so a rollout's generation time grows with its context's length.
  A reward is :math:`\bar r(s, a) + \sigma \xi`, :math:`\xi \sim N(0, 1)`.
  The policy is tabular softmax, :math:`\pi_\theta(a \mid s) \propto
  e^{\theta_{s a}}` (params ``{"logits": [S, A]}``), so the optimum
  :math:`\max_a \bar r(s, a)` per context is known and the regret of a
  policy is exact.

  Build it with :func:`contextual_bandit`. Attributes:
    means: float64 ``[S, A]``, :math:`\bar r`.
    lengths: int64 ``[S]``, :math:`L_s \ge 1`.
    noise: :math:`\sigma \ge 0`.
  """

  means: np.ndarray
  lengths: np.ndarray
  noise: float

  @property
  def num_contexts(self) -> int:
    return int(self.means.shape[0])

  @property
  def num_actions(self) -> int:
    return int(self.means.shape[1])

  def init_params(self) -> dict[str, jax.Array]:
    """The uniform policy: zero logits, float32 ``[S, A]``."""
    return {"logits": jnp.zeros(self.means.shape, jnp.float32)}

  def log_prob(self, params: Any, contexts: jax.Array, actions: jax.Array) -> jax.Array:
    r""":math:`\log \pi_\theta(a_i \mid s_i)`, float32 ``[B]``."""
    return jax.nn.log_softmax(params["logits"])[contexts, actions]

  def sample(self, params: Any, key: jax.Array, contexts: jax.Array) -> dict[str, jax.Array]:
    """Rollouts of the policy ``params`` on ``contexts`` (int ``[B]``): ``contexts``, ``actions``, ``rewards``
    and ``behaviour_logp`` (the log-probs of the actions under ``params``), each ``[B]``."""
    k_action, k_noise = jax.random.split(key)
    logits = params["logits"][contexts]
    actions = jax.random.categorical(k_action, logits).astype(jnp.int32)
    means = jnp.asarray(self.means, jnp.float32)[contexts, actions]
    rewards = means + jnp.float32(self.noise) * jax.random.normal(k_noise, means.shape, jnp.float32)
    return {"contexts": contexts.astype(jnp.int32), "actions": actions, "rewards": rewards,
            "behaviour_logp": jax.nn.log_softmax(logits)[jnp.arange(actions.shape[0]), actions]}

  def expected_reward(self, params: Any) -> np.ndarray:
    r"""float64 ``[S]``: :math:`\sum_a \pi_\theta(a \mid s) \bar r(s, a)` per context."""
    logits = np.asarray(params["logits"], np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return (p * self.means).sum(axis=1)

  def regret(self, params: Any) -> np.ndarray:
    r"""float64 ``[S]``: :math:`\max_a \bar r(s, a) - \mathbb{E}_{\pi_\theta}[\bar r(s, a)]` per context (>= 0)."""
    return self.means.max(axis=1) - self.expected_reward(params)

  def generation_times(self, prompts: Any, *, per_token: float = 1.0, overhead: float = 0.0) -> np.ndarray:
    r"""Seconds to generate each batch of ``prompts`` (int ``[..., B]``): ``overhead + per_token * max_b L``.

    A batch is generated together and is done when its longest rollout is,
    so its time is set by the longest context in it. Feed a table ``[M, n, B]``
    of each worker's prompts to ``dj.cluster.workers(M, compute=...)`` (it
    replays ``[M, n]`` times) and to ``dj.workers.Rollouts(prompts=...)``: the
    schedule's delays are then exactly the ones these samples cause.
    """
    prompts = check_number_array("prompts must be an array of context indices [..., B]", prompts, "iu")
    prompts = prompts.astype(np.int64)
    if prompts.ndim < 1 or prompts.size == 0 or prompts.min() < 0 or prompts.max() >= self.num_contexts:
      raise ValueError(f"prompts must be a non-empty array of context indices in [0, {self.num_contexts}), got "
                       f"shape {prompts.shape}" + (f" and range [{prompts.min()}, {prompts.max()}]."
                                                   if prompts.size else "."))
    per_token = check_float("per_token", per_token, minimum=0.0, strict_minimum=True)
    overhead = check_float("overhead", overhead, minimum=0.0)
    return overhead + per_token * self.lengths[prompts].max(axis=-1).astype(np.float64)


def contextual_bandit(num_contexts: int = 8, num_actions: int = 4, *, max_length: int = 8, noise: float = 0.5,
                      seed: int = 0) -> ContextualBandit:
  r"""A :class:`ContextualBandit`: uniform random mean rewards, lengths spread evenly from 1 to ``max_length``.

  .. math::  \bar r(s, a) \sim U(0, 1), \qquad
             L_s = 1 + \left\lfloor \frac{s\,(L_{\max} - 1)}{S - 1} \right\rceil

  (context 0 the shortest, context :math:`S - 1` of length :math:`L_{\max}`).

  Args:
    num_contexts: :math:`S \ge 1`.
    num_actions: :math:`A \ge 2`.
    max_length: :math:`L_{\max} \ge 1`.
    noise: :math:`\sigma \ge 0`, the reward noise.
    seed: the mean rewards' seed.

  Returns:
    A :class:`ContextualBandit`.

  Examples:
    >>> import delayjax as dj
    >>> task = dj.problems.contextual_bandit(4, 3, max_length=7)
    >>> task.lengths.tolist(), bool((task.regret(task.init_params()) > 0).all())
    ([1, 3, 5, 7], True)
  """
  num_contexts = check_int("num_contexts", num_contexts, minimum=1)
  num_actions = check_int("num_actions", num_actions, minimum=2)
  max_length = check_int("max_length", max_length, minimum=1)
  noise = check_float("noise", noise, minimum=0.0)
  rng = np.random.default_rng(check_seed("seed", seed))
  means = rng.uniform(0.0, 1.0, (num_contexts, num_actions))
  spread = np.arange(num_contexts) * (max_length - 1) / max(num_contexts - 1, 1)
  lengths = 1 + np.rint(spread).astype(np.int64)
  means.setflags(write=False)
  lengths.setflags(write=False)
  return ContextualBandit(means, lengths, noise)


# ---------------------------------------------------------------- a strict saddle


@dataclasses.dataclass(frozen=True, eq=False)
class StrictSaddle:
  r"""A smooth nonconvex function with one strict saddle at the origin and two minima, all in closed form.

  .. math::

    f(x) = \tfrac12 x^\top H x + \tfrac{\lambda}{4} \|x\|^4, \qquad H = \mathrm{diag}(h_0, h_1, \dots, h_{d-1}),
    \quad h_0 < 0 < h_1, \dots, h_{d-1},

  so :math:`\nabla f(x) = H x + \lambda \|x\|^2 x` and :math:`\nabla^2 f(x) = H + \lambda(\|x\|^2 I + 2 x
  x^\top)`. The origin is a strict saddle (:math:`\nabla^2 f(0) = H`, smallest eigenvalue :math:`h_0 < 0`); the
  minima are :math:`x^\star = \pm r e_0` with :math:`r = \sqrt{-h_0/\lambda}`, :math:`f^\star = -h_0^2 /
  (4\lambda)` and :math:`\nabla^2 f(x^\star) = \mathrm{diag}(-2h_0, h_1 - h_0, \dots, h_{d-1} - h_0)`; there are
  no other stationary points. It is the standard test function of the saddle-escape literature (a quadratic with
  one direction of negative curvature, made coercive by the quartic term).

  Attributes:
    eigenvalues: float64 ``[d]``, the diagonal of :math:`H`.
    lam: :math:`\lambda > 0`.
  """

  eigenvalues: np.ndarray
  lam: float

  @property
  def dim(self) -> int:
    return int(self.eigenvalues.shape[0])

  @property
  def radius(self) -> float:
    """:math:`r = \\sqrt{-h_0/\\lambda}`: the minima are :math:`\\pm r e_0`."""
    return float(np.sqrt(-self.eigenvalues[0] / self.lam))

  @property
  def minima(self) -> np.ndarray:
    """float64 ``[2, d]``: :math:`+r e_0` and :math:`-r e_0`."""
    m = np.zeros((2, self.dim))
    m[:, 0] = (self.radius, -self.radius)
    return m

  @property
  def min_value(self) -> float:
    """:math:`f^\\star = -h_0^2 / (4\\lambda)`."""
    return float(-self.eigenvalues[0] ** 2 / (4.0 * self.lam))

  @property
  def min_hessian_eigenvalues(self) -> np.ndarray:
    """float64 ``[d]``: the eigenvalues of :math:`\\nabla^2 f(x^\\star)`, :math:`(-2h_0, h_i - h_0)`."""
    h = self.eigenvalues
    return np.concatenate([[-2.0 * h[0]], h[1:] - h[0]])

  @property
  def smoothness(self) -> float:
    """The largest eigenvalue of the Hessian at the saddle and at the minima, which bounds a stable step there.

    It is :math:`\\max(|h|_{\\max}, -2h_0, h_{\\max} - h_0)`.
    """
    return float(max(np.max(np.abs(self.eigenvalues)), np.max(self.min_hessian_eigenvalues)))

  def value(self, x: Any) -> Any:
    """:math:`f(x)`; ``x`` a NumPy or JAX array ``[d]``, computed in its own array library and dtype."""
    xp = jnp if isinstance(x, jax.Array) else np
    h = xp.asarray(self.eigenvalues, dtype=x.dtype)
    sq = xp.sum(x * x)
    return 0.5 * xp.sum(h * x * x) + 0.25 * self.lam * sq * sq

  def grad(self, x: Any) -> Any:
    """:math:`\\nabla f(x) = H x + \\lambda \\|x\\|^2 x`."""
    xp = jnp if isinstance(x, jax.Array) else np
    h = xp.asarray(self.eigenvalues, dtype=x.dtype)
    return h * x + self.lam * xp.sum(x * x) * x

  def hessian(self, x: Any) -> Any:
    """:math:`\\nabla^2 f(x) = H + \\lambda(\\|x\\|^2 I + 2 x x^\\top)`, ``[d, d]``."""
    xp = jnp if isinstance(x, jax.Array) else np
    h = xp.asarray(self.eigenvalues, dtype=x.dtype)
    return xp.diag(h + self.lam * xp.sum(x * x)) + 2.0 * self.lam * xp.outer(x, x)


def strict_saddle(eigenvalues: Any, *, lam: float = 1.0) -> StrictSaddle:
  """A :class:`StrictSaddle` with :math:`H = \\mathrm{diag}(` ``eigenvalues`` :math:`)`.

  Args:
    eigenvalues: ``[d]`` (``d >= 1``), finite; the first negative (the escape direction), every other positive.
    lam: :math:`\\lambda > 0`, the weight of the quartic term.

  Returns:
    The problem, its saddle at the origin and its minima at :math:`\\pm\\sqrt{-h_0/\\lambda}\\, e_0`.
  """
  h = check_number_array("eigenvalues must be an array of numbers of shape [d]", eigenvalues, kinds="iuf")
  if h.ndim != 1 or h.shape[0] < 1 or not np.all(np.isfinite(h)):
    raise ValueError(f"eigenvalues must be a 1-D array of d >= 1 finite numbers, got shape {h.shape} "
                     f"with values {h.tolist()}.")
  if not (h[0] < 0 and np.all(h[1:] > 0)):
    raise ValueError(f"eigenvalues must have a negative first entry (the escape direction) and positive others "
                     f"(one strict saddle), got {h.tolist()}.")
  lam = check_float("lam", lam, minimum=0.0, strict_minimum=True)
  h = h.copy()
  h.setflags(write=False)
  return StrictSaddle(h, lam)
