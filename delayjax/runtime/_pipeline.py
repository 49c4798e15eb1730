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
:math:`w^b_k`. With :math:`w^b = w^f` this is the ordinary gradient
(``jax.grad``), and it is computed with ``jax.custom_vjp`` so it composes
with ``jit`` and ``vmap``.

:func:`simulate_pipeline` trains on a ``dj.cluster.pipeline`` schedule: update
``u`` of stage ``k`` applies the mean of the gradients of mini-batch ``u``'s
micro-batches, each computed with the versions the schedule gives, through an
Optax transformation per stage.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from delayjax._checks import check_int
from delayjax.cluster._pipeline import PipelineSchedule
from delayjax.runtime import _engine as engine
from delayjax.runtime import _history as history_lib
from delayjax.runtime._sampling import minibatch_indices
from delayjax.transforms._pipeline_remedies import stage_read

StageFn = Callable[[Any, Any], Any]

_CHECKPOINT_FILE = "pipeline.msgpack"

__all__ = ["staged_value_and_grad", "simulate_pipeline", "PipelineHistory", "PipelineResult"]


def _with_backward_params(stage_fn: StageFn) -> Callable[[Any, Any, Any], Any]:
  """``stage_fn(forward_params, h)`` whose VJP is taken at ``backward_params``, the cotangent going to the former."""

  @jax.custom_vjp
  def apply(forward_params, backward_params, h):
    del backward_params
    return stage_fn(forward_params, h)

  def fwd(forward_params, backward_params, h):
    return stage_fn(forward_params, h), (backward_params, h)

  def bwd(residuals, cotangent):
    backward_params, h = residuals
    _, vjp = jax.vjp(stage_fn, backward_params, h)
    grad_params, grad_h = vjp(cotangent)
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


def staged_value_and_grad(stage_fns: Sequence[StageFn], loss_fn: Callable[[Any, Any], jax.Array]
                          ) -> Callable[[Sequence[Any], Sequence[Any], Any], tuple[jax.Array, tuple[Any, ...]]]:
  """The loss and per-stage gradients with each stage's forward and backward pass at its own weights.

  Args:
    stage_fns: ``K`` functions ``stage_k(params_k, h) -> h``; stage 0 gets
      ``batch["x"]``.
    loss_fn: ``loss_fn(h_K, batch) -> scalar``.

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
  stages = tuple(_with_backward_params(f) for f in stage_fns)

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
  """

  update: np.ndarray
  time: np.ndarray
  loss: np.ndarray
  forward_staleness: np.ndarray
  backward_staleness: np.ndarray
  eval_update: np.ndarray
  eval_time: np.ndarray
  eval_metrics: Any


class PipelineResult(NamedTuple):
  """The outcome of :func:`simulate_pipeline`: per-stage parameters and optimizer states, and the history."""

  params: tuple[Any, ...]
  opt_states: tuple[Any, ...]
  history: PipelineHistory


@functools.partial(jax.jit, static_argnames=("num_microbatches", "num_examples", "batch_size"))
def _micro_indices(seed, updates, *, num_microbatches, num_examples, batch_size):
  """int32 ``[len(updates), m, B]``: micro-batch ``j`` of update ``u`` draws ``minibatch_indices(seed, u, j, 0)``."""
  draw = lambda u, j: minibatch_indices(seed, u, j, 0, num_examples=num_examples, batch_size=batch_size)  # noqa: E731
  micro = jnp.arange(num_microbatches, dtype=jnp.int32)
  return jax.vmap(lambda u: jax.vmap(lambda j: draw(u, j))(micro))(updates)


def _leading(tree: Any, depth: int) -> Any:
  return jax.tree.map(lambda x: jnp.zeros((depth,) + jnp.shape(x), jnp.result_type(x)).at[0].set(x), tree)


def _fingerprint(schedule: PipelineSchedule, params: Sequence[Any], **config: Any) -> str:
  h = hashlib.sha256()
  for a in (schedule.forward_version, schedule.backward_version):
    h.update(np.ascontiguousarray(a).tobytes())
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  h.update(repr(sorted(config.items())).encode())
  return h.hexdigest()


