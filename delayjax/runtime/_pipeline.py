"""Pipeline-parallel training, exactly: per-stage forward and backward weight versions, and the runtime.

The model is a sequence of stage functions ``stage_k(params_k, h) -> h``
(stage 0 receives ``batch["x"]``) followed by ``loss_fn(h_K, batch)``.
In an asynchronous pipeline the forward pass of stage ``k`` runs at one
version of its weights, :math:`w^f_k`, and its backward pass at another,
:math:`w^b_k`. :func:`staged_value_and_grad` computes that gradient exactly:
the forward pass gives the activations

.. math::  h_{k+1} = f_k(w^f_k, h_k), \\qquad L = \\ell(h_K)

and the backward pass propagates the cotangent :math:`\\bar h_K = \\partial
\\ell / \\partial h_K` through each stage's vector-Jacobian product taken at its
backward weights and its forward input,

.. math::
  (g_k, \\bar h_k) = \\big(\\partial_w f_k(w^b_k, h_k)^\\top \\bar h_{k+1},\\;
                        \\partial_h f_k(w^b_k, h_k)^\\top \\bar h_{k+1}\\big),

as a stage does that keeps its input activation and recomputes its forward
pass at the weights it holds when the backward pass runs (PipeMare,
Diversely Stale Parameters); inside a stage everything is evaluated at
:math:`w^b_k`. This is ``backward="recompute"``.

``backward="stored"`` is PipeDream's asynchronous pipeline without weight
stashing: the backward pass runs on what the forward pass stored (every
activation inside the stage, computed at :math:`w^f_k`) and reads the
stage's weights, where the backward pass needs them, as they are when it
runs, :math:`w^b_k`. This is what reverse-mode autodiff does when the
optimizer updates the parameters in place between a micro-batch's forward
and backward pass, as PipeDream's runtime does (the authors' test
``runtime/tests/backprop/sgd_vanilla.py`` in ``msr-fiddle/pipedream``
shows the input gradient changing when ``optimizer.step()`` runs between
the two). The paper states it in words only (Narayanan et al.,
`PipeDream: Generalized Pipeline Parallelism for DNN Training
<https://doi.org/10.1145/3341301.3359646>`_, SOSP 2019, Section 3.3:
without stashing a stage's backward pass uses newer weights than its
forward pass, and the update is not the gradient of the loss at any one set
of weights; its text was not reachable here to quote), so the precise form
is taken from the authors' code. For a dense layer
:math:`a = \\sigma(z)`, :math:`z = h W + b` with incoming cotangent
:math:`\\bar a`:

.. math::
  \\delta = \\bar a \\odot \\sigma'(h W^f + b^f), \\qquad g_W = h^\\top \\delta, \\qquad
  g_b = \\textstyle\\sum \\delta, \\qquad \\bar h = \\delta\\, (W^b)^\\top,

so a layer's own weight gradient is that of its forward weights and the
staleness enters through the cotangent it passes back. It differs from
``"recompute"``, which evaluates :math:`\\sigma'` at :math:`h W^b + b^b`.
Which values count as weights: the backward pass reads at :math:`w^b` the
stage's parameter arrays that the forward pass saved for it as they are;
a value the forward computes from a parameter (``w.T``, ``w.astype(...)``)
is stored like any activation, at :math:`w^f` (as in PyTorch's autograd).

With :math:`w^b = w^f` both forms are the ordinary gradient (``jax.grad``),
and both are computed with ``jax.custom_vjp`` so they compose with ``jit``
and ``vmap``.

:func:`simulate_pipeline` trains on a ``dj.cluster.pipeline`` schedule: update
``u`` of stage ``k`` applies the mean of the gradients of mini-batch ``u``'s
micro-batches, each computed with the versions the schedule gives, through an
Optax transformation per stage.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from delayjax.cluster._pipeline import PipelineSchedule
from delayjax.runtime import _checkpoint
from delayjax.runtime import _engine as engine
from delayjax.runtime import _history as history_lib
from delayjax.runtime._arguments import batch_like, check_not_traced
from delayjax.runtime._options import (Checkpoint, Execution, Record, Runs, Sampling, runs_sources,
                                       runtime_options)
from delayjax.runtime._sampling import lane_examples
from delayjax.runtime._simulate import _all_finite, _check_run_params, _inexact, _run_states
from delayjax.transforms._pipeline_remedies import stage_read

StageFn = Callable[[Any, Any], Any]

STAGES = "stages"  # the mesh axis that holds one pipeline stage per device

_CHECKPOINT_FILE = "pipeline"

__all__ = ["staged_value_and_grad", "simulate_pipeline", "PipelineHistory", "PipelineResult"]


BACKWARD_FORMS = ("recompute", "stored")


def _stage_vjp(stage_fn: StageFn, backward: str) -> Callable[[Any, Any, Any, Any], tuple[Any, Any]]:
  """``vjp(forward_params, backward_params, h, cotangent) -> (grad_params, grad_h)`` of one stage, in the
  ``backward`` form of the module docstring."""
  if backward == "recompute":
    return lambda forward_params, backward_params, h, cotangent: jax.vjp(stage_fn, backward_params, h)[1](cotangent)

  def stored(forward_params, backward_params, h, cotangent):
    # The pullback's leaves are what the forward pass saved; those that are the forward weights themselves
    # are read at the backward weights instead, as a backward pass over parameters updated in place does.
    _, pullback = jax.vjp(stage_fn, forward_params, h)
    later = {id(f): b for f, b in zip(jax.tree.leaves(forward_params), jax.tree.leaves(backward_params), strict=True)}
    saved, treedef = jax.tree.flatten(pullback)
    return jax.tree.unflatten(treedef, [later.get(id(x), x) for x in saved])(cotangent)

  return stored


def _check_backward(backward: Any) -> str:
  if backward not in BACKWARD_FORMS:
    raise ValueError(f"backward must be one of {BACKWARD_FORMS}, got {backward!r}.")
  return backward


def _with_backward_params(stage_fn: StageFn, backward: str = "recompute") -> Callable[[Any, Any, Any], Any]:
  """``stage_fn(forward_params, h)`` whose VJP is the ``backward`` form at ``backward_params``, the cotangent
  going to ``forward_params``."""
  vjp = _stage_vjp(stage_fn, backward)

  @jax.custom_vjp
  def apply(forward_params, backward_params, h):
    del backward_params
    return stage_fn(forward_params, h)

  def fwd(forward_params, backward_params, h):
    kept = (backward_params, h) if backward == "recompute" else (forward_params, backward_params, h)
    return stage_fn(forward_params, h), kept

  def bwd(residuals, cotangent):
    forward_params, backward_params, h = (None,) + residuals if backward == "recompute" else residuals
    grad_params, grad_h = vjp(forward_params, backward_params, h, cotangent)
    return grad_params, jax.tree.map(jnp.zeros_like, backward_params), grad_h

  apply.defvjp(fwd, bwd)
  return apply


def _check_stages(stage_fns: Sequence[StageFn]) -> tuple[StageFn, ...]:
  stage_fns = tuple(stage_fns) if isinstance(stage_fns, (list, tuple)) else None
  if not stage_fns or not all(callable(f) for f in stage_fns):
    raise TypeError("stage_fns must be a non-empty list or tuple of functions stage_k(params_k, h) -> h.")
  return stage_fns


def _check_stage_params(name: str, params: Any, num_stages: int) -> tuple[Any, ...]:
  if not isinstance(params, (list, tuple)) or len(params) != num_stages:
    got = f"a sequence of length {len(params)}" if isinstance(params, (list, tuple)) else type(params).__name__
    raise ValueError(f"{name} must be a list or tuple with one parameter tree per stage ({num_stages}), got {got}.")
  return tuple(params)


def staged_value_and_grad(stage_fns: Sequence[StageFn], loss_fn: Callable[[Any, Any], jax.Array], *,
                          backward: str = "recompute"
                          ) -> Callable[[Sequence[Any], Sequence[Any], Any], tuple[jax.Array, tuple[Any, ...]]]:
  """The loss and per-stage gradients with each stage's forward and backward pass at its own weights.

  Args:
    stage_fns: ``K`` functions ``stage_k(params_k, h) -> h``; stage 0 gets
      ``batch["x"]``.
    loss_fn: ``loss_fn(h_K, batch) -> scalar``.
    backward: ``"recompute"`` (the stage recomputes its forward pass at its
      backward weights) or ``"stored"`` (PipeDream without weight stashing:
      the forward pass's stored activations with the backward weights); see
      the module docstring.

  Returns:
    ``fn(forward_params, backward_params, batch) -> (loss, grads)``, with
    ``forward_params`` and ``backward_params`` sequences of ``K`` parameter
    trees, ``loss`` computed with the forward weights and ``grads`` a tuple of
    ``K`` trees: the gradient defined in the module docstring.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> import delayjax as dj
    >>> stages = [lambda w, h: jnp.tanh(h @ w), lambda w, h: h @ w]
    >>> loss = lambda h, batch: jnp.mean((h - batch["y"]) ** 2)
    >>> fn = dj.staged_value_and_grad(stages, loss)
    >>> w = [jnp.ones((3, 4)) * 0.1, jnp.ones((4, 1)) * 0.2]
    >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.zeros((2, 1))}
    >>> _, grads = fn(w, w, batch)  # equal versions: the ordinary gradient
    >>> bool(jnp.allclose(grads[0], jax.grad(lambda w: loss(stages[1](w[1], stages[0](w[0], batch["x"])),
    ...                                                      batch))(w)[0]))
    True
  """
  stage_fns = _check_stages(stage_fns)
  backward = _check_backward(backward)
  stages = tuple(_with_backward_params(f, backward) for f in stage_fns)

  def total(forward_params, backward_params, batch):
    h = batch["x"]
    for stage, fp, bp in zip(stages, forward_params, backward_params):
      h = stage(fp, bp, h)
    return loss_fn(h, batch)

  grad_fn = jax.value_and_grad(total)

  def value_and_grad(forward_params, backward_params, batch):
    forward_params = _check_stage_params("forward_params", forward_params, len(stages))
    backward_params = _check_stage_params("backward_params", backward_params, len(stages))
    loss, grads = grad_fn(forward_params, backward_params, batch)
    return loss, tuple(grads)

  return value_and_grad


class PipelineHistory(NamedTuple):
  """What happened during :func:`simulate_pipeline` (NumPy arrays on the host).

  Attributes:
    update: int64 ``[U]``, the update index.
    time: float64 ``[U]``, simulated seconds when every stage had applied it.
    loss: float32 ``[U]``, the mean loss of the update's micro-batches (with
      their forward weights).
    forward_staleness: int64 ``[U, K]``, per stage the largest staleness of
      the update's forward passes; ``backward_staleness`` likewise.
    eval_update, eval_time: int64 / float64 ``[E]``, the version each
      evaluation was made at (0, every ``eval_every``-th, the last) and its time.
    eval_metrics: ``eval_fn``'s output with a leading ``[E]`` axis, or ``None``.
    nonfinite: int64 ``[n, 2]``, ``(update, stage)`` of every stage gradient
      that was not finite, sorted.
    nonfinite_state: ``(first, last)``, the updates of the first chunk after
      which some stage's weights or optimizer state were not finite, or ``None``.

  With ``record=dj.Record(history="evaluations")`` the five per-update
  fields are empty (length 0, their dtypes; the staleness ``[0, K]``): the
  host keeps, and a checkpoint stores, only the evaluations.
  """

  update: np.ndarray
  time: np.ndarray
  loss: np.ndarray
  forward_staleness: np.ndarray
  backward_staleness: np.ndarray
  eval_update: np.ndarray
  eval_time: np.ndarray
  eval_metrics: Any
  nonfinite: np.ndarray
  nonfinite_state: tuple[int, int] | None


class PipelineResult(NamedTuple):
  """The outcome of :func:`simulate_pipeline`: per-stage parameters and optimizer states, and the history."""

  params: tuple[Any, ...]
  opt_states: tuple[Any, ...]
  history: PipelineHistory


class _Packing:
  """One tree per stage (structures, shapes and dtypes may differ), each as one flat vector per dtype.

  Stage ``k``'s leaves of dtype ``d`` are raveled and concatenated in tree
  order and padded with zeros to the widest stage's length, so the stages
  stack on a leading axis that a mesh splits, one stage per device. Unpacking
  restores each leaf's shape, so a stage computes on its own arrays, with
  the same arithmetic as unpacked.
  """

  def __init__(self, trees: Sequence[Any]):
    self._defs, self._slots, widths = [], [], {}
    for tree in trees:
      leaves, treedef = jax.tree.flatten(tree)
      used: dict[str, int] = {}
      slots = []
      for leaf in leaves:
        dtype, shape = np.dtype(leaf.dtype).name, tuple(np.shape(leaf))
        slots.append((dtype, used.get(dtype, 0), shape))
        used[dtype] = used.get(dtype, 0) + int(np.prod(shape, dtype=np.int64))
      for dtype, n in used.items():
        widths[dtype] = max(widths.get(dtype, 0), n)
      self._defs.append(treedef)
      self._slots.append(slots)
    self.widths = dict(sorted(widths.items()))

  def pack(self, k: int, tree: Any, lead: tuple[int, ...] = ()) -> dict[str, Any]:
    """Stage ``k``'s ``tree`` (its leaves with leading axes ``lead``) as ``{dtype: [*lead, width]}``."""
    groups: dict[str, list[Any]] = {d: [] for d in self.widths}
    for leaf, (dtype, _, _) in zip(jax.tree.leaves(tree), self._slots[k], strict=True):
      groups[dtype].append(jnp.reshape(leaf, lead + (-1,)))
    packed = {}
    for dtype, width in self.widths.items():
      used = sum(int(x.shape[-1]) for x in groups[dtype])
      packed[dtype] = jnp.concatenate(groups[dtype] + [jnp.zeros(lead + (width - used,), dtype)], axis=-1)
    return packed

  def unpack(self, k: int, packed: dict[str, Any]) -> Any:
    """Stage ``k``'s tree from its packed vectors (any leading axes they have)."""
    leaves = []
    for dtype, offset, shape in self._slots[k]:
      x = packed[dtype]
      size = int(np.prod(shape, dtype=np.int64))
      leaves.append(jnp.reshape(x[..., offset:offset + size], x.shape[:-1] + shape))
    return jax.tree.unflatten(self._defs[k], leaves)

  def stack(self, trees: Sequence[Any], lead: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Every stage's tree packed, stacked on a leading stage axis (host arrays)."""
    packed = [self.pack(k, tree, lead) for k, tree in enumerate(trees)]
    return {d: np.stack([np.asarray(p[d]) for p in packed]) for d in self.widths}


def _check_stage_shapes(stage_fns: Sequence[StageFn], loss_fn: Callable[..., Any], params: Sequence[Any],
                        data: Any, batch_size: int) -> None:
  """Traces the stages in order on one micro-batch's shapes (``jax.eval_shape``: nothing computed) and refuses,
  naming the stage and the shapes it was given, stages that do not compose (an activation may be any pytree
  of arrays the next stage takes)."""
  def described(tree):
    return jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)

  batch = batch_like(data, batch_size)
  h = batch["x"]
  for k, (f, p) in enumerate(zip(stage_fns, params)):
    try:
      h = jax.eval_shape(f, p, h)
    except (TypeError, ValueError) as e:
      raise ValueError(
          f"stage_fns[{k}] fails on its input {described(h)} (stage 0 gets data['x'], stage k the output of stage "
          f"k - 1): {e}") from None
  try:
    loss = jax.eval_shape(loss_fn, h, batch)
  except (TypeError, ValueError) as e:
    raise ValueError(f"loss_fn fails on the last stage's output {described(h)}: {e}") from None
  if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == () and jnp.issubdtype(loss.dtype, jnp.floating)):
    raise ValueError(f"loss_fn(h_K, batch) must return a real scalar; got {jax.tree.map(lambda a: a.shape, loss)}.")


