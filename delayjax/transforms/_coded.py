r"""Gradient codes: the full gradient decoded exactly from whichever ``k`` of ``n`` workers arrived.

The data are split into ``n`` equal parts; worker :math:`m` holds ``n - k + 1``
of them (cyclically) and pushes one fixed linear combination of their
gradients (``dj.workers.Coded``). :class:`GradientCode` holds the encoding
matrix; :func:`decode_gradient_code` is the server's side, a transformation
that finds, from the contributions of an update and their workers, the
combination of the arrived messages that equals the full gradient.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._checks import check_int, check_seed
from delayjax.transforms._per_contribution import CONTRIBUTION_INPUTS

__all__ = ["GradientCode", "GradientCodeState", "decode_gradient_code"]


class GradientCode:
  r"""A cyclic gradient code: ``n`` parts, ``n`` workers, the full gradient from any ``k`` of them.

  With :math:`s = n - k` tolerated stragglers, worker :math:`m` is assigned
  the parts :math:`T_m = \{m, m+1, \dots, m+s\} \bmod n` and pushes

  .. math::

    c_m = \sum_{p \in T_m} B_{m p}\, g_p,

  :math:`g_p` the gradient of the loss averaged over part :math:`p`. The
  encoding matrix :math:`B \in \mathbb{R}^{n \times n}` (support :math:`T_m`
  in row :math:`m`, :math:`B_{mm} = 1`) is built as in Tandon et al.'s
  random construction: draw :math:`H \in \mathbb{R}^{s \times n}` with
  i.i.d. standard normal entries in its first :math:`n - 1` columns and the
  last column making :math:`H \mathbf 1 = 0`, then choose each row's other
  :math:`s` entries so that :math:`H b_m = 0`. Of 16 such draws the code
  keeps the one whose worst condition number of :math:`B_S` over the sets
  :math:`S` of :math:`k` workers (all, or 256 drawn at random when there
  are more) is least (the library's choice, for float32 decoding). The rows lie in the
  :math:`k`-dimensional null space of :math:`H`, which holds
  :math:`\mathbf 1`; any :math:`k` of them are independent with probability
  one, so for every set :math:`S` of at least :math:`k` workers there is
  :math:`a_S` with

  .. math::

    a_S^\top B_S = \tfrac{1}{n} \mathbf 1^\top, \qquad
    \sum_{m \in S} a_{S,m}\, c_m = \frac{1}{n} \sum_{p} g_p = \nabla F,

  the gradient over the whole data (the parts are equal). With ``k = n``
  (:math:`s = 0`) :math:`B = I`: each worker pushes its own part's gradient,
  the uncoded synchronous scheme.

  Args:
    num_workers: :math:`n \ge 1`, the workers (and parts) of the schedule.
    k: :math:`1 \le k \le n`, the workers any update waits for
      (``dj.cluster.k_sync(k)``).
    seed: the seed of :math:`H` (the same seed gives the same code).

  Attributes:
    matrix: float64 ``[n, n]``, :math:`B` (read-only).
    stragglers: :math:`s = n - k`.

  References:
    Tandon, Lei, Dimakis, Karampatziakis, `Gradient Coding: Avoiding
    Stragglers in Distributed Learning <https://proceedings.mlr.press/v70/tandon17a.html>`_,
    ICML 2017 (the cyclic repetition scheme and its random construction).
  """

  def __init__(self, num_workers: int, k: int, *, seed: int = 0):
    n = check_int("num_workers", num_workers, minimum=1)
    k = check_int("k", k, minimum=1)
    if k > n:
      raise ValueError(f"k must be in [1, num_workers] = [1, {n}] (the workers an update waits for), got k={k}.")
    check_seed("seed", seed)
    self.num_workers, self.k, self.seed, self.stragglers = n, k, int(seed), n - k
    rng = np.random.default_rng(seed)
    # Any draw decodes exactly in exact arithmetic, but some are badly conditioned for some sets of workers: keep
    # the best of a few draws by the worst condition number of B_S over the sets of k workers (all of them, or a
    # sample when there are many), so that float32 runs decode to float32's precision.
    subsets = _subsets(n, k, rng)
    candidates = [_cyclic_matrix(n, n - k, rng) for _ in range(_DRAWS if k < n else 1)]
    self.matrix = min(candidates, key=lambda b: max(np.linalg.cond(b[list(s)]) for s in subsets))
    self.matrix.setflags(write=False)

  def parts(self, worker: int) -> list[int]:
    """The parts worker ``worker`` holds, :math:`T_m`, in order."""
    m = check_int("worker", worker, minimum=0)
    if m >= self.num_workers:
      raise ValueError(f"worker must be in [0, {self.num_workers}), got {m}.")
    return [(m + j) % self.num_workers for j in range(self.stragglers + 1)]

  def decoding(self, workers: Any) -> np.ndarray:
    r"""float64 ``[len(workers)]``: :math:`a_S` for the arrived ``workers`` (distinct, at least ``k``; the
    minimum-norm solution when more than ``k`` arrived)."""
    ids = np.asarray(workers)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f"workers must be a 1-D sequence of worker indices, got {workers!r}.")
    if len(set(ids.tolist())) != ids.size or ids.size < self.k or ids.min() < 0 or ids.max() >= self.num_workers:
      raise ValueError(f"workers must be at least k={self.k} distinct indices in [0, {self.num_workers}), got "
                       f"{ids.tolist()}.")
    rows = self.matrix[ids]
    return np.linalg.lstsq(rows.T, np.full(self.num_workers, 1.0 / self.num_workers), rcond=None)[0]

  def __repr__(self) -> str:
    return f"GradientCode(num_workers={self.num_workers}, k={self.k}, seed={self.seed})"


# Draws of H among which GradientCode keeps the best conditioned, and the most sets of k workers it checks.
_DRAWS, _MAX_SUBSETS = 16, 256


def _subsets(n: int, k: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
  """Every set of ``k`` of ``n`` workers, or ``_MAX_SUBSETS`` random ones when there are more."""
  if math.comb(n, k) <= _MAX_SUBSETS:
    return list(itertools.combinations(range(n), k))
  return [tuple(sorted(rng.choice(n, k, replace=False).tolist())) for _ in range(_MAX_SUBSETS)]


def _cyclic_matrix(n: int, s: int, rng: np.random.Generator) -> np.ndarray:
  """Tandon et al.'s random cyclic encoding matrix (the class docstring)."""
  b = np.zeros((n, n))
  if s == 0:
    np.fill_diagonal(b, 1.0)
    return b
  h = rng.standard_normal((s, n))
  # The last column makes H 1 = 0, so 1 is in the null space the rows of B span.
  h[:, -1] = -h[:, :-1].sum(axis=1)
  for m in range(n):
    others = [(m + j) % n for j in range(1, s + 1)]
    b[m, m] = 1.0
    b[m, others] = np.linalg.solve(h[:, others], -h[:, m])
  return b


class GradientCodeState(NamedTuple):
  """State of :func:`decode_gradient_code` (none: the code is fixed)."""

  def runtime_inputs(self) -> tuple[str, ...]:
    # Decoding needs which workers an update's messages came from.
    return CONTRIBUTION_INPUTS


def decode_gradient_code(code: GradientCode) -> optax.GradientTransformationExtraArgs:
  r"""The server's side of a gradient code: the full gradient from the messages of the workers that arrived.

  For an update whose contributions are the messages :math:`c_m` of the
  workers :math:`m \in S` (``contribution_grads``, ``contribution_workers``;
  contributions of weight 0, left out of the update, are not in :math:`S`):

  .. math::

    d_u = \sum_{m \in S} a_{S,m}\, c_m, \qquad a_S = (B_S^\top)^{+}\, \tfrac{1}{n} \mathbf 1,

  the minimum-norm solution of :math:`B_S^\top a = \mathbf 1 / n`, solved in
  the compiled step (an SVD of the :math:`|S| \times n` rows :math:`B_S`, in
  the messages' precision). With :math:`|S| \ge k` it is exact
  (:class:`GradientCode`), so :math:`d_u` is the full-data gradient at the
  parameters the workers read; an update with fewer than ``k`` messages
  cannot be decoded and gives NaN (reported as non-finite, never a quietly
  different number). Place it first in the chain, before the server's
  optimizer: ``optax.chain(dj.decode_gradient_code(code), optax.sgd(lr))``,
  with the workers ``dj.workers.Coded(code, data)``. The runtime's own
  average of the contributions (the first argument) is not used.

  Args:
    code: the :class:`GradientCode` the workers encode with.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError: if ``code`` is not a :class:`GradientCode`.
    ValueError: at the update, when called without the contribution inputs
      (``dj.simulate`` passes them; a hand-written loop must).

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> import delayjax as dj
    >>> code = dj.GradientCode(3, k=2)
    >>> parts = np.array([[1.0], [2.0], [6.0]])  # g_p, one per part: full gradient 3
    >>> messages = code.matrix @ parts
    >>> tx = dj.decode_gradient_code(code)
    >>> d, _ = tx.update(jnp.zeros(1), tx.init(jnp.zeros(1)), contribution_grads=jnp.asarray(messages[[2, 0]]),
    ...                  contribution_workers=jnp.array([2, 0]), contribution_weights=jnp.array([0.5, 0.5]))
    >>> round(float(d[0]), 5)
    3.0

  References:
    Tandon, Lei, Dimakis, Karampatziakis, `Gradient Coding: Avoiding
    Stragglers in Distributed Learning <https://proceedings.mlr.press/v70/tandon17a.html>`_,
    ICML 2017.

    Soto, Ilmer, Guan, Li, `Lightweight Projective Derivative Codes for
    Compressed Asynchronous Gradient Descent <https://arxiv.org/abs/2201.12990>`_,
    ICML 2022 (coded partial derivatives decoded from the workers that
    arrived; see ``dj.workers.Coded`` for what was read of it).
  """
  if not isinstance(code, GradientCode):
    raise TypeError(f"code must be a dj.GradientCode (e.g. dj.GradientCode(8, k=6)), got {type(code).__name__} "
                    f"{code!r}.")
  matrix = code.matrix

  def init_fn(params):
    del params
    return GradientCodeState()

  def update_fn(updates, state, params=None, *, contribution_grads=None, contribution_workers=None,
                contribution_weights=None, **extra_args):
    del updates, params, extra_args
    if contribution_grads is None or contribution_workers is None or contribution_weights is None:
      raise ValueError(
          "decode_gradient_code needs contribution_grads, contribution_workers and contribution_weights (which "
          "worker pushed each message of the update); dj.simulate passes them, a hand-written loop must.")
    leaves = jax.tree.leaves(contribution_grads)
    dtype = jnp.result_type(*leaves)
    present = jnp.asarray(contribution_weights) > 0
    workers = jnp.clip(jnp.asarray(contribution_workers, jnp.int32), 0, code.num_workers - 1)
    # The rows of the messages that arrived; a left-out contribution's row is zero, so it takes no weight.
    rows = jnp.where(present[:, None], jnp.asarray(matrix, dtype)[workers], jnp.zeros((), dtype))
    target = jnp.full((code.num_workers,), 1.0 / code.num_workers, dtype)
    coeffs = jnp.linalg.pinv(rows.T) @ target
    # Fewer than k messages span no exact decoding: NaN, which the runtime reports.
    decodable = jnp.sum(present) >= code.k
    coeffs = jnp.where(decodable, coeffs, jnp.full_like(coeffs, jnp.nan))

    def combine(c):
      return jnp.tensordot(coeffs.astype(c.dtype), c, axes=1)

    return jax.tree.map(combine, contribution_grads), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
