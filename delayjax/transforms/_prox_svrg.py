"""Asynchronous proximal variance reduction as named recipes: Async-ProxSVRG and Async-ProxSVRCD (Meng et al.)."""

from __future__ import annotations

import optax

from delayjax.transforms._block_coordinate import block_coordinate
from delayjax.transforms._hyperparams import check_positive_rate
from delayjax.transforms._proximal import ProxFn, proximal
from delayjax.transforms._variance_reduction import svrg


def _check_prox(transform: str, prox: ProxFn) -> None:
  if not callable(prox):
    raise TypeError(f"{transform}: prox must be a callable (x, step) -> prox_{{step R}}(x) such as "
                    f"dj.prox_l1(0.1), got {type(prox).__name__} {prox!r}.")


def prox_svrg(prox: ProxFn, learning_rate: float | optax.Schedule) -> optax.GradientTransformationExtraArgs:
  r"""Async-ProxSVRG: proximal SVRG, also under stale reads (Meng et al.).

  For :math:`P(w) = \frac1n \sum_i f_i(w) + R(w)` (a smooth finite sum plus a
  convex regularizer with a computable prox), an epoch fixes the snapshot
  :math:`\tilde w` and :math:`\mu = \nabla F(\tilde w)`; update :math:`u`
  takes the minibatch :math:`B_u` a worker drew at its read :math:`\hat w`
  (the current parameters when synchronous, stale ones under delays) and
  takes a proximal step from the *current* parameters :math:`w_u`:

  .. math::

    v_u = \nabla f_{B_u}(\hat w) - \nabla f_{B_u}(\tilde w) + \mu, \qquad
    w_{u+1} = \text{prox}_{\gamma R}\big(w_u - \gamma\, v_u\big)

  It is exactly ``optax.chain(dj.svrg(), optax.sgd(learning_rate),
  dj.proximal(prox, learning_rate))``: :func:`svrg` forms :math:`v_u`
  (``snapshot_grad`` and the epoch's ``full_grad`` come from ``dj.simulate``'s
  ``dj.workers.Gradient(snapshot_every=m)``, with the snapshot the last
  iterate of the previous epoch), and the prox of the whole vector follows the
  step. The smooth part's gradients must not include :math:`R`. Without
  delays it is Xiao & Zhang's Prox-SVRG (snapshot option: the last iterate).

  **Only the abstract of Meng et al. could be read from a reachable source.**
  What it confirms: Async-ProxSVRG is the asynchronous parallel form of
  ProxSVRG for regularized empirical risk minimization, with workers computing
  the variance-reduced stochastic gradient at the parameters they read and
  the proximal step applied to the shared parameters; its speed-up is near
  linear when the data are sparse. The rest is delayjax's construction, the
  closest faithful one: the snapshot is the last iterate, and the epoch length
  and minibatch size are the caller's (``snapshot_every``, ``dj.Sampling``).

  Args:
    prox: ``(x, step) -> prox_{step R}(x)`` on pytrees, e.g. :func:`prox_l1`.
    learning_rate: :math:`\gamma`, a number ``> 0``, a scalar array or a schedule of the update count.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and
    SVRG's extra arguments (``snapshot_grad``; ``full_grad`` to start an epoch).

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.prox_svrg(dj.prox_l1(1.0), 0.5)
    >>> w = jnp.array([2.0, 0.2])
    >>> # epoch start: v = g - g + mu = mu = [1, 0]; w+ = soft([1.5, 0.2], 0.5) = [1, 0]
    >>> u, _ = tx.update(jnp.array([3.0, 1.0]), tx.init(w), w, snapshot_grad=jnp.array([3.0, 1.0]),
    ...                  full_grad=jnp.array([1.0, 0.0]))
    >>> w + u
    Array([1., 0.], dtype=float32)

  References:
    Meng, Chen, Yu, Wang, Ma, Liu, `Asynchronous Stochastic Proximal Optimization
    Algorithms with Variance Reduction <https://arxiv.org/abs/1609.08435>`_, AAAI 2017.

    Xiao, Zhang, `A Proximal Stochastic Gradient Method with Progressive
    Variance Reduction <https://arxiv.org/abs/1403.4699>`_, SIAM J. Optim. 2014.
  """
  _check_prox("prox_svrg", prox)
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  return optax.chain(svrg(), optax.sgd(learning_rate), proximal(prox, learning_rate))