def _stage_inputs(stage_fns: Sequence[StageFn], params: Sequence[Any], batch_like: Any) -> list[Any]:
  """The shapes of each stage's input for one update's micro-batches (``batch_like``: ``[m, B, ...]``)."""

  def inputs(batch):
    h, out = batch["x"], []
    for f, p in zip(stage_fns, params):
      out.append(h)
      h = jax.vmap(functools.partial(f, p))(h)
    return out

  return jax.eval_shape(inputs, batch_like)


def _stage_step(stage_fns: Sequence[StageFn], loss_fn: Callable[[Any, Any], jax.Array], packing: _Packing,
                state_packing: _Packing, activation_packing: _Packing | None, reads: Callable[..., Any],
                update_stage: Callable[..., Any], evaluate: Callable[..., Any] | None, depth: int, backward: str
                ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """One update with one stage per device on the ``stages`` axis (run inside ``shard_map``).

  Device ``k`` holds stage ``k``'s ring of versions, directions and
  optimizer state. The update's micro-batches go through the stages in
  ``K - 1`` forward hops: stage ``k`` reads its forward weights, keeps its
  input and sends its output to stage ``k + 1`` (``lax.ppermute``); the last
  stage computes the loss and its backward pass, and ``K - 1`` backward hops
  send each cotangent to the stage before, which applies its VJP at its
  backward weights to the input it kept. Each stage then updates its own
  weights. These are the operations of :func:`staged_value_and_grad`, one
  stage at a time, so the numbers are those of one device.
  """
  K = len(stage_fns)
  forward_perm = [(k, k + 1) for k in range(K - 1)]
  backward_perm = [(k + 1, k) for k in range(K - 1)]

  def vjp(f):
    return jax.vmap(_stage_vjp(f, backward))

  def step(carry, tab, constants):
    hist, dirs, states = (jax.tree.map(lambda a: a[0], part) for part in carry)
    u, fv, bv, valid = tab["update"], tab["forward"], tab["backward"], tab["valid"]
    stage = jax.lax.axis_index(STAGES)
    batch = jax.tree.map(lambda a: a[tab["indices"]], constants)

    def weights(k):
      return reads(k, packing.unpack(k, hist), packing.unpack(k, dirs) if dirs else None, u, fv[:, k], bv[:, k])

    def stage_input(k, received):
      return batch["x"] if k == 0 else activation_packing.unpack(k - 1, received)

    act = {} if activation_packing is None else {
        d: jnp.zeros((w,), d) for d, w in activation_packing.widths.items()}
    kept = act
    # A cond on the device's stage: only stage k's device computes hop k.
    for k in range(K - 1):
      def forward(received, kept, k=k):
        out = jax.vmap(stage_fns[k])(weights(k)[0], stage_input(k, received))
        return activation_packing.pack(k, out), received
      act, kept = jax.lax.cond(stage == k, forward, lambda r, kp: (r, kp), act, kept)
      act = jax.lax.ppermute(act, STAGES, forward_perm)

    no_grad = {d: jnp.zeros((w,), d) for d, w in packing.widths.items()}

    def last(received):
      fps, bps = weights(K - 1)
      h = stage_input(K - 1, received)
      out = jax.vmap(stage_fns[K - 1])(fps, h)
      losses, cotangent = jax.vmap(jax.value_and_grad(loss_fn))(out, batch)
      g, ct = vjp(stage_fns[K - 1])(fps, bps, h, cotangent)
      sent = received if K == 1 else activation_packing.pack(K - 2, ct)
      return jnp.mean(losses).astype(jnp.float32), packing.pack(K - 1, jax.tree.map(lambda x: jnp.mean(x, axis=0), g)), sent

    loss, grad, act = jax.lax.cond(stage == K - 1, last,
                                   lambda r: (jnp.zeros([], jnp.float32), no_grad, r), act)
    for k in reversed(range(K - 1)):
      act = jax.lax.ppermute(act, STAGES, backward_perm)

      def backward(received, grad, k=k):
        h = stage_input(k, kept)
        g, ct = vjp(stage_fns[k])(*weights(k), h, activation_packing.unpack(k, received))
        sent = received if k == 0 else activation_packing.pack(k - 1, ct)
        return sent, packing.pack(k, jax.tree.map(lambda x: jnp.mean(x, axis=0), g))

      act, grad = jax.lax.cond(stage == k, backward, lambda r, g: (r, g), act, grad)

    def update(k):
      def apply(hist, dirs, states, grad):
        new_hist, new_dirs, new_states = update_stage(
            k, packing.unpack(k, hist), packing.unpack(k, dirs) if dirs else None, state_packing.unpack(k, states),
            packing.unpack(k, grad), u, fv[0, k], bv[0, k], valid)
        return (packing.pack(k, new_hist, (depth,)), {} if new_dirs is None else packing.pack(k, new_dirs, (depth,)),
                state_packing.pack(k, new_states))
      return apply

    hist, dirs, states = jax.lax.switch(stage, [update(k) for k in range(K)], hist, dirs, states, grad)
    # Only the last stage has the loss; the others add exact zeros.
    out = {"loss": jax.lax.psum(jnp.where(stage == K - 1, loss, 0.0), STAGES),
           # Each device's own stage gradient: finite or not, gathered in stage order.
           "finite": jax.lax.all_gather(_all_finite(_inexact(grad)), STAGES)}
    if evaluate is not None:
      def params_of():
        current = {d: jax.lax.all_gather(a[(u + 1) % depth], STAGES) for d, a in hist.items()}
        return tuple(packing.unpack(k, {d: a[k] for d, a in current.items()}) for k in range(K))
      out["metrics"] = evaluate(tab["eval"] & valid, params_of)
    return tuple(jax.tree.map(lambda a: a[None], part) for part in (hist, dirs, states)), out

  return step


def _micro_indices(seed: int, updates: np.ndarray, *, num_microbatches: int, num_examples: int,
                   batch_size: int) -> np.ndarray:
  """int32 ``[len(updates), m, B]``: micro-batch ``j`` of update ``u`` draws ``minibatch_indices(seed, u, j, 0)``,
  drawn on the host by ``_sampling.lane_examples`` (micro-batch ``j`` the lane of worker ``j``), whose one compiled
  draw per batch size every runtime shares."""
  shape = (len(updates), num_microbatches)
  first = np.zeros(shape, np.int32)  # every micro-batch is its lane's draw 0
  return lane_examples(np.ones(shape, bool), first, np.broadcast_to(np.arange(num_microbatches, dtype=np.int32), shape),
                       1, seed=seed, num_examples=num_examples, batch_size=batch_size, sampling="iid",
                       shard_rows=np.zeros((num_microbatches, 1), np.int32),
                       shard_sizes=np.ones(num_microbatches, np.int32),
                       update=np.broadcast_to(np.asarray(updates, np.int32)[:, None], shape))[:, :, 0]


def _leading(tree: Any, depth: int) -> Any:
  return jax.tree.map(lambda x: jnp.zeros((depth,) + jnp.shape(x), jnp.result_type(x)).at[0].set(x), tree)


def _fingerprint(schedule: PipelineSchedule, stage_fns: Sequence[StageFn], loss_fn: Callable[..., Any],
                 eval_fn: Any, params: Sequence[Any], tx: Any, opt_state: Any, data: Any, batch_size: int,
                 **options: Any) -> dict[str, str]:
  """The run's identity, by component (``_engine.identity``): what a checkpoint must match to be resumed."""
  first = params[0]
  # One micro-batch, as the runtime's step sees it: [1, B, ...].
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, batch_size) + a.shape[1:], a.dtype), data)
  inputs = _stage_inputs(stage_fns, params, batch)

  def stages(ps, hs):
    return [jax.vmap(functools.partial(f, p))(h) for f, p, h in zip(stage_fns, ps, hs)]

  output = jax.eval_shape(stages, tuple(params), inputs)[-1]
  programs = {
      # The traced programs carry the hyper-parameters (a learning rate is a literal in them).
      "tx": (lambda g, s, p: tx.update(g, s, p, staleness=jnp.int32(0), backward_staleness=jnp.int32(0),
                                       stale_params=p), (first, opt_state, first)),
      "stage_fns": (stages, (tuple(params), inputs)),
      "loss_fn": (jax.vmap(loss_fn), (output, batch)),
  }
  if eval_fn is not None:
    programs["eval_fn"] = (eval_fn, (tuple(params),))
  return engine.identity(
      schedule=_checkpoint.digest(schedule.forward_version, schedule.backward_version), options=options,
      params=tuple(params), data=data, programs=programs)


