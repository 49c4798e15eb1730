"""What a worker computes: the plug-ins of ``dj.simulate``'s ``worker=`` (public as ``dj.workers``).

A worker that read version :math:`v` of the server parameters computes its
*contribution* to an update. The runtime owns everything around it: which
version each contribution reads (the schedule and the read model), its
minibatches (``dj.Sampling``), the lanes and devices it runs on, the buffers
that hold it until its update, the non-finite report. A plug-in says only
what one contribution is, given

* ``ctx``, a :class:`WorkerContext`: ``ctx.gradient(w, draw, terms)`` is the
  mean loss and the *payload* (``{"grad": ...}``, plus what ``terms`` adds
  per minibatch, e.g. SVRG's ``snapshot_grad``) of the contribution's own
  minibatches at parameters ``w``, the ``draw``-th group of them (draws
  ``draw * n, ..., draw * n + n - 1`` of its ``n`` minibatches);
  ``ctx.worker`` its worker (traced int32), ``ctx.key`` a PRNG key of its
  own, ``ctx.value_and_grad`` the loss on any batch, ``ctx.minibatch`` its
  minibatches themselves;
* ``read``, the parameters it read;
* ``state``, the worker's own state (``init_state``), carried from one of its
  contributions to the next when ``sequential``;

and returns ``(loss, payload, state)``. A plug-in that pushes data rather than
a gradient (rollouts of the policy it read) also defines ``at_update``: the
learner's side, called when the update is applied, at the server's
parameters then. Two plug-ins are built in:

* :class:`Gradient` (the default): the minibatch gradient at the parameters
  read, with the inputs the transformation requests (variance reduction:
  SVRG's snapshot gradients, SAGA's per-example terms), computed on the
  same minibatches;
* :class:`LocalSteps`: ``H`` steps of a local optimizer from the parameters
  read, pushing the pseudo-gradient (local SGD, DiLoCo's inner loop).

A new kind of worker (one that generates its batch from the parameters it
read, an event-triggered push, a coded or compressed gradient) is a new
subclass of :class:`Worker` in a file of its own.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax._checks import check_bool, check_int
from delayjax.runtime import _engine as engine
from delayjax.runtime._local import local_pseudo_gradient

__all__ = ["Gradient", "LocalSteps", "UpdateContext", "Worker", "WorkerContext"]


class WorkerContext(NamedTuple):
  """What the runtime gives a worker plug-in for one contribution (inside the compiled step).

  Attributes:
    gradient: ``gradient(w, draw, terms=None) -> (loss, payload)``: the mean
      loss and payload over the contribution's minibatches of group ``draw``
      (an int32, or the Python int ``0`` for the first) at parameters ``w``.
      ``terms(w, batch, indices) -> (loss, summed, stacked)`` says what one
      minibatch gives: entries averaged over the group (``"grad"``, ...) and
      per-example entries (concatenated); default, the gradient alone.
    worker: the contribution's worker (int32 scalar).
    update: the update the contribution is for (int32 scalar).
    key: a PRNG key of the contribution's own
      (``_sampling.contribution_key``): the same whatever the lanes, chunks
      or devices, and apart from the minibatches' keys.
    value_and_grad: ``value_and_grad(w, batch) -> (loss, grad)``: the run's
      loss (aux dropped; float32) and its gradient at ``w`` on any batch, e.g.
      one the worker generated.
    minibatch: ``minibatch(b) -> (batch, indices)``: the contribution's
      ``b``-th minibatch of its first group, as ``dj.Sampling`` draws it.
    inputs: the names of the runtime inputs the transformation requests
      (``dj.runtime_inputs``; static).
    snapshot: SVRG's snapshot parameters when ``"snapshot_grad"`` or
      ``"sample_snapshot_grads"`` is requested, else ``()``.
  """

  gradient: Callable[..., tuple[jax.Array, dict[str, Any]]]
  worker: jax.Array
  update: jax.Array
  key: jax.Array
  value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]]
  minibatch: Callable[[Any], tuple[Any, jax.Array]]
  inputs: tuple[str, ...]
  snapshot: Any


class UpdateContext(NamedTuple):
  """What the runtime gives ``Worker.at_update`` for one contribution of an update (inside the compiled step).

  Attributes:
    worker: the contribution's worker (int32 scalar).
    update: the update being applied (int32 scalar).
    staleness: the contribution's staleness, ``update`` minus the version it
      read (int32; with per-leaf delays, its first leaf group's).
    key: a PRNG key of the contribution's own, apart from its push's.
    value_and_grad: as :attr:`WorkerContext.value_and_grad`.
  """

  worker: jax.Array
  update: jax.Array
  staleness: jax.Array
  key: jax.Array
  value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]]


class Worker(abc.ABC):
  """A worker plug-in: what one contribution of a worker that read some parameters is (module docstring)."""

  #: Whether a worker's contributions are computed one after another, each starting from the state the
  #: previous one left (``init_state``); the planner then never puts two of one worker's in one step.
  sequential: bool = False

  def bind(self, num_workers: int, padded_workers: int) -> "Worker":
    """This plug-in checked against a schedule of ``num_workers`` workers, padded with idle ones to
    ``padded_workers`` (a multiple of the devices); raises naming what is wrong. The runtime uses what it
    returns."""
    return self

  #: ``None``, or int64 ``[padded workers]``: the minibatch groups each worker's contribution evaluates
  #: (local steps), which the planner weighs as its cost. Set by ``bind``.
  local_steps: np.ndarray | None = None

  def init_state(self, params: Any) -> Any:
    """One worker's initial own state (``()``: none)."""
    return ()

  @abc.abstractmethod
  def contribute(self, ctx: WorkerContext, read: Any, state: Any) -> tuple[jax.Array, dict[str, Any], Any]:
    """``(loss, payload, state)`` of one contribution (traced; one lane of a ``vmap``)."""

  def identity(self) -> dict[str, Any]:
    """What of this plug-in changes the run's numbers, for the run's identity and the compile cache: plain
    values, and ``"functions"``, the transformations or functions whose traced programs count."""
    return {}

  def requests_allowed(self) -> bool:
    """Whether the transformation may request per-contribution runtime inputs (SVRG, SAGA) with it."""
    return True

  def at_update(self, ctx: UpdateContext, params: Any, payload: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    """The learner's side of a contribution: ``(loss, payload)`` at the server ``params`` the update is
    applied to, from the ``payload`` the contribution pushed (traced).

    Only a plug-in that pushes data rather than a gradient overrides it (e.g.
    rollouts generated at the parameters read, whose gradient the learner
    takes at its current parameters); what it returns must hold ``"grad"``,
    shaped like ``params``. The default is never called.
    """
    raise NotImplementedError

  @property
  def learns_at_update(self) -> bool:
    """Whether the runtime calls :meth:`at_update` (the plug-in overrides it)."""
    return type(self).at_update is not Worker.at_update

  def payload_like(self, params: Any, inputs: tuple[str, ...], samples: int, terms: Any) -> dict[str, Any] | None:
    """The shapes (``jax.ShapeDtypeStruct``) of one contribution's payload, or ``None`` for the runtime to
    trace ``contribute`` for them. ``samples``: the examples a contribution draws; ``terms``: one example's
    ``sample_terms`` output shapes."""
    return None


@dataclasses.dataclass(frozen=True)
class Gradient(Worker):
  """The default worker: the mean minibatch gradient at the parameters it read.

  .. math::
    g_{u,m} = \\frac{1}{n_{u,m}} \\sum_{b < n_{u,m}} \\nabla \\ell(\\tilde w_{u,m}; \\xi_{u,m,b})

  with the inputs the transformation requests through
  ``dj.runtime_inputs`` computed beside it on the same minibatches:
  SVRG's ``snapshot_grad`` (the same minibatches at the epoch's snapshot),
  SAGA's per-example ``sample_grads`` and ``sample_indices``, HSAG's
  per-example ``sample_snapshot_grads`` (at the snapshot), and
  ``sample_scalars``/``sample_features`` from ``sample_terms``.

  Args:
    snapshot_every: SVRG's epoch length :math:`E` in updates; default
      :math:`\\lceil 2N / \\text{batch\\_size} \\rceil` (Johnson & Zhang's
      :math:`m = 2n`). Only when ``tx`` requests ``full_grad`` (``dj.svrg``).
    full_batch_size: compute SVRG's full gradient over chunks of this many
      examples (``lax.map``) to bound its memory; default all at once. Only
      with ``full_grad``.
    sample_terms: ``sample_terms(params, batch) -> (scalars [b], features)``
      with :math:`\\nabla f_i = s_i a_i`; required when ``tx`` requests
      ``sample_scalars`` (``dj.saga(table="scalars")``, ``dj.prox_asaga``),
      and only then.
  """

  snapshot_every: int | None = None
  full_batch_size: int | None = None
  sample_terms: Callable[[Any, Any], tuple[Any, Any]] | None = None

  def __post_init__(self):
    for name in ("snapshot_every", "full_batch_size"):
      value = getattr(self, name)
      if value is not None:
        object.__setattr__(self, name, check_int(f"Gradient.{name}", value, minimum=1))
    if self.sample_terms is not None and not callable(self.sample_terms):
      raise TypeError(f"Gradient.sample_terms must be callable or None, got {type(self.sample_terms).__name__}.")

  def contribute(self, ctx, read, state):
    loss, payload = ctx.gradient(read, 0, self._terms(ctx))
    return loss, payload, ()

  def _terms(self, ctx: WorkerContext) -> Callable[..., Any] | None:
    """One minibatch's gradient and the inputs the transformation requested (``None``: the gradient alone)."""
    inputs = ctx.inputs
    if not any(name in inputs for name in ("snapshot_grad", "sample_grads", "sample_scalars", "sample_indices",
                                           "sample_snapshot_grads")):
      return None

    def grad(w, batch):
      return ctx.value_and_grad(w, batch)[1]

    def terms(w, batch, idx):
      loss, g = ctx.value_and_grad(w, batch)
      summed, stacked = {"grad": g}, {}
      if "snapshot_grad" in inputs:
        # The same minibatch at the snapshot: g_B(w_read) - g_B(w_snap) + mu stays unbiased.
        summed["snapshot_grad"] = grad(ctx.snapshot, batch)
      if "sample_grads" in inputs:
        # Each example as a batch of one: f_i is the loss on example i alone.
        stacked["sample_grads"] = jax.vmap(lambda ex: grad(w, jax.tree.map(lambda x: x[None], ex)))(batch)
      if "sample_snapshot_grads" in inputs:
        # dj.hsag: each example at the snapshot, for the anchors of the examples outside its SAGA set.
        stacked["sample_snapshot_grads"] = jax.vmap(
            lambda ex: grad(ctx.snapshot, jax.tree.map(lambda x: x[None], ex)))(batch)
      if "sample_scalars" in inputs:
        stacked["sample_scalars"], stacked["sample_features"] = self.sample_terms(w, batch)
      if "sample_indices" in inputs:
        stacked["sample_indices"] = idx.astype(jnp.int32)
      return loss, summed, stacked

    return terms

  def payload_like(self, params, inputs, samples, terms):
    like = engine.shapes
    out = {"grad": like(params, ())}
    if "snapshot_grad" in inputs:
      out["snapshot_grad"] = like(params, ())
    if "sample_grads" in inputs:
      out["sample_grads"] = like(params, (samples,))
    if "sample_snapshot_grads" in inputs:
      out["sample_snapshot_grads"] = like(params, (samples,))
    if "sample_scalars" in inputs:
      out["sample_scalars"], out["sample_features"] = like(tuple(terms), (samples,))
    if "sample_indices" in inputs:
      out["sample_indices"] = jax.ShapeDtypeStruct((samples,), np.int32)
      out["sample_valid"] = jax.ShapeDtypeStruct((samples,), np.bool_)
    return out

  def identity(self):
    return {"functions": {} if self.sample_terms is None else {"sample_terms": self.sample_terms}}


@dataclasses.dataclass(frozen=True)
class LocalSteps(Worker):
  """Local-SGD workers (DiLoCo-style): ``H`` local optimizer steps from the parameters read.

  A contribution starts from :math:`w^{(0)} = \\tilde w_{u,m}` and takes
  :math:`H_m` steps :math:`w^{(h+1)} = w^{(h)} + d_h`, :math:`d_h` being
  ``optimizer``'s update for the mean of :math:`n_{u,m}` fresh minibatch
  gradients at :math:`w^{(h)}` (step :math:`h` draws right after those of steps
  :math:`0 .. h - 1`); it pushes the pseudo-gradient
  :math:`g_{u,m} = -(d_0 + \\dots + d_{H_m - 1})` (equal to
  :math:`\\tilde w_{u,m} - w^{(H_m)}` up to rounding; for :math:`H_m = 1`
  exactly :math:`-d_0`, so ``tx = optax.sgd(1.0)``, one worker and
  ``optimizer=optax.sgd(lr)`` is plain SGD, bit for bit). Lanes run
  :math:`\\max_m H_m` steps, masked beyond their own. ``tx`` is then the
  outer (server) optimizer, e.g. ``dj.delayed_nesterov``.

  Args:
    steps: :math:`H \\ge 1`, an int or one per worker (e.g.
      ``dj.runtime.dylu_local_steps``).
    optimizer: the workers' optimizer (e.g. ``optax.sgd(0.1)``), given no
      extra arguments.
    keep_state: each worker keeps its optimizer state from one contribution
      to the next (as DiLoCo's inner AdamW moments), starting from
      ``optimizer.init(params)``; its contributions are then computed one
      after another. Default: a fresh state per contribution.

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023; Liu et al.,
    `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024.
  """

  steps: int | Sequence[int] | np.ndarray
  optimizer: optax.GradientTransformation
  keep_state: bool = False

  def __post_init__(self):
    if not isinstance(self.optimizer, optax.GradientTransformation):
      raise TypeError(
          f"LocalSteps.optimizer must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), got "
          f"{type(self.optimizer).__name__}.")
    check_bool("LocalSteps.keep_state", self.keep_state)
    if np.ndim(self.steps) == 0:
      check_int("LocalSteps.steps", self.steps, minimum=1)
    else:
      steps = tuple(check_int(f"LocalSteps.steps[{m}]", h, minimum=1) for m, h in enumerate(list(self.steps)))
      if not steps:
        raise ValueError("LocalSteps.steps must be an int or hold one entry per worker, got an empty sequence.")
      object.__setattr__(self, "steps", steps)
    object.__setattr__(self, "optimizer", optax.with_extra_args_support(self.optimizer))

  @property
  def sequential(self) -> bool:  # type: ignore[override]
    return self.keep_state

  def bind(self, num_workers, padded_workers):
    if np.ndim(self.steps) == 0:
      steps = np.full(num_workers, int(self.steps), np.int64)
    elif len(self.steps) != num_workers:
      raise ValueError(
          f"LocalSteps.steps must be an int or hold one entry per worker ({num_workers}), got "
          f"{len(self.steps)} entries.")
    else:
      steps = np.asarray(self.steps, np.int64)
    # Padding workers never contribute; one step keeps their masked lanes cheap.
    return _BoundLocalSteps(self, np.concatenate([steps, np.ones(padded_workers - num_workers, np.int64)]))

  def contribute(self, ctx, read, state):
    raise TypeError("LocalSteps contributes once bound to a schedule (LocalSteps.bind).")

  def identity(self):
    steps = self.steps if np.ndim(self.steps) == 0 else tuple(self.steps)
    return {"local_steps": steps, "keep_state": self.keep_state, "functions": {"local_optimizer": self.optimizer}}

  def requests_allowed(self):
    return False

  def payload_like(self, params, inputs, samples, terms):
    return {"grad": engine.shapes(params)}


class _BoundLocalSteps(Worker):
  """:class:`LocalSteps` bound to a schedule: its per-worker steps, padded, known (static)."""

  def __init__(self, spec: LocalSteps, local_steps: np.ndarray):
    self.spec, self.local_steps, self.optimizer = spec, local_steps, spec.optimizer
    self.sequential = spec.keep_state
    self.max_steps = int(local_steps.max())
    self.uniform = bool(np.all(local_steps == self.max_steps))

  def init_state(self, params):
    return self.spec.optimizer.init(params) if self.spec.keep_state else ()

  def contribute(self, ctx, read, state):
    def step_grad(w, h):
      loss, payload = ctx.gradient(w, h)
      return loss, payload["grad"]

    steps = self.max_steps if self.uniform else jnp.asarray(self.local_steps, jnp.int32)[ctx.worker]
    loss, pseudo, final = local_pseudo_gradient(step_grad, self.spec.optimizer, read, steps, self.max_steps,
                                                state=state if self.spec.keep_state else None)
    return loss, {"grad": pseudo}, final if self.spec.keep_state else ()

  def identity(self):
    return {**self.spec.identity(), "local_steps": tuple(self.local_steps.tolist())}

  def requests_allowed(self):
    return False

  def payload_like(self, params, inputs, samples, terms):
    return {"grad": engine.shapes(params)}


def check_worker(worker: Any) -> Worker:
  """``worker`` if it is a plug-in (``Gradient()`` for ``None``), or a ``TypeError`` naming the keyword."""
  if worker is None:
    return Gradient()
  if not isinstance(worker, Worker):
    raise TypeError(
        f"worker must be a dj.workers plug-in (dj.workers.Gradient(...), dj.workers.LocalSteps(...)) or None, "
        f"got {type(worker).__name__} {worker!r}.")
  return worker