def prox_svrcd(prox: ProxFn, learning_rate: float, *, selection: str = "random",
               seed: int = 0) -> optax.GradientTransformationExtraArgs:
  r"""Async-ProxSVRCD: proximal SVRG on one block of coordinates per update, under stale reads (Meng et al.).

  For :math:`P(w) = \frac1n \sum_i f_i(w) + \sum_j R_j(w_j)` with a
  block-separable regularizer, the blocks :math:`w_j` are the leaves of the
  parameter pytree (split a vector into a dict of pieces to get :math:`B`
  partitions). An epoch fixes :math:`\tilde w` and :math:`\mu = \nabla
  F(\tilde w)`; update :math:`u` picks block :math:`j_u` (uniform, or cyclic)
  and, with the minibatch :math:`B_u` drawn at the read :math:`\hat w`,
  changes that block of the *current* parameters only:

  .. math::

    v_u = \nabla_{j_u} f_{B_u}(\hat w) - \nabla_{j_u} f_{B_u}(\tilde w) + \mu_{j_u}, \qquad
    (w_{u+1})_{j_u} = \text{prox}_{\gamma R_{j_u}}\big((w_u)_{j_u} - \gamma\, v_u\big), \qquad
    (w_{u+1})_j = (w_u)_j \ (j \ne j_u)

  It is exactly ``optax.chain(dj.svrg(), dj.block_coordinate(learning_rate,
  prox, selection=selection, seed=seed))``, the same rule as
  :func:`asysbcdvr`; the block of update :math:`u` is
  ``dj.transforms.block_index(u, B, selection, seed)``. The runtime computes whole
  gradients; only block :math:`j_u` is used (a real worker computes that block
  alone, which is the method's saving per update). With
  ``dj.delays.per_leaf`` each block is read at its own version.

  **Only the abstract of Meng et al. could be read from a reachable source.**
  What it confirms: Async-ProxSVRCD is the asynchronous form of ProxSVRCD,
  proximal stochastic coordinate descent with SVRG's variance reduction over
  block partitions of the parameters; its speed-up is near linear whatever the
  sparsity of the data when the number of blocks is set appropriately. The
  rest is delayjax's construction: uniform (or cyclic) blocks, no rescaling of
  the block step, the snapshot the last iterate, the epoch length the caller's.

  Args:
    prox: the block-separable prox, ``(x, step) -> prox_{step R}(x)`` acting leaf by leaf (e.g. :func:`prox_l1`).
    learning_rate: :math:`\gamma > 0`, a float or a scalar array.
    selection: ``"random"`` or ``"cyclic"`` blocks.
    seed: the block draws' seed (``"random"``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and
    SVRG's extra arguments.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.prox_svrcd(dj.prox_l1(1.0), 0.5, selection="cyclic")
    >>> w = {"a": jnp.array([2.0]), "b": jnp.array([3.0])}
    >>> g = {"a": jnp.array([1.0]), "b": jnp.array([1.0])}
    >>> u, _ = tx.update(g, tx.init(w), w, snapshot_grad=g, full_grad=g)  # update 0: block "a"
    >>> u["a"], u["b"]  # prox(2 - 0.5 * 1, 0.5) - 2 = 1 - 2
    (Array([-1.], dtype=float32), Array([0.], dtype=float32))

  References:
    Meng, Chen, Yu, Wang, Ma, Liu, `Asynchronous Stochastic Proximal Optimization
    Algorithms with Variance Reduction <https://arxiv.org/abs/1609.08435>`_, AAAI 2017.
  """
  _check_prox("prox_svrcd", prox)
  return optax.chain(svrg(), block_coordinate(learning_rate, prox, selection=selection, seed=seed))