def simulate_pipeline(
    stage_fns: Sequence[StageFn],
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    params: Sequence[Any],
    data: Any,
    schedule: PipelineSchedule,
    *,
    seed: int | Runs = 0,
    sampling: Sampling | None = None,
    record: Record | None = None,
    checkpoint: Checkpoint | None = None,
    execution: Execution | None = None,
    backward: str = "recompute",
) -> PipelineResult | list[PipelineResult]:
  r"""Trains a staged model on a pipeline schedule, each pass at the weight version the schedule gives.

  Update ``u`` of stage ``k``:

  .. math::
    g_k = \frac{1}{m} \sum_{n \in u} g_k\big(w^f_{n}, w^b_{n}; \xi_n\big), \qquad
    (\Delta_k, s_k) = \mathrm{tx.update}(g_k, s_k, w_k^{(u)}), \qquad w_k^{(u+1)} = w_k^{(u)} + \Delta_k

  where micro-batch ``n`` reads, at each stage ``j``, the forward weights
  of version ``schedule.forward_version[n, j]`` and the backward weights of
  version ``schedule.backward_version[n, j]`` (:func:`staged_value_and_grad`),
  on the minibatch ``xi_n`` of ``batch_size`` examples drawn i.i.d. by
  ``dj.runtime.minibatch_indices(seed, u, j_n, 0)`` (``j_n`` the micro-batch's
  place in its mini-batch). Each stage has its own optimizer state
  ``tx.init(params[k])`` and receives the extra arguments ``staleness`` (the
  largest forward staleness of its micro-batches in the update),
  ``backward_staleness`` and ``stale_params`` (the forward weights of the
  update's first micro-batch, the stalest). A transformation whose state
  defines pipeline reads (``dj.spectrain``, ``dj.pipemare``; see
  ``dj.transforms.stage_read``) changes the weights the passes read: a pass
  at version ``v`` reads :math:`w_v - s\, d_v`, with the state's direction
  :math:`d_v` stored with version ``v`` and its steps ``s``.

  The run goes through the runtimes' engine (``delayjax.runtime._engine``):
  ``Execution.chunk_size`` updates per compiled ``lax.scan``, a checkpoint
  after every chunk or fewer (``Checkpoint.min_interval``; a restarted run
  resumes from it, bit for bit), the
  callback after every chunk, and the non-finite report: an update whose
  gradient of some stage is not finite is listed in ``history.nonfinite``
  (``(update, stage)`` rows), non-finite weights or optimizer states in
  ``history.nonfinite_state``, and a ``RuntimeWarning`` names the first. Each
  stage keeps its versions in a ring of ``D`` slots, ``D - 1`` the largest
  staleness the schedule holds.

  With a ``mesh`` that has a ``stages`` axis of ``K`` devices, device ``k``
  holds stage ``k``'s ring of versions (its weight stash), its read
  directions and its optimizer state, and nothing of the other stages (the
  stages, of different shapes, are packed into one padded vector per dtype).
  An update's micro-batches then cross the stages as in a pipeline: each
  device runs its stage's forward pass at the forward versions and sends the
  activations to the next stage with ``lax.ppermute``; the last stage
  computes the loss and the backward passes go back the same way, each at its
  stage's backward version on the input the stage kept; every device updates
  its own stage. The operations are those of one device, but the per-stage
  programs are compiled apart, and XLA may fuse a stage's or an optimizer's
  multiply-adds differently: a linear model under plain SGD is the same bit
  for bit, while nonlinear stages, momentum, Nesterov and SpecTrain's and
  PipeMare's reads agree to a relative error of a few 1e-7
  (``tests/runtime/test_device_count.py``, ``tests/pipeline/test_pipeline_mesh.py``). A checkpoint of this layout resumes only under
  such a mesh.

  Args:
    stage_fns: ``K`` stage functions, one per model stage of the schedule
      (``num_stages * virtual_stages``); stage 0 receives ``batch["x"]``.
    loss_fn: ``loss_fn(h_K, batch) -> scalar``.
    tx: the per-stage optimizer. It receives ``staleness``,
      ``backward_staleness`` and ``stale_params``; one that needs another
      extra argument (``worker``) is refused.
    params: ``K`` parameter trees.
    data: a dict of arrays with a leading example axis, holding ``"x"``.
    schedule: a ``dj.cluster.pipeline`` schedule with ``K`` model stages.
      A split backward pass (``"zb-h1"``) reads one version in both halves,
      so its weight gradient is that of the backward pass at that version; a
      schedule whose halves read different versions is refused.
    seed: seeds the minibatches, an int in ``[0, 2**32)``, or ``dj.Runs(...)``
      (several runs, below).
    sampling: ``dj.Sampling``: ``batch_size`` examples per micro-batch,
      drawn ``"iid"`` (the only scheme here).
    record: ``dj.Record``: ``eval_fn(params)`` on the tuple of stage
      parameters at version 0, every ``every`` updates and at the end;
      ``history="updates"`` keeps a row per update (``update``, ``time``,
      ``loss``, the staleness). Non-finite values are reported;
      ``nonfinite="skip"`` is not defined for pipelines.
    checkpoint: ``dj.Checkpoint``, or ``None``.
    execution: ``dj.Execution``: ``mesh`` (``None``, or a mesh whose
      ``stages`` axis has ``K`` devices: one stage per device), ``chunk_size``
      (default ``min(U, 256)``), ``max_memory``.
    backward: how a backward pass at other weights than its forward pass is
      computed: ``"recompute"`` or ``"stored"`` (PipeDream's 1F1B without
      weight stashing); see the module docstring. Equal when the versions are
      (GPipe, stashing).

  Several runs (``seed=dj.Runs(seeds=..., sources=..., params=..., hyperparams=...)``): run ``r`` has its own
  seed, schedule (``Runs.sources[r]``, every one with the call's number of model stages, and ``schedule=None``),
  initial stage parameters and ``inject_hyperparams`` values (set in every stage's optimizer state). Each run is
  computed by a call of its own of the single run's compiled chunk (runs whose steps trace alike share it), chunk
  by chunk beside the others, on a CPU several at a time, and equals its single call bit for bit. One device; with
  ``checkpoint``, each run is checkpointed on its own (``pipeline-run{r}``) and a call that finds them resumes each
  run where it was; ``Record.callback`` is told each run's chunks apart (``info["run"]``).

  Returns:
    A :class:`PipelineResult` (on the host's default device, also with a mesh); with ``seed=dj.Runs(...)``, a
    list of them, one per run.
  """
  if isinstance(seed, Runs):
    return _simulate_runs(stage_fns, loss_fn, tx, params, data, schedule, seed, sampling=sampling, record=record,
                          checkpoint=checkpoint, execution=execution, backward=backward)
  run = _prepare(stage_fns, loss_fn, tx, params, data, schedule, seed=seed, sampling=sampling, record=record,
                 checkpoint=checkpoint, execution=execution, backward=backward)
  run.step, run.carry, run.carry_specs, run.params_at, run.current_params, run.state_packing = _stage_program(run)
  carry, records = engine.run(_program(run), mesh=run.mesh, checkpoint=run.checkpoint,
                              checkpoint_name=_CHECKPOINT_FILE, callback=run.callback)
  return _results(run, carry, records)


