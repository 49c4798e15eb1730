r"""Streaming DiLoCo: local-SGD workers whose fragments sync in turn, the outer step overlapped with inner steps.

DiLoCo (``dj.workers.LocalSteps`` under BSP with an outer optimizer) syncs
all parameters every :math:`H` inner steps and waits for the outer step.
Streaming DiLoCo splits the parameters into :math:`P` fragments that sync
on staggered offsets, one every :math:`H / P` inner steps, and overlaps each
fragment's exchange with :math:`\tau` further inner steps: the outer update
arrives late and is merged into the worker's local progress,
:math:`\theta^{L}_p \leftarrow \alpha\, \theta^{L}_p + (1 - \alpha)\, \theta^{G}_p`.

In delayjax one update is one fragment's sync: under ``dj.cluster.bsp()``,
every update's contributions are each worker's next :math:`H / P` inner
steps, and ``dj.per_fragment(outer)`` applies the outer optimizer to
fragment :math:`u \bmod P` only. The global fragment of update :math:`u - 1`
is in the parameters a worker reads for update :math:`u`; the worker uses it
only after :math:`\tau` of its steps, which is exactly the overlap's
numerics (the exchange's latency, hidden by the overlap, is a matter for the
cluster's time model, not for the numbers).

Eager updates (``eager=outer``) fill the overlap differently: while fragment
:math:`q`'s average is in flight, the worker trains as if its own outer
gradient were the average, stepped by its own copy of the outer optimizer,
and swaps that stand-in for the true global fragment when it arrives.
**Only the abstract of Kale, Douillard and Donchev's paper and third-party
summaries of it could be read from here.** They describe the eager outer
gradient as a mixture of the worker's current local outer gradient with the
delayed outer gradients of the other workers, applied before the all-reduce
completes, the delayed ones being taken in when they arrive; the stand-in
implemented here (the worker's own outer gradient for the whole average,
replaced by the global fragment on arrival) is this module's reading of that
for an overlap of :math:`\tau` inner steps. Reference: Kale, Douillard,
Donchev, `Eager Updates For Overlapped Communication and Computation in DiLoCo
<https://arxiv.org/abs/2502.12996>`_, 2025.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._checks import check_float, check_int
from delayjax.runtime._workers import Worker
from delayjax.transforms._fragments import PerFragmentState, _check_fragments, per_fragment

__all__ = ["StreamingDiLoCo"]


@dataclasses.dataclass(frozen=True, eq=False)
class StreamingDiLoCo(Worker):
  r"""Streaming DiLoCo's workers: fragment-staggered outer syncs, overlapped by :math:`\tau` steps, alpha-merged.

  Worker :math:`m` keeps its local parameters :math:`\theta^L`, its inner
  optimizer's state and, per leaf, :math:`a` (minus its outer gradient so
  far). Its contribution to update :math:`u` (fragment :math:`p = u \bmod P`,
  having read the global :math:`\theta^G`):

  1. :math:`\tau` inner steps :math:`\theta^L \leftarrow \theta^L + d_h`,
     :math:`a \leftarrow a + d_h` (with ``eager``, each :math:`d_h` is taken at
     :math:`\theta^L + e`, below);
  2. for :math:`u \ge 1`, merges fragment :math:`q = (u - 1) \bmod P`, synced by update
     :math:`u - 1`: :math:`\theta^L_q \leftarrow \alpha \theta^L_q + (1 - \alpha) \theta^G_q`,
     :math:`a_q \leftarrow \theta^L_q - \theta^G_q` (exactly 0 for :math:`\alpha = 0`);
  3. the remaining :math:`H_f - \tau` inner steps;
  4. pushes :math:`-a_p = \theta^G_p - \theta^L_p` on fragment :math:`p`, zero elsewhere.

  With ``tx = dj.per_fragment(outer, fragments)``. With one fragment,
  :math:`\tau = 0` and :math:`\alpha = 0` this is DiLoCo bit for bit:
  ``dj.workers.LocalSteps(H, optimizer, keep_state=True)`` with ``tx = outer``.

  **Eager updates** (``eager=outer``, Kale et al. 2025): the worker does not
  wait for the average of its push to see an outer step. Right after pushing
  :math:`\Delta_m = -a_p` it steps its own copy of the outer optimizer (its
  own state :math:`s_m`, fed only its own outer gradients) with
  :math:`\Delta_m` standing in for the all-reduced average,

  .. math::

    (\delta_m, s_m) \leftarrow \text{outer.update}(\Delta_m, s_m, \theta^G_p), \qquad
    e_p = \delta_m - a_p = (\theta^G_p + \delta_m) - \theta^L_p,

  so that during the next contribution's :math:`\tau` overlapped steps the
  gradients are taken at :math:`\theta^L + e` (fragment :math:`p` at the
  stand-in global :math:`\theta^G_p + \delta_m`, the other fragments as they
  are). When the global fragment arrives (step 2) the stand-in is dropped and
  the merge is the one above: eager updates change only where the overlapped
  steps are computed. Hence two identities: with :math:`\tau = 0` nothing is
  overlapped and eager equals non-eager bit for bit; with FedAvg's outer step
  (``optax.sgd(1.0)``) :math:`\delta_m = a_p`, the stand-in *is* the local
  fragment, and eager again equals non-eager bit for bit.
  **Kale et al.'s full text was not reachable here: their eager outer gradient
  mixes the worker's fresh outer gradient with delayed all-reduced ones (see
  the module docstring); a worker here sees the global parameters, not the
  averaged outer gradient, so its own outer gradient stands in for all of it.**

  The pushes here are exact; Streaming DiLoCo's quantized outer exchange
  (each worker's outer gradient in a low-precision float, averaged in full
  precision) is the server's
  ``optax.chain(dj.per_contribution(dj.quantize_float(3, 0)), dj.per_fragment(outer, fragments))``:
  each worker's push is one contribution of the update, rounded on its own
  before the weighted average (see :func:`delayjax.quantize_float`).

  Args:
    steps: :math:`H_f \ge 1`, the inner steps per contribution (per
      fragment sync; DiLoCo's :math:`H` is :math:`P H_f`).
    optimizer: the inner optimizer (e.g. ``optax.adamw(...)``); its state
      is kept across contributions.
    fragments: one fragment index per leaf (``jax.tree`` order), as given to
      ``dj.per_fragment``; default one fragment.
    overlap: :math:`0 \le \tau \le H_f`, the inner steps the outer update is late.
    alpha: :math:`0 \le \alpha \le 1`, the weight of local progress in the merge
      (0: replace by the global fragment).
    eager: ``None`` (the overlapped steps see the worker's local fragment), or
      the outer optimizer given to ``dj.per_fragment`` (e.g.
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``): eager updates, its
      stand-in outer step taken by a copy the worker keeps.

  References:
    Douillard, Donchev, Rush, Kale, Sinha, Ballé, Kuncoro, Ranzato, Szlam,
    Lampinen, `Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch <https://arxiv.org/abs/2501.18512>`_, 2025;
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023;
    Kale, Douillard, Donchev, `Eager Updates For Overlapped Communication and
    Computation in DiLoCo <https://arxiv.org/abs/2502.12996>`_, 2025.
  """

  steps: int
  optimizer: optax.GradientTransformation
  fragments: Sequence[int] | None = None
  overlap: int = 0
  alpha: float = 0.0
  eager: optax.GradientTransformation | None = None

  sequential = True

  def __post_init__(self):
    if not isinstance(self.optimizer, optax.GradientTransformation):
      raise TypeError(f"StreamingDiLoCo.optimizer must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), "
                      f"got {type(self.optimizer).__name__}.")
    steps = check_int("StreamingDiLoCo.steps", self.steps, minimum=1)
    overlap = check_int("StreamingDiLoCo.overlap", self.overlap, minimum=0)
    if overlap > steps:
      raise ValueError(f"StreamingDiLoCo.overlap must be at most steps ({steps}): the outer update arrives "
                       f"during the next contribution, got overlap={overlap}.")
    alpha = check_float("StreamingDiLoCo.alpha", self.alpha, minimum=0.0, maximum=1.0)
    if self.fragments is not None:
      object.__setattr__(self, "fragments", _check_fragments(self.fragments)[0])
    object.__setattr__(self, "alpha", alpha)
    object.__setattr__(self, "optimizer", optax.with_extra_args_support(self.optimizer))
    if self.eager is not None and not isinstance(self.eager, optax.GradientTransformation):
      raise TypeError(f"StreamingDiLoCo.eager must be None or the outer optimizer given to dj.per_fragment (an "
                      f"optax.GradientTransformation, e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)), got "
                      f"{type(self.eager).__name__} {self.eager!r}.")

  @property
  def num_fragments(self) -> int:
    return 1 if self.fragments is None else max(self.fragments) + 1

  def bind(self, num_workers, padded_workers):
    bound = dataclasses.replace(self)
    object.__setattr__(bound, "local_steps", np.full(padded_workers, self.steps, np.int64))
    return bound

  def _leaf_fragments(self, params) -> tuple[int, ...]:
    count = len(jax.tree.leaves(params))
    if self.fragments is None:
      return (0,) * count
    return _check_fragments(self.fragments, count)[0]

  def _outer_copy(self, params) -> optax.GradientTransformationExtraArgs:
    # The worker's own copy of the outer optimizer, one state per fragment as the server's dj.per_fragment.
    return per_fragment(self.eager, self._leaf_fragments(params))

  def init_state(self, params):
    self._leaf_fragments(params)
    state = (params, self.optimizer.init(params), jax.tree.map(jnp.zeros_like, params))
    if self.eager is None:
      return state
    # Eager: the copy's state and the stand-in's offset e (zero until the first push).
    return state + (self._outer_copy(params).init(params).inner, jax.tree.map(jnp.zeros_like, params))

  def contribute(self, ctx, read, state):
    local, opt_state, acc = state[:3]
    shift = None if self.eager is None else state[4]
    num = self.num_fragments
    frag = self._leaf_fragments(read)
    structure = jax.tree.structure(read)
    update = jnp.asarray(ctx.update, jnp.int32)
    tau = self.overlap
    merging = update >= 1  # update 0 reads the initial parameters: nothing synced yet
    q = (update - 1) % num

    def merge(local, acc, now=True):
      def one(loc, glob, a, f):
        on = now & merging & (q == f)
        mixed = glob if self.alpha == 0.0 else self.alpha * loc + (1.0 - self.alpha) * glob
        # a = merged - global: exactly zero for alpha = 0, so the push is -(sum of the steps), as LocalSteps'.
        fresh = jnp.zeros_like(a) if self.alpha == 0.0 else mixed - glob
        return jnp.where(on, mixed, loc), jnp.where(on, fresh, a)

      pairs = [one(lo, g, a, f) for lo, g, a, f in zip(jax.tree.leaves(local), jax.tree.leaves(read),
                                                       jax.tree.leaves(acc), frag)]
      return jax.tree.unflatten(structure, [x for x, _ in pairs]), jax.tree.unflatten(structure, [a for _, a in pairs])

    def body(carry, h):
      w, opt_state, acc = carry
      if 0 < tau < self.steps:
        # The global fragment arrives after tau steps: merged before step tau. One scan for all the steps (not
        # one before the merge and one after), so the program holds the model's gradient once.
        w, acc = merge(w, acc, h == tau)
      # Eager: the overlapped steps (h < tau) are taken at the stand-in w + e; their deltas still move the
      # worker's own w.
      at = w if shift is None or tau == 0 else jax.tree.map(lambda x, e: jnp.where(h < tau, x + e, x), w, shift)
      loss, payload = ctx.gradient(at, h)
      delta, opt_state = self.optimizer.update(payload["grad"], opt_state, at)
      return (optax.apply_updates(w, delta), opt_state, jax.tree.map(jnp.add, acc, delta)), loss

    if tau == 0:
      local, acc = merge(local, acc)
    (local, opt_state, acc), losses = jax.lax.scan(body, (local, opt_state, acc),
                                                   jnp.arange(self.steps, dtype=jnp.int32))
    if tau == self.steps:
      local, acc = merge(local, acc)
    p = update % num
    push = [jnp.where(p == f, jnp.negative(a), jnp.zeros_like(a)) for a, f in zip(jax.tree.leaves(acc), frag)]
    loss = losses[0]
    grad = jax.tree.unflatten(structure, push)
    if self.eager is None:
      return loss, {"grad": grad}, (local, opt_state, acc)
    # The stand-in: the worker's outer copy steps fragment p with its own outer gradient as the average, from
    # the global fragment p it read (unchanged since p's last sync). The count is the update's, not a tally, so
    # the copy's active fragment is p whatever the worker did before.
    step, outer = self._outer_copy(read).update(grad, PerFragmentState(update, state[3]), read)
    # e_p = delta - a_p: exactly 0 when the outer step is -1 x the outer gradient (FedAvg's), so eager is then
    # non-eager bit for bit.
    fresh = [jnp.where(p == f, d - a, jnp.zeros_like(a))
             for d, a, f in zip(jax.tree.leaves(step), jax.tree.leaves(acc), frag)]
    return loss, {"grad": grad}, (local, opt_state, acc, outer.inner, jax.tree.unflatten(structure, fresh))

  def identity(self):
    streaming = (self.steps, self.fragments, self.overlap, self.alpha)
    functions = {"local_optimizer": self.optimizer}
    if self.eager is not None:
      # Only then: non-eager runs keep the identity (and checkpoints) they had.
      streaming += ("eager",)
      functions["eager_outer"] = self.eager
    return {"streaming": streaming, "functions": functions}

  def requests_allowed(self):
    return False
