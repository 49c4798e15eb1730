r"""Byzantine workers: pushes that carry an attacked gradient instead of the true one.

A Byzantine-tolerant rule (``dj.zeno_plus_plus``) is judged against workers
that lie. :class:`Byzantine` is the default :class:`~delayjax.runtime._workers.Gradient`
worker with an attack: a push it chooses computes the honest minibatch
gradient at the parameters read, then replaces it by the attack's vector.
Which pushes are attacked is declared either by worker (given workers attack
every push) or by push (each push is attacked with a probability), the way
the Zeno++ experiments draw them. Both are functions of the run's seed and
the contribution (its update, worker and draw) alone, so a run is the same
whatever its lanes, chunks, devices or checkpoints, and the plug-in keeps no
state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_choice, check_float, check_int
from delayjax.runtime._workers import Gradient

__all__ = ["ATTACKS", "Byzantine"]

#: The attacks :class:`Byzantine` knows.
ATTACKS = ("sign_flip", "gaussian")

# Tags folded into the contribution's own key: the draw that decides the attack and the attack's noise are
# apart from each other (the honest gradient draws its minibatches from another stream).
_CHOICE_TAG, _NOISE_TAG = 0, 1


@dataclasses.dataclass(frozen=True, init=False)
class Byzantine(Gradient):
  r"""Workers that push an attacked gradient: the honest worker (``Gradient``) with an attack.

  A contribution of worker :math:`m` to update :math:`u` first computes the
  honest minibatch gradient :math:`g_{u,m}` at the parameters it read
  (exactly as :class:`Gradient`, with the same options). It is *attacked*
  when :math:`u \ge` ``start`` and

  * ``workers`` is given: :math:`m` is one of them (a Byzantine worker
    attacks every push); or
  * ``fraction`` :math:`= q` is given: :math:`U_{u,m} < q`, with
    :math:`U_{u,m}` uniform on :math:`[0, 1)`, drawn as
    ``jax.random.uniform(fold_in(key, 0))`` from the contribution's own key
    (``WorkerContext.key``: the run's seed, the update, the worker and its
    draw), so each push is attacked independently with probability
    :math:`q` (the Zeno++ experiments: a push is Byzantine with probability
    :math:`q = b / M`, ``b`` of ``M`` workers).

  An attacked push carries, in place of :math:`g_{u,m}`:

  * ``"sign_flip"``: :math:`-a\, g_{u,m}` (the sign-flipping attack scaled by
    :math:`a` = ``scale``);
  * ``"gaussian"``: :math:`a\, \xi`, :math:`\xi \sim N(0, I)` of the
    gradient's shape, drawn from ``fold_in(key, 1)`` split over the leaves
    (a random gradient of standard deviation :math:`a`, independent of the
    data).

  Only the payload's ``"grad"`` is attacked; what a transformation requests
  beside it (SVRG's ``snapshot_grad``, SAGA's per-example terms) stays
  honest. The push's loss is the honest one at the parameters read. With no
  Byzantine worker (``workers=()`` or ``fraction=0``) the run is the
  ``Gradient`` worker's, bit for bit.

  Source: the attack model is that of the authors' code
  (github.com/xcgoner/iclr2020_zeno_async, ``train_cifar10.py``): each
  gradient is Byzantine with probability ``nbyz / nworkers``, a Byzantine
  gradient is :math:`-a\, g` with ``--byz-param-a`` :math:`a` (default 10,
  which its experiment scripts keep), and attacks start after one epoch
  (``start`` here). **The paper's own text was not reachable (only its
  abstract and introduction)**: its exact attack scale and fractions are
  not confirmed from it. The Gaussian attack is the random-gradient attack
  of the Byzantine literature; the Zeno++ code does not use it.

  Args:
    attack: ``"sign_flip"`` or ``"gaussian"``.
    scale: :math:`a > 0`: the sign-flip factor, or the Gaussian's standard
      deviation.
    workers: the Byzantine workers' indices (each in ``[0, num_workers)`` of
      the schedule); exclusive with ``fraction``.
    fraction: :math:`q \in [0, 1)`, the probability that a push is attacked;
      exclusive with ``workers``.
    start: the first update whose pushes may be attacked (``>= 0``).
    snapshot_every, full_batch_size, sample_terms: as :class:`Gradient`.

  References:
    Xie, Koyejo, Gupta, `Zeno++: Robust Fully Asynchronous SGD
    <https://arxiv.org/abs/1903.07020>`_, ICML 2020.
  """

  attack: str = "sign_flip"
  scale: float = 10.0
  workers: Sequence[int] | None = None
  fraction: float | None = None
  start: int = 0

  def __init__(self, attack: str = "sign_flip", *, scale: float = 10.0, workers: Sequence[int] | None = None,
               fraction: float | None = None, start: int = 0, snapshot_every: int | None = None,
               full_batch_size: int | None = None, sample_terms: Any = None):
    # By hand: the attack first and the rest by keyword, where the dataclass would put Gradient's options first.
    for name, value in (("attack", attack), ("scale", scale), ("workers", workers), ("fraction", fraction),
                        ("start", start), ("snapshot_every", snapshot_every), ("full_batch_size", full_batch_size),
                        ("sample_terms", sample_terms)):
      object.__setattr__(self, name, value)
    self.__post_init__()

  def __post_init__(self):
    super().__post_init__()
    check_choice("Byzantine.attack", self.attack, ATTACKS)
    object.__setattr__(self, "scale", check_float("Byzantine.scale", self.scale, minimum=0.0, strict_minimum=True))
    object.__setattr__(self, "start", check_int("Byzantine.start", self.start, minimum=0))
    if (self.workers is None) == (self.fraction is None):
      raise ValueError(
          f"Byzantine needs exactly one of workers (the Byzantine workers' indices) and fraction (the "
          f"probability that a push is attacked), got workers={self.workers!r} and fraction={self.fraction!r}.")
    if self.fraction is not None:
      fraction = check_float("Byzantine.fraction", self.fraction)
      if not 0.0 <= fraction < 1.0:
        raise ValueError(f"Byzantine.fraction must be in [0, 1) (the probability that a push is attacked), got "
                         f"{fraction}.")
      object.__setattr__(self, "fraction", fraction)
    else:
      if isinstance(self.workers, (str, bytes)) or np.ndim(self.workers) != 1:
        raise TypeError(f"Byzantine.workers must be a sequence of worker indices, got "
                        f"{type(self.workers).__name__} {self.workers!r}.")
      ids = tuple(check_int(f"Byzantine.workers[{i}]", m, minimum=0) for i, m in enumerate(list(self.workers)))
      if len(set(ids)) != len(ids):
        raise ValueError(f"Byzantine.workers must name each worker once, got {list(ids)}.")
      object.__setattr__(self, "workers", tuple(sorted(ids)))

  def bind(self, num_workers, padded_workers):
    if self.workers is not None and self.workers and self.workers[-1] >= num_workers:
      raise ValueError(
          f"Byzantine.workers must be worker indices in [0, {num_workers}) (the schedule has {num_workers} "
          f"workers), got {[m for m in self.workers if m >= num_workers]} out of range.")
    return self

  def contribute(self, ctx, read, state):
    loss, payload, state = super().contribute(ctx, read, state)
    if self._never_attacks():
      return loss, payload, state
    attacked = self._attacked(ctx)
    forged = self._forged(ctx, payload["grad"])
    grad = jax.tree.map(lambda f, g: jnp.where(attacked, f, g), forged, payload["grad"])
    return loss, {**payload, "grad": grad}, state

  def _never_attacks(self) -> bool:
    """Whether no push can be attacked: the run is then the honest worker's, with nothing added to its program."""
    return self.fraction == 0.0 if self.workers is None else not self.workers

  def _attacked(self, ctx) -> jax.Array:
    """Whether this contribution is attacked (a traced bool)."""
    if self.workers is None:
      chosen = jax.random.uniform(jax.random.fold_in(ctx.key, _CHOICE_TAG)) < self.fraction
    else:
      chosen = jnp.isin(ctx.worker, jnp.asarray(self.workers, jnp.int32))
    return chosen & (ctx.update >= self.start)

  def _forged(self, ctx, grad: Any) -> Any:
    """What an attacked push carries in place of ``grad``."""
    if self.attack == "sign_flip":
      return jax.tree.map(lambda g: jnp.asarray(-self.scale, g.dtype) * g, grad)
    leaves, treedef = jax.tree.flatten(grad)
    keys = jax.random.split(jax.random.fold_in(ctx.key, _NOISE_TAG), len(leaves))
    noise = [jnp.asarray(self.scale, g.dtype) * jax.random.normal(k, g.shape, g.dtype) for g, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noise)

  def payload_like(self, params, inputs, samples, terms):
    # None: the runtime traces this push, so the attack (its kind, scale, workers or fraction) is part of the
    # program the compile cache and a checkpoint's identity digest, as a plug-in of the user's is.
    return None

  def identity(self):
    return {**super().identity(), "attack": self.attack, "scale": self.scale, "workers": self.workers,
            "fraction": self.fraction, "start": self.start}