def _simulate_runs(stage_fns, loss_fn, tx, params, data, schedule, runs: Runs, *, sampling, record, checkpoint,
                   execution, backward) -> list[PipelineResult]:
  """``dj.simulate_pipeline`` of ``seed=dj.Runs(...)``: every run prepared as its own call, then computed side by
  side by ``engine.run_together``."""
  runtime = "dj.simulate_pipeline"
  _, _, sampling, record, execution = runtime_options(runtime, seed=0, sampling=sampling, record=record,
                                                      execution=execution, no_effect=("lanes", "phases", "like"))
  sources = runs_sources(runs, schedule, execution)
  if runs.sources is not None:
    for i, source in enumerate(sources):
      if not isinstance(source, PipelineSchedule):
        raise TypeError(f"Runs.sources[{i}] must be a dj.cluster.pipeline(...) schedule, got "
                        f"{type(source).__name__}.")
      if source.num_model_stages != sources[0].num_model_stages:
        raise ValueError(f"Runs.sources[{i}] has {source.num_model_stages} model stages, but Runs.sources[0] has "
                         f"{sources[0].num_model_stages}: the runs share stage_fns.")
  own_params = ([params] * runs.num_runs if runs.params is None
                else [tuple(p) for p in _check_run_params(tuple(tuple(p) for p in runs.params), tuple(params))])

  def prepare(r):
    run = _prepare(stage_fns, loss_fn, tx, own_params[r], data, sources[r], seed=runs.seeds[r], sampling=sampling,
                   record=dataclasses.replace(record, callback=None), checkpoint=checkpoint, execution=execution,
                   backward=backward, hyperparams=(runs.hyperparams, r, runs.num_runs))
    run.step, run.carry, run.carry_specs, run.params_at, run.current_params, run.state_packing = _stage_program(run)
    return run

  prepared, done = engine.run_runs(runtime, runs.num_runs, prepare, _program, max_memory=execution.max_memory,
                                   hints=_MEMORY_HINTS, callback=record.callback, checkpoint_name=_CHECKPOINT_FILE)
  return [_results(run, carry, records) for run, (carry, records) in zip(prepared, done, strict=True)]