def simulate_pipeline(
    stage_fns: Sequence[StageFn],
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    params: Sequence[Any],
    data: Any,
    schedule: PipelineSchedule,
    *,
    batch_size: int,
    seed: int = 0,
    eval_fn: Callable[[tuple[Any, ...]], Any] | None = None,
    eval_every: int | None = None,
    chunk_size: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = True,
    callback: Callable[[dict[str, Any]], None] | None = None,
) -> PipelineResult:
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
  ``chunk_size`` updates per compiled ``lax.scan``, a checkpoint after every
  chunk in ``checkpoint_dir`` (a restarted run resumes from it, bit for bit),
  and ``callback`` after every chunk. Each stage keeps its versions in a ring
  of ``D`` slots, ``D - 1`` the largest staleness the schedule holds.

  Args:
    stage_fns: ``K`` stage functions; stage 0 receives ``batch["x"]``.
    loss_fn: ``loss_fn(h_K, batch) -> scalar``.
    tx: the per-stage optimizer.
    params: ``K`` parameter trees.
    data: a dict of arrays with a leading example axis, holding ``"x"``.
    schedule: a ``dj.cluster.pipeline`` schedule with ``K`` stages.
    batch_size: examples per micro-batch.
    seed: seeds the minibatches.
    eval_fn: optional jittable ``eval_fn(params) -> metrics`` on the tuple of
      stage parameters, at version 0, every ``eval_every`` updates and at the end.
    eval_every: updates between evaluations (``None``: start and end only).
    chunk_size: updates per compiled chunk (default ``min(U, 256)``).
    checkpoint_dir: where to checkpoint after every chunk (``None``: never).
    resume: continue from a checkpoint of the same run found there.
    callback: called after every chunk with ``{"updates_done", "num_updates"}``.

  Returns:
    A :class:`PipelineResult`.
  """
  stage_fns = _check_stages(stage_fns)
  if not isinstance(schedule, PipelineSchedule):
    raise TypeError(f"schedule must be a dj.cluster.pipeline(...) schedule, got {type(schedule).__name__}.")
  K, m, U = schedule.num_stages, schedule.num_microbatches, schedule.num_updates
  if len(stage_fns) != K:
    raise ValueError(f"stage_fns has {len(stage_fns)} stages but the schedule has num_stages={K}.")
  params = _check_stage_params("params", params, K)
  batch_size = check_int("batch_size", batch_size, minimum=1)
  seed = check_int("seed", seed, minimum=0)
  if eval_every is not None:
    eval_every = check_int("eval_every", eval_every, minimum=1)
  if eval_fn is not None and not callable(eval_fn):
    raise TypeError(f"eval_fn must be callable or None, got {type(eval_fn).__name__}.")
  chunk_size = min(U, 256) if chunk_size is None else min(check_int("chunk_size", chunk_size, minimum=1), U)
  if not isinstance(data, dict) or "x" not in data:
    raise ValueError("data must be a dict of arrays with a leading example axis, holding the inputs under 'x'.")
  data = {k: np.asarray(v) for k, v in data.items()}
  num_examples = int(data["x"].shape[0])
  value_and_grad = staged_value_and_grad(stage_fns, loss_fn)
  tx = optax.with_extra_args_support(tx)

  forward_version = schedule.forward_version.reshape(U, m, K).astype(np.int32)
  backward_version = schedule.backward_version.reshape(U, m, K).astype(np.int32)
  updates = np.arange(U)
  # Versions live in a ring of `depth` slots: the stalest read is depth - 1 versions back.
  depth = int(max((updates[:, None, None] - forward_version).max(),
                  (updates[:, None, None] - backward_version).max())) + 1
  opt_states = tuple(tx.init(p) for p in params)
  readers = [stage_read(s) for s in opt_states]
  history = tuple(_leading(p, depth) for p in params)
  directions = tuple(None if r is None else _leading(r.read_direction(), depth) for r in readers)
  eval_points = history_lib.eval_points(U, eval_every) if eval_fn is not None else np.zeros(0, np.int64)
  eval_flag = np.zeros(U, bool)
  eval_flag[eval_points[eval_points > 0] - 1] = True
  metric_shapes = jax.eval_shape(eval_fn, params) if eval_fn is not None else None

  def read(hist, direction, reader, version, steps):
    w = jax.tree.map(lambda h: h[version % depth], hist)
    if reader is None:
      return w
    return jax.tree.map(lambda x, d: x - steps.astype(x.dtype) * d[version % depth], w, direction)

  def current_params(hist, version):
    return tuple(jax.tree.map(lambda h: h[version % depth], h_k) for h_k in hist)

  def step(carry, tab, constants):
    hist, dirs, states = carry
    u, fv, bv, indices, valid = tab["update"], tab["forward"], tab["backward"], tab["indices"], tab["valid"]

    def micro(idx, fv_j, bv_j):
      fps, bps = [], []
      for k in range(K):
        sf, sb = (jnp.zeros([], jnp.int32),) * 2 if readers[k] is None else readers[k].read_steps(u, fv_j[k], bv_j[k])
        fps.append(read(hist[k], dirs[k], readers[k], fv_j[k], sf))
        bps.append(read(hist[k], dirs[k], readers[k], bv_j[k], sb))
      batch = jax.tree.map(lambda a: a[idx], constants)
      loss, grads = value_and_grad(fps, bps, batch)
      return loss, grads, fps

    losses, grads, fps = jax.vmap(micro)(indices, fv, bv)
    new_hist, new_dirs, new_states = [], [], []
    for k in range(K):
      current = jax.tree.map(lambda h: h[u % depth], hist[k])
      g = jax.tree.map(lambda x: jnp.mean(x, axis=0), grads[k])
      stale = jax.tree.map(lambda x: x[0], fps[k])
      upd, state = tx.update(g, states[k], current, staleness=u - fv[0, k], backward_staleness=u - bv[0, k],
                             stale_params=stale)
      new = optax.apply_updates(current, upd)
      reader = stage_read(state)
      slot = (u + 1) % depth
      # Padding steps (past the last update) change nothing: a where, not a cond, over the trees.
      keep = lambda old, x: jnp.where(valid, x, old)  # noqa: E731
      new_hist.append(jax.tree.map(lambda h, x: h.at[slot].set(keep(h[slot], x)), hist[k], new))
      new_dirs.append(None if reader is None else jax.tree.map(
          lambda h, x: h.at[slot].set(keep(h[slot], x)), dirs[k], reader.read_direction()))
      new_states.append(jax.tree.map(keep, states[k], state))
    new_carry = (tuple(new_hist), tuple(new_dirs), tuple(new_states))
    out = {"loss": jnp.mean(losses)}
    if eval_fn is not None:
      # A cond, not a where: evaluation is costly and due only every eval_every updates.
      out["metrics"] = jax.lax.cond(
          tab["eval"] & valid, lambda h: eval_fn(current_params(h, u + 1)),
          lambda h: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes), new_carry[0])
    return new_carry, out

  num_chunks = -(-U // chunk_size)

  def tables(chunk: int) -> dict[str, np.ndarray]:
    lo, hi = chunk * chunk_size, min(U, (chunk + 1) * chunk_size)
    pad = chunk_size - (hi - lo)
    span = np.arange(lo, hi, dtype=np.int32)
    indices = np.asarray(_micro_indices(jnp.int32(seed), jnp.asarray(span), num_microbatches=m,
                                        num_examples=num_examples, batch_size=batch_size))
    fill = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])  # noqa: E731
    return {"update": fill(span), "forward": fill(forward_version[lo:hi]), "backward": fill(backward_version[lo:hi]),
            "indices": fill(indices), "valid": fill(np.ones(hi - lo, bool)), "eval": fill(eval_flag[lo:hi])}

  def collect(chunk: int, tabs: Any, outputs: Any) -> dict[str, Any]:
    valid = tabs["valid"]
    rows = {"loss": engine.host(outputs["loss"])[valid]}
    if eval_fn is not None:
      rows["metrics"] = jax.tree.map(lambda x: engine.host(x)[tabs["eval"] & valid], outputs["metrics"])
    return rows

  records_like = {"loss": np.zeros(0, np.float32)}
  if eval_fn is not None:
    records_like["metrics"] = jax.tree.map(lambda s: np.zeros((0,) + s.shape, s.dtype), metric_shapes)
  program = engine.Program(
      carry=(history, directions, opt_states), carry_specs=(P(), P(), P()), constants=data, constant_specs=P(),
      step=step, table_specs=P(), output_specs=P(), num_chunks=num_chunks, tables=tables, collect=collect,
      records_like=records_like,
      progress=lambda chunk: {"updates_done": min(U, (chunk + 1) * chunk_size), "num_updates": U},
      fingerprint=_fingerprint(schedule, params, seed=seed, batch_size=batch_size, chunk_size=chunk_size,
                               eval_points=eval_points.tolist(), depth=depth),
      initial=None if eval_fn is None else (
          lambda carry: {"metrics": jax.tree.map(lambda x: engine.host(x)[None],
                                                 jax.jit(eval_fn)(current_params(carry[0], 0)))}))
  carry, records = engine.run(program, checkpoint_dir=checkpoint_dir, checkpoint_name=_CHECKPOINT_FILE,
                              resume=resume, callback=callback)
  time = schedule.update_time.max(axis=1)
  history_out = PipelineHistory(
      update=updates.astype(np.int64), time=time, loss=np.asarray(records["loss"]),
      forward_staleness=(updates[:, None] - forward_version.min(axis=1)).astype(np.int64),
      backward_staleness=(updates[:, None] - backward_version.min(axis=1)).astype(np.int64),
      eval_update=eval_points, eval_time=np.r_[0.0, time][eval_points],
      eval_metrics=records.get("metrics"))
  return PipelineResult(current_params(carry[0], U), carry[2], history_out)