# What to change when a pipeline run's state does not fit the device, by memory term.
_MEMORY_HINTS = {
    "weight versions": "a schedule with less staleness (each stage keeps its last D versions) or a mesh with a "
                       "stage per device",
    "read directions": "a transformation without pipeline reads, or less staleness",
    "optimizer states": "a lighter optimizer or a mesh with a stage per device"}


class _PipelineRun(types.SimpleNamespace):
  """What one ``dj.simulate_pipeline`` call has checked and made (its locals), handed from phase to phase."""


def _prepare(stage_fns, loss_fn, tx, params, data, schedule, *, seed, sampling, record, checkpoint, execution,
             backward, hyperparams=None) -> _PipelineRun:
  """``dj.simulate_pipeline``'s arguments checked against the schedule, its weight rings sized and made
  (``hyperparams``: ``(Runs.hyperparams, r, R)`` for run ``r`` of ``R``, whose ``optax.inject_hyperparams``
  values every stage's optimizer state starts with)."""
  runtime = "dj.simulate_pipeline"
  check_not_traced(runtime, params=params, data=data)
  seed, _, sampling, record, execution = runtime_options(runtime, seed=seed, sampling=sampling, record=record,
                                                        execution=execution, no_effect=("lanes", "phases", "like"))
  if sampling.scheme != "iid":
    raise ValueError(f"{runtime} draws its micro-batches i.i.d.; got Sampling.scheme={sampling.scheme!r}.")
  mesh, chunk_size = execution.mesh, execution.chunk_size
  stage_fns = _check_stages(stage_fns)
  if not isinstance(schedule, PipelineSchedule):
    raise TypeError(f"schedule must be a dj.cluster.pipeline(...) schedule, got {type(schedule).__name__}.")
  K, m, U = schedule.num_model_stages, schedule.num_microbatches, schedule.num_updates
  if len(stage_fns) != K:
    raise ValueError(f"stage_fns has {len(stage_fns)} stages but the schedule has {K} model stages "
                     f"(num_stages={schedule.num_stages} x virtual_stages={schedule.virtual_stages}).")
  if not np.array_equal(schedule.weight_version, schedule.backward_version):
    # A split backward pass whose two halves read different versions: not computed here, so not silently wrong.
    raise ValueError(f"schedule's weight-gradient passes read other versions than its input-gradient passes "
                     f"(weight_version != backward_version); {runtime} computes a stage's weight gradient at its "
                     f"backward pass's version, as every dj.cluster.pipeline schedule does.")
  params = _check_stage_params("params", params, K)
  if mesh is not None:
    devices = engine.check_mesh(mesh, STAGES)
    if devices != K:
      raise ValueError(f"mesh's {STAGES!r} axis has {devices} devices but the schedule has {K} model stages "
                       f"(num_stages={schedule.num_stages} x virtual_stages={schedule.virtual_stages}); the runtime "
                       f"places one model stage per device.")
  batch_size = sampling.batch_size
  keep_updates = record.keeps_updates
  checkpoint = engine.checkpoint_arguments(checkpoint)
  checkpoint_dir = checkpoint.directory
  eval_fn, eval_every, callback = record.eval_fn, record.every, record.callback
  chunk_size = min(U, 256) if chunk_size is None else min(chunk_size, U)
  if not isinstance(data, dict) or "x" not in data:
    raise ValueError("data must be a dict of arrays with a leading example axis, holding the inputs under 'x'.")
  data = {k: np.asarray(v) for k, v in data.items()}
  num_examples = int(data["x"].shape[0])
  backward = _check_backward(backward)
  _check_stage_shapes(stage_fns, loss_fn, params, data, batch_size)
  value_and_grad = staged_value_and_grad(stage_fns, loss_fn, backward=backward)
  tx = optax.with_extra_args_support(tx)

  forward_version = schedule.forward_version.reshape(U, m, K).astype(np.int32)
  backward_version = schedule.backward_version.reshape(U, m, K).astype(np.int32)
  updates = np.arange(U)
  # Versions live in a ring of `depth` slots: the stalest read is depth - 1 versions back.
  depth = int(max((updates[:, None, None] - forward_version).max(),
                  (updates[:, None, None] - backward_version).max())) + 1
  opt_states = tuple(tx.init(p) for p in params)
  if hyperparams is not None and hyperparams[0]:
    values, r, num_runs = hyperparams
    opt_states = tuple(_run_states([state] * num_runs, values)[r] for state in opt_states)
  engine.check_extra_args(tx, params[0], opt_states[0], runtime, {
      "staleness": jnp.int32(0), "backward_staleness": jnp.int32(0), "stale_params": params[0]})
  readers = [stage_read(s) for s in opt_states]
  # Sized from shapes, before anything is allocated: a run too large for the device is refused, not killed.
  memory = engine.memory_terms({
      "weight versions": (engine.shapes(tuple(params), (depth,)), mesh is not None),
      "read directions": (tuple(() if r is None else engine.shapes(jax.eval_shape(r.read_direction), (depth,))
                                for r in readers), mesh is not None),
      "optimizer states": (opt_states, mesh is not None)}, data, K if mesh is not None else 1)
  engine.check_memory(runtime, memory, engine.memory_limit(execution.max_memory, mesh), _MEMORY_HINTS)
  history = tuple(_leading(p, depth) for p in params)
  directions = tuple(None if r is None else _leading(r.read_direction(), depth) for r in readers)
  eval_points = history_lib.eval_points(U, eval_every) if eval_fn is not None else np.zeros(0, np.int64)
  eval_flag = np.zeros(U, bool)
  eval_flag[eval_points[eval_points > 0] - 1] = True
  metric_shapes = jax.eval_shape(eval_fn, params) if eval_fn is not None else None
  num_chunks = -(-U // chunk_size)
  return _PipelineRun(**locals())


def _stage_program(run: _PipelineRun) -> tuple[Any, ...]:
  """The step of a prepared pipeline run, on one device or one stage per device, with its carry and how
  to read the parameters of a version back from it."""
  (K, backward, batch_size, data, depth, directions, eval_fn, history, loss_fn, m, mesh, metric_shapes,
   opt_states, params, readers, stage_fns, tx, value_and_grad) = (getattr(run, name) for name in (
       "K", "backward", "batch_size", "data", "depth", "directions", "eval_fn", "history", "loss_fn", "m",
       "mesh", "metric_shapes", "opt_states", "params", "readers", "stage_fns", "tx", "value_and_grad"))
  def read(hist, direction, reader, version, steps):
    w = jax.tree.map(lambda h: h[version % depth], hist)
    if reader is None:
      return w
    return jax.tree.map(lambda x, d: x - steps.astype(x.dtype) * d[version % depth], w, direction)

  def read_steps(k, u, fv, bv):
    zero = jnp.zeros(jnp.shape(fv), jnp.int32)
    return (zero, zero) if readers[k] is None else readers[k].read_steps(u, fv, bv)

  def current_params(hist, version):
    return tuple(jax.tree.map(lambda h: h[version % depth], h_k) for h_k in hist)

  def update_stage(k, hist_k, dirs_k, state_k, g, u, fv0, bv0, valid):
    """Stage ``k``'s update ``u`` from its mean gradient ``g``; the new version goes into the ring."""
    current = jax.tree.map(lambda h: h[u % depth], hist_k)
    stale = read(hist_k, dirs_k, readers[k], fv0, read_steps(k, u, fv0, bv0)[0])
    upd, state = tx.update(g, state_k, current, staleness=u - fv0, backward_staleness=u - bv0, stale_params=stale)
    new = optax.apply_updates(current, upd)
    reader = stage_read(state)
    slot = (u + 1) % depth
    # Padding steps (past the last update) change nothing: a where, not a cond, over the trees.
    keep = lambda old, x: jnp.where(valid, x, old)  # noqa: E731
    new_hist = jax.tree.map(lambda h, x: h.at[slot].set(keep(h[slot], x)), hist_k, new)
    new_dirs = None if reader is None else jax.tree.map(
        lambda h, x: h.at[slot].set(keep(h[slot], x)), dirs_k, reader.read_direction())
    return new_hist, new_dirs, jax.tree.map(keep, state_k, state)

  def evaluate(flag, params_of):
    # A cond, not a where: evaluation is costly and due only every eval_every updates.
    return jax.lax.cond(flag, lambda: eval_fn(params_of()),
                        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))

  def step(carry, tab, constants):
    hist, dirs, states = carry
    u, fv, bv, indices, valid = tab["update"], tab["forward"], tab["backward"], tab["indices"], tab["valid"]

    def micro(idx, fv_j, bv_j):
      fps, bps = [], []
      for k in range(K):
        sf, sb = read_steps(k, u, fv_j[k], bv_j[k])
        fps.append(read(hist[k], dirs[k], readers[k], fv_j[k], sf))
        bps.append(read(hist[k], dirs[k], readers[k], bv_j[k], sb))
      batch = jax.tree.map(lambda a: a[idx], constants)
      return value_and_grad(fps, bps, batch)

    losses, grads = jax.vmap(micro)(indices, fv, bv)
    new = [update_stage(k, hist[k], dirs[k], states[k], jax.tree.map(lambda x: jnp.mean(x, axis=0), grads[k]),
                        u, fv[0, k], bv[0, k], valid) for k in range(K)]
    new_carry = tuple(tuple(part) for part in zip(*new))
    out = {"loss": jnp.mean(losses), "finite": jnp.stack([_all_finite(_inexact(g)) for g in grads])}
    if eval_fn is not None:
      out["metrics"] = evaluate(tab["eval"] & valid, lambda: current_params(new_carry[0], u + 1))
    return new_carry, out

  if mesh is not None:
    # One stage per device on the `stages` axis: each stage's version ring, directions and optimizer state
    # are packed into one flat vector per dtype (stages differ in structure and shape), padded to the
    # widest stage, and split over the axis, so a device holds its own stage only.
    packing = _Packing(params)
    state_packing = _Packing(opt_states)
    batch_like = jax.tree.map(lambda a: jax.ShapeDtypeStruct((m, batch_size) + a.shape[1:], a.dtype), data)
    activation_packing = _Packing(_stage_inputs(stage_fns, params, batch_like)[1:]) if K > 1 else None
    carry = (packing.stack(history, (depth,)),
             packing.stack(directions, (depth,)) if readers[0] is not None else {},
             state_packing.stack(opt_states))

    def reads(k, hist_k, dirs_k, u, fv, bv):
      """Stage ``k``'s forward and backward weights for each micro-batch (versions ``fv``, ``bv``: ``[m]``)."""
      sf, sb = (jnp.broadcast_to(x, jnp.shape(fv)) for x in read_steps(k, u, fv, bv))
      one = lambda v, steps: read(hist_k, dirs_k, readers[k], v, steps)  # noqa: E731
      return jax.vmap(one)(fv, sf), jax.vmap(one)(bv, sb)

    step = _stage_step(stage_fns, loss_fn, packing, state_packing, activation_packing, reads, update_stage,
                       evaluate if eval_fn is not None else None, depth, backward)
    carry_specs = (P(STAGES),) * 3

    def params_at(hist, version):
      return tuple(packing.unpack(k, {d: engine.host(a)[k, version % depth] for d, a in hist.items()})
                   for k in range(K))
  else:
    carry, carry_specs, params_at = (history, directions, opt_states), (P(), P(), P()), current_params
  return step, carry, carry_specs, params_at, current_params, state_packing if mesh is not None else None


def _program(run: _PipelineRun) -> engine.Program:
  """The engine's program of a prepared pipeline run: its chunk tables, how outputs become rows, its step."""
  (U, backward, batch_size, carry, carry_specs, checkpoint_dir, chunk_size, data, depth, eval_flag, eval_fn,
   eval_points, forward_version, backward_version, keep_updates, loss_fn, m, mesh, metric_shapes, num_chunks,
   num_examples, opt_states, params, params_at, schedule, seed, stage_fns, step, tx, runtime) = (getattr(run, name) for name in (
       "U", "backward", "batch_size", "carry", "carry_specs", "checkpoint_dir", "chunk_size", "data", "depth",
       "eval_flag", "eval_fn", "eval_points", "forward_version", "backward_version", "keep_updates",
       "loss_fn", "m", "mesh", "metric_shapes", "num_chunks", "num_examples", "opt_states", "params",
       "params_at", "schedule", "seed", "stage_fns", "step", "tx", "runtime"))

  def tables(chunk: int) -> dict[str, np.ndarray]:
    lo, hi = chunk * chunk_size, min(U, (chunk + 1) * chunk_size)
    pad = chunk_size - (hi - lo)
    span = np.arange(lo, hi, dtype=np.int32)
    indices = _micro_indices(seed, span, num_microbatches=m, num_examples=num_examples, batch_size=batch_size)
    fill = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])  # noqa: E731
    return {"update": fill(span), "forward": fill(forward_version[lo:hi]), "backward": fill(backward_version[lo:hi]),
            "indices": fill(indices), "valid": fill(np.ones(hi - lo, bool)), "eval": fill(eval_flag[lo:hi])}

  def collect(chunk: int, tabs: Any, outputs: Any) -> dict[str, Any]:
    valid = tabs["valid"]
    update_of, stage_of = np.nonzero(valid[:, None] & ~engine.host(outputs["finite"]))
    rows = {"nonfinite": np.stack([tabs["update"][update_of], stage_of], axis=1).astype(np.int64)}
    # Without per-update rows the chunk's losses stay on the device, unread.
    if keep_updates:
      rows["loss"] = engine.host(outputs["loss"])[valid]
    if eval_fn is not None:
      rows["metrics"] = jax.tree.map(lambda x: engine.host(x)[tabs["eval"] & valid], outputs["metrics"])
    return rows

  records_like = {"nonfinite": np.zeros((0, 2), np.int64)}
  if keep_updates:
    records_like["loss"] = np.zeros(0, np.float32)
  if eval_fn is not None:
    records_like["metrics"] = jax.tree.map(lambda s: np.zeros((0,) + s.shape, s.dtype), metric_shapes)
  # Compiled once per program: runs whose steps trace to the same program (closed-over arrays included) share
  # the jitted chunk and evaluation, so a sweep over seeds or initial parameters compiles once. On a mesh the
  # step holds collectives that trace only inside its shard_map: compiled afresh.
  row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tables(0))
  cache_key = None if mesh is not None else engine.program_cache_key(("simulate_pipeline", "chunk"), step, carry, row, data)
  # Every stage's parameters: the size of the model a step updates, which chooses the compile options.
  step_entries = engine.entries(params)
  jitted_eval = None if eval_fn is None else engine.cached(
      None if mesh is not None else engine.program_cache_key(("simulate_pipeline", "eval"), eval_fn, params),
      lambda: engine.jit_like_chunk(eval_fn, step_entries, mesh))
  return engine.Program(
      carry=carry, carry_specs=carry_specs, constants=data, constant_specs=P(),
      step=step, table_specs=P(), output_specs=P(), num_chunks=num_chunks, tables=tables, collect=collect,
      records_like=records_like,
      progress=lambda chunk: {"updates_done": min(U, (chunk + 1) * chunk_size), "num_updates": U, "chunk": chunk,
                              "num_chunks": num_chunks},
      # Only a checkpoint needs the run's identity (it traces tx and hashes the data).
      fingerprint="" if checkpoint_dir is None else _fingerprint(
          schedule, stage_fns, loss_fn, eval_fn, params, tx, opt_states[0], data, batch_size, seed=seed,
          chunk_size=chunk_size,
          eval_points=eval_points.tolist(), depth=depth,
          layout="one stage per device" if mesh is not None else "one device", backward=backward),
      initial=None if eval_fn is None else (
          lambda carry: {"metrics": jax.tree.map(lambda x: engine.host(x)[None],
                                                 jitted_eval(params_at(carry[0], 0)))}),
      # Every stage's weight versions, read directions and optimizer state finite, after each chunk (on a
      # mesh each device checks its own stage and the flags are combined).
      check=(lambda carry: _all_finite(_inexact(carry))) if mesh is None else (
          lambda carry: jax.lax.pmin(_all_finite(_inexact(carry)).astype(jnp.int32), STAGES) > 0),
      cache_key=cache_key, step_entries=step_entries)


def _results(run: _PipelineRun, carry: Any, records: dict[str, Any]) -> PipelineResult:
  """A finished pipeline run's result: the stages' final weights and optimizer states, and the history."""
  (K, U, backward_version, chunk_size, current_params, eval_points, forward_version, keep_updates, mesh,
   num_chunks, params_at, runtime, schedule, state_packing, updates) = (getattr(run, name) for name in (
       "K", "U", "backward_version", "chunk_size", "current_params", "eval_points", "forward_version",
       "keep_updates", "mesh", "num_chunks", "params_at", "runtime", "schedule", "state_packing", "updates"))
  time = schedule.update_time.max(axis=1)
  if keep_updates:
    rows = dict(update=updates.astype(np.int64), time=time, loss=np.asarray(records["loss"]),
                forward_staleness=(updates[:, None] - forward_version.min(axis=1)).astype(np.int64),
                backward_staleness=(updates[:, None] - backward_version.min(axis=1)).astype(np.int64))
  else:
    rows = dict(update=np.zeros(0, np.int64), time=np.zeros(0, time.dtype), loss=np.zeros(0, np.float32),
                forward_staleness=np.zeros((0, K), np.int64), backward_staleness=np.zeros((0, K), np.int64))
  updates_per_chunk = np.diff(np.r_[0, np.minimum(np.arange(1, num_chunks + 1) * chunk_size, U)])
  history_out = PipelineHistory(
      **rows,
      eval_update=eval_points, eval_time=np.r_[0.0, time][eval_points],
      eval_metrics=records.get("metrics"),
      nonfinite=history_lib.sorted_pairs(records["nonfinite"]),
      nonfinite_state=history_lib.chunk_span(updates_per_chunk, records["check"]))
  history_lib.nonfinite_report(runtime, history_out.nonfinite, None, history_out.nonfinite_state, stacklevel=2,
                               source="stage")
  if mesh is not None:
    final = tuple(jax.tree.map(jnp.asarray, p) for p in params_at(carry[0], U))
    states = tuple(jax.tree.map(jnp.asarray, state_packing.unpack(k, {d: engine.host(a)[k] for d, a in
                                                                      carry[2].items()})) for k in range(K))
    return PipelineResult(final, states, history_out)
  return PipelineResult(current_params(carry[0], U), carry[2], history_out)
