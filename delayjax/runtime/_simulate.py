"""The wave-parallel runtime: exact simulation of delayed-gradient training, at the cost of its gradients."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import os
import re
import types
from typing import Any, Callable, NamedTuple, Sequence, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from delayjax import delays as delays_lib
from delayjax._checks import check_int, check_seed
from delayjax.cluster._schedule import Schedule
from delayjax.runtime import _checkpoint
from delayjax.runtime import _engine as engine
from delayjax.runtime import _history as history_lib
from delayjax.runtime import _sampling
from delayjax.runtime._engine import AXIS, check_worker_capacity, program_key
from delayjax.runtime._arguments import (batch_like, check_not_traced, check_params, check_sampling, loss_has_aux,
                                         tree_like)
from delayjax.runtime._options import (Checkpoint, Execution, Record, Runs, Sampling, check_runs_device,
                                       runtime_options)
from delayjax.runtime._lanes import Lanes
from delayjax.runtime._read_groups import BlockGroups, LeafGroups, map_groups
from delayjax.runtime._workers import Gradient, Worker, check_worker
from delayjax.runtime._sampling import lane_examples, shard_table
from delayjax.runtime._waves import StepPlan, plan_steps
from delayjax.transforms._hooks import check_schedule, defines_read, read_params, requesting_states, runtime_inputs

# Server params, optimizer state, slots, the parameters the next step's lanes compute at, then the
# payload buffer (gradients and per-contribution inputs), stale-params, loss and finiteness
# buffers of the gradients waiting for their update, whether an SVRG snapshot is still due, and
# the workers' local optimizer states (with keep_local_state).
CARRY_SPECS = (P(), P(), P(AXIS), P(AXIS), P(), P(), P(), P(), P(), P(AXIS))
_CHECKPOINT_FILE = "simulate"
# The extra arguments simulate can compute when a transformation requests
# them (dj.transforms.runtime_inputs). Server inputs are computed at the
# server parameters right before their update (_step_function's
# server_inputs); lane inputs by each contribution's lane, on its own
# minibatch (minibatch_payload), and reduced per update.
SERVER_INPUTS = ("full_grad", "zeno_grad")
# Per-contribution inputs (dj.per_contribution): each contribution of an update on a leading axis.
CONTRIBUTION_INPUTS = ("contribution_grads", "contribution_stale_params", "contribution_staleness",
                       "contribution_weights", "contribution_workers")
LANE_INPUTS = ("sample_features", "sample_grads", "sample_indices", "sample_mask", "sample_scalars",
               "sample_snapshot_grads", "snapshot_grad")
# Per-example payload entries: one row per example a contribution draws.
_PER_EXAMPLE = ("sample_features", "sample_grads", "sample_scalars", "sample_snapshot_grads")
# Lane inputs taken at an SVRG-style snapshot (dj.svrg: the minibatch mean; dj.hsag: per example).
_SNAPSHOT_INPUTS = ("snapshot_grad", "sample_snapshot_grads")
RUNTIME_INPUTS = tuple(sorted(SERVER_INPUTS + LANE_INPUTS + CONTRIBUTION_INPUTS))
# Payload entries that are averaged over an update's contributions like the gradient.
_MIXED = ("grad", "snapshot_grad")


class History(NamedTuple):
  """What happened during a simulation (NumPy arrays on the host).

  The first four fields have a row per update; with ``dj.simulate(...,
  history="evaluations")`` the host keeps none of them (empty arrays of their
  dtypes, length 0), so the history's memory, and a checkpoint's, grows with
  the evaluations and the non-finite reports, not with the updates (28 bytes
  per update less: 27 MiB at a million updates). The other fields are the
  same with either setting, bit for bit. Meant for sweeps of long runs that
  read only the evaluations.

  Attributes:
    update: int64 ``[U]``, the update index ``u = 0 .. U - 1``.
    time: float64 ``[U]``, simulated time of each update (``Schedule.time``;
      the update index for delay models).
    loss: float32 ``[U]``, mean minibatch loss of the update's contributions
      (weighted by ``num_batches``), computed at their stale parameters (with
      local steps: the first local step's loss); all contributions count,
      skipped ones included.
    staleness: int64 ``[U]``, the largest staleness among the update's
      contributions (-1 for an update without any).
    eval_update: int64 ``[E]``, the version (updates applied so far) each
      evaluation was made at: 0, every ``eval_every``-th, and the last.
    eval_time: float64 ``[E]``, simulated time of that version (the time of
      the update that produced it; 0 for version 0).
    eval_metrics: ``eval_fn``'s output with a leading ``[E]`` axis on every
      leaf, or ``None`` without ``eval_fn``.
    nonfinite: int64 ``[n, 2]``, ``(update, worker)`` of every contribution
      whose gradient had a NaN or infinite entry, sorted.
    skipped: int64 ``[n, 2]``, with ``skip_nonfinite``: ``(update, worker)``
      of every update left out because its update or new optimizer state was
      not finite (``worker``: the contribution that speaks for it); empty
      without ``skip_nonfinite``.
    nonfinite_state: ``None``, or the updates ``(first, last)`` of the chunk
      after which the server parameters or optimizer state were first found
      non-finite (the run checks them after every chunk).

  Any of the three non-empty also raises a ``RuntimeWarning`` at the end of
  the run that names the first update and worker.
  """

  update: np.ndarray
  time: np.ndarray
  loss: np.ndarray
  staleness: np.ndarray
  eval_update: np.ndarray
  eval_time: np.ndarray
  eval_metrics: Any
  nonfinite: np.ndarray
  skipped: np.ndarray = np.zeros((0, 2), np.int64)
  nonfinite_state: tuple[int, int] | None = None


class SimulationResult(NamedTuple):
  """The outcome of :func:`simulate`.

  Attributes:
    params: the server parameters after the last update.
    opt_state: the optimizer state after the last update.
    history: a :class:`History`.
    stats: how the run was executed: ``num_waves`` and ``mean_wave_length``
      (the schedule's waves, see below: how much of it is parallel),
      ``num_steps``, ``lanes`` (gradients per device per step),
      ``lane_utilization`` (fraction of computed gradients that were real
      rather than masked), ``num_slots`` (parameter copies per worker),
      ``num_workers`` (after padding), ``num_devices``, ``chunk_size`` (steps
      per dispatch) and ``num_chunks``.
  """

  params: Any
  opt_state: Any
  history: History
  stats: dict[str, Any]


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _run_states(opt_states: list[Any], values: dict[str, list[Any]]) -> list[Any]:
  """Each run's optimizer state (``opt_states[r]``) with its ``optax.inject_hyperparams`` hyper-parameters set to
  the run's values."""
  states = [x for x in jax.tree.leaves(opt_states[0], is_leaf=lambda x: isinstance(x, _INJECTED))
            if isinstance(x, _INJECTED)]
  known = sorted({name for state in states for name in state.hyperparams})
  unknown = [name for name in values if name not in known]
  if unknown:
    raise ValueError(
        f"hyperparams names {unknown}, but tx's state holds hyper-parameters {known or 'none'} (only those "
        f"of an optax.inject_hyperparams transformation can differ between runs).")

  def with_run(r, opt_state):
    def set_values(x):
      if not isinstance(x, _INJECTED):
        return x
      hyper = dict(x.hyperparams)
      for name, v in values.items():
        if name in hyper:
          if np.shape(v[r]) != np.shape(hyper[name]):
            raise ValueError(
                f"hyperparams[{name!r}][{r}] has shape {np.shape(v[r])}; the state's {name} has shape "
                f"{np.shape(hyper[name])}.")
          hyper[name] = jnp.asarray(v[r], jnp.result_type(hyper[name]))
      return x._replace(hyperparams=hyper)
    return jax.tree.map(set_values, opt_state, is_leaf=lambda x: isinstance(x, _INJECTED))

  return [with_run(r, state) for r, state in enumerate(opt_states)]


def _check_run_params(given: tuple[Any, ...], params: Any) -> list[Any]:
  """``Runs.params`` checked against ``params``: each of its structure, shapes and dtypes."""
  like = jax.tree.structure(params), [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
  for i, own in enumerate(given):
    theirs = jax.tree.structure(own), [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(own)]
    if theirs != like:
      raise ValueError(
          f"Runs.params[{i}] must have params' structure, shapes and dtypes {like[0]} {like[1]}; got "
          f"{theirs[0]} {theirs[1]}.")
  return list(given)


def _stale_read_delays(model: delays_lib.DelayModel, num_updates: int, seed: int) -> np.ndarray:
  """int64 ``[num_updates, G]``: every update's delay, per model of a ``per_leaf`` tree or per block of a ``torn``
  read (``G = 1`` otherwise)."""
  host = _host_delays(model, num_updates, seed)
  if host is not None:
    return host
  key = jax.random.fold_in(jax.random.key(seed), 0)
  steps = jnp.arange(num_updates, dtype=jnp.int32)
  # Declared by the model's own class: a subclass may draw otherwise (its own sample).
  if vars(type(model)).get("_drawn_with"):
    drawn = _class_draws(type(model))(key, steps, *[np.int32(getattr(model, name)) for name in model._drawn_with])
  else:
    try:
      draw = _delay_draws(model)
    except TypeError:  # a model that cannot be hashed (a per_leaf tree of dicts) is drawn by a fresh program
      draw = _delay_draws.__wrapped__(model)
    drawn = draw(key, steps)
  return np.concatenate([np.asarray(d).reshape(num_updates, -1) for d in jax.tree.leaves(drawn)],
                        axis=1).astype(np.int64)


def _host_delays(model: delays_lib.DelayModel, num_updates: int, seed: int) -> np.ndarray | None:
  """``constant(tau)``'s and ``uniform(s)``'s delays computed in NumPy, the integers their compiled draw
  (:func:`_class_draws`) gives: ``uniform`` draws ``randint(fold_in(fold_in(key(seed), 0), t), (), 0, s + 1)``
  for update ``t`` (:func:`_sampling.host_randint`). ``None`` for other models (a subclass too, which may draw
  otherwise) and for keys other than Threefry's. Each compiled draw costs 0.1-0.2 s to compile, more than the
  updates of a reproduction take to draw here."""
  if type(model) is delays_lib.Constant:
    return np.full((num_updates, 1), model.tau, np.int64)
  # A bound whose s + 1 overflows int32 keeps the compiled draw: the host would not wrap as its int32 sum does.
  if type(model) is not delays_lib.Uniform or model.s >= 2**31 - 1 or not _sampling.threefry_keys():
    return None
  key = _sampling.host_fold_in(_sampling.host_fold_in(_sampling.host_key(seed), np.uint32(0)),
                               np.arange(num_updates, dtype=np.uint32))
  return _sampling.host_randint(key, np.full(num_updates, model.s + 1), 1).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _delay_draws(model: delays_lib.DelayModel) -> Callable[[jax.Array, jax.Array], Any]:
  """The compiled draw of ``model``'s delays at several updates, kept for equal models: a sweep over seeds
  compiles it once (a torn read's nested draws take seconds to compile).

  A draw of integers alone (the key's hash, ``randint``'s remainders: ``constant``, ``uniform``, ``trace``) is
  exact whatever the compiler's optimizations, so it is compiled without them: about 0.8 CPU s instead of 1.3
  for ``uniform(s)``'s 800 draws, the same delays. A draw that computes in floating point (``categorical``'s
  logits) keeps the default, whose roundings its delays were drawn with.
  """
  draw = jax.vmap(lambda key, t: model.sample(jax.random.fold_in(key, t), t), in_axes=(None, 0))
  example = (jax.random.key(0), jnp.zeros(1, jnp.int32))
  exact = not _FLOAT_TYPE.search(str(jax.make_jaxpr(draw)(*example)))
  return jax.jit(draw, compiler_options={"xla_backend_optimization_level": 0} if exact else None)


@functools.lru_cache(maxsize=16)
def _class_draws(cls: type) -> Callable[..., Any]:
  """The compiled draw of the delays of every model of ``cls`` (one whose ``_drawn_with`` names its numbers), at
  several updates: ``(key, steps, *numbers)``. A sweep over bounds (``uniform(s)`` for four ``s``) compiles it
  once where :func:`_delay_draws` compiles one per model (about 0.35 s each on 2 cores); the numbers are
  arguments, integers as the constants were, so the delays are the same. Integers only: compiled without
  optimizations, as :func:`_delay_draws` compiles an exact draw."""
  numbers = (None,) * len(cls._drawn_with)
  draw = jax.vmap(lambda key, t, *values: cls._sample_with(jax.random.fold_in(key, t), t, *values),
                  in_axes=(None, 0, *numbers))
  return jax.jit(draw, compiler_options={"xla_backend_optimization_level": 0})


# A floating-point variable in a jaxpr's text (sub-jaxprs included).
_FLOAT_TYPE = re.compile(r"\b(f8_\w+|f16|bf16|f32|f64|c64|c128)\[")


def schedule_from_delays(model: delays_lib.DelayModel, num_updates: int, seed: int,
                         num_workers: int | None = None) -> Schedule:
  """The stale-read model as a schedule of round-robin workers: what ``dj.simulate`` runs for a delay model.

  Update ``t`` has one contribution, from worker ``t mod M``, computed at
  version ``max(0, t - d_t)`` with ``d_t = model.sample(fold_in(k, t), t)``
  (``k`` derived from ``seed``); its time is ``t``. ``M = max_delay + 1`` by
  default, the fewest workers for which every worker has at most one
  gradient in flight; with ``constant(tau)`` this is the round-robin cluster
  of ``tau + 1`` workers. A larger ``num_workers`` gives the same reads and
  updates from more workers, so that schedules of several delay bounds have
  one shape and share one compiled program (``dj.Execution(like=...)``). With
  a ``per_leaf`` model, ``d_t`` is the largest of its models' draws (the
  earliest read: ``read_version`` carries the update's largest staleness);
  ``dj.simulate`` reads each model's leaves at their own version. Likewise a
  ``torn`` model's largest block delay; ``dj.simulate`` reads each block at its
  own version.

  Args:
    model: a delay model from ``dj.delays``.
    num_updates: updates of the schedule, >= 1.
    seed: an int in ``[0, 2**32)``, the seed ``dj.simulate`` would draw the delays with.
    num_workers: ``None`` (``max_delay + 1``) or an int >= ``max_delay + 1``.
  """
  num_updates = check_int("num_updates", num_updates, minimum=1)
  return _stale_read_schedule(model, num_updates, check_seed("seed", seed), num_workers)[0]


def _stale_read_schedule(model: delays_lib.DelayModel, num_updates: int, seed: int,
                         num_workers: int | None = None) -> tuple[Schedule, np.ndarray]:
  """:func:`schedule_from_delays`, and the version each model of ``model`` reads at, ``[num_updates, G]``.

  The schedule has one contribution per update, so contributions and
  updates share their order.
  """
  delays_lib.check_model("source", model)
  if num_workers is None:
    num_workers = model.max_delay + 1
  else:
    num_workers = check_int("num_workers", num_workers)
    if num_workers < model.max_delay + 1:
      # Round robin over fewer workers would have a worker read again before its last gradient is applied.
      raise ValueError(f"num_workers must be None or at least max_delay + 1 = {model.max_delay + 1} for "
                       f"{model!r}, got {num_workers}.")
  t = np.arange(num_updates)
  versions = np.maximum(0, t[:, None] - _stale_read_delays(model, num_updates, seed))
  contributes = np.zeros((num_updates, num_workers), bool)
  read_version = np.full((num_updates, num_workers), -1, np.int64)
  contributes[t, t % num_workers] = True
  read_version[t, t % num_workers] = versions.min(axis=1)
  schedule = Schedule(time=t.astype(np.float64), contributes=contributes, read_version=read_version,
                      wait=np.zeros(num_workers), paradigm=f"stale read, {model!r}")
  return schedule, versions


def _leaf_reads(source: Any, versions: np.ndarray | None,
                params: Any) -> tuple[np.ndarray | None, LeafGroups | BlockGroups | None]:
  """For a ``per_leaf`` source: each group's read versions (``versions``, ``[U, G]``) and each parameter
  leaf's group (``LeafGroups``); for a ``torn`` one, the blocks' versions and the coordinates' blocks
  (``BlockGroups``); ``None, None`` for any other source (or a single group)."""
  if isinstance(source, delays_lib.Torn):
    source.check_params(params)
    return (None, None) if source.num_blocks == 1 else (versions, BlockGroups.of(source))
  if not isinstance(source, delays_lib.PerLeaf):
    return None, None
  delays_lib.leaf_models(source, params)  # a clear error if its tree is not a prefix of params
  models, treedef = jax.tree.flatten(source.models, is_leaf=lambda x: isinstance(x, delays_lib.DelayModel))
  if len(models) == 1:
    return None, None
  groups = jax.tree.map(lambda g, sub: jax.tree.map(lambda _: g, sub), treedef.unflatten(range(len(models))), params)
  return versions, LeafGroups(tuple(jax.tree.leaves(groups)))


def _payload_like(params: Any, inputs: tuple[str, ...], samples: int, terms: Any = None) -> dict[str, Any]:
  """The shapes and dtypes (``jax.ShapeDtypeStruct``: nothing allocated) of one contribution's payload: its
  gradient and the lane inputs ``inputs`` need, as the default worker pushes them.

  ``samples``: the examples a contribution draws (per-example entries);
  ``terms``: the shapes of ``sample_terms``' output for one example.
  """
  return Gradient().payload_like(params, inputs, samples, terms)


def _terms_spec(sample_terms: Callable[..., Any], params: Any, data: Any, batch_size: int) -> tuple[Any, Any]:
  """The shapes of one example's ``(scalar, features)`` from ``sample_terms``, checked on a minibatch."""
  batch = batch_like(data, batch_size)
  out = jax.eval_shape(sample_terms, params, batch)
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(f"sample_terms must return a pair (scalars, features); got {jax.tree.structure(out)}.")
  scalars, features = out
  if not isinstance(scalars, jax.ShapeDtypeStruct) or scalars.shape != (batch_size,):
    raise ValueError(
        f"sample_terms: scalars must have shape [batch] = ({batch_size},); got "
        f"{getattr(scalars, 'shape', jax.tree.structure(scalars))}.")
  # Features are whatever the requesting transformation takes per example (dj.saga: a pytree like
  # params; dj.prox_asaga: a sparse row), so only their leading axis is the runtime's business.
  if not jax.tree.leaves(features) or any(a.shape[:1] != (batch_size,) for a in jax.tree.leaves(features)):
    raise ValueError(
        f"sample_terms: features must be a pytree of arrays with a leading [batch] = {batch_size} axis; got "
        f"shapes {[a.shape for a in jax.tree.leaves(features)]}.")
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), (scalars, features))


def _input_examples(params: Any, inputs: tuple[str, ...], samples: int, terms: Any = None,
                    num_contrib: int = 1) -> dict[str, Any]:
  """Stand-ins for the runtime inputs ``inputs``, with their shapes and dtypes."""
  payload = _payload_like(params, inputs, samples, terms)
  out = {}
  for name in inputs:
    if name in ("zeno_grad", "full_grad"):
      out[name] = params
    elif name in ("contribution_grads", "contribution_stale_params"):
      out[name] = jax.tree.map(lambda x: np.zeros((num_contrib,) + np.shape(x), jnp.result_type(x)), params)
    elif name in ("contribution_staleness", "contribution_workers"):
      out[name] = np.zeros((num_contrib,), np.int32)
    elif name == "contribution_weights":
      out[name] = np.full((num_contrib,), 1 / num_contrib, np.float32)
    elif name == "sample_mask":
      out[name] = np.ones((samples,), bool)
    elif name == "value":
      out[name] = np.float32(0)
    else:
      out[name] = payload[name]
  if "full_grad" in inputs:
    out["refresh"] = np.asarray(True)
  return out


def _uses_stale_params(tx: optax.GradientTransformationExtraArgs, params: Any, inputs: tuple[str, ...],
                       samples: int, terms: Any, num_contrib: int) -> bool:
  """Whether ``tx.update``'s result depends on the stale parameters it is given (traced once, abstractly):
  its ``stale_params`` argument, or each contribution's (``contribution_stale_params``)."""
  spec = tree_like(params)
  state = jax.eval_shape(tx.init, spec)

  def update(stale, state, params):
    extra = jax.tree.map(lambda x: jnp.zeros(np.shape(x), x.dtype), _input_examples(params, inputs, samples, terms,
                                                                                   num_contrib))
    if "contribution_stale_params" in inputs:
      extra["contribution_stale_params"] = jax.tree.map(lambda s: jnp.stack([s] * num_contrib), stale)
    return tx.update(params, state, params, staleness=jnp.int32(0), stale_params=stale, worker=jnp.int32(0),
                     **extra)

  jaxpr = jax.make_jaxpr(update)(spec, state, spec).jaxpr
  stale_vars = {id(v) for v in jaxpr.invars[:len(jax.tree.leaves(spec))]}
  # Only equations that reach an output count: a value computed from the stale parameters and then
  # dropped (a per-contribution stage's padding) does not need them kept.
  needed = {id(v) for v in jaxpr.outvars}
  used = {id(v) for v in jaxpr.outvars}
  for eqn in reversed(jaxpr.eqns):
    if any(id(v) in needed for v in eqn.outvars) or eqn.effects:
      ids = {id(v) for v in eqn.invars}
      needed |= ids
      used |= ids
  return bool(used & stale_vars)


def _lanes_stale(opt_state: Any, params: Any, slots: Any, rows: jax.Array, workers: jax.Array, slot: jax.Array,
                fresh: jax.Array, leaf_groups: LeafGroups | BlockGroups | None = None) -> Any:
  """The parameters each lane computes at: read now if ``fresh``, else from its worker's slot.

  ``slots`` leaves are ``[rows, num_slots, ...]``; ``rows``, ``workers``,
  ``slot`` have one entry per lane, ``fresh`` one per lane and group of
  leaves (``leaf_groups``: each parameter leaf's group; ``None``: one group).
  """
  held = jax.vmap(lambda m, k: jax.tree.map(lambda x: x[m, k], slots))(rows, slot)
  reads = jax.vmap(lambda m: read_params(opt_state, params, m))(workers)
  return map_groups(lambda g, r, h: jnp.where(_lead(fresh[:, g], r), r, h), leaf_groups, reads, held)


def _inexact(tree: Any) -> list[jax.Array]:
  """The floating-point leaves of ``tree`` (the ones that can be NaN or infinite)."""
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _all_finite(tree: Any, lead: int = 0) -> jax.Array:
  """Whether every entry of ``tree``'s leaves is finite; with ``lead``, one flag per index of the leaves'
  ``lead`` leading axes (which they share).

  Every entry times zero, summed: 0 where all are finite, NaN where any is NaN or infinite (``0 * inf`` is NaN,
  and a NaN survives every product and sum, in any order). A max-reduction of ``|x|`` does not do: XLA's CPU
  reductions may drop a NaN (its XNNPACK max of a NaN and a number is the number; a ``[1, 5000]`` leaf with one
  NaN entry reduced to 1.0, so ``dj.simulate`` missed the non-finite gradients of a model with a leaf that
  large). The zeros pass an optimization barrier, so that the compiler cannot fold ``x * 0`` away; each product
  and sum is then a matrix-vector product, which the CPU computes faster than a reduction (about 10 us a step
  less for a 13,000-parameter MLP). Leaves of fewer than :data:`_OWN_PRODUCT` entries per flag are joined into
  one array per dtype first: one product, where one per leaf would each be a kernel of its own to compile.
  Integer and boolean leaves are always finite.
  """
  leaves = jax.tree.leaves(tree)
  parts: list[jax.Array] = []
  small: dict[Any, list[jax.Array]] = {}
  for x in leaves:
    if not (jnp.issubdtype(x.dtype, jnp.inexact) and x.size):
      continue
    flat = x.reshape(x.shape[:lead] + (-1,))
    if flat.shape[-1] >= _OWN_PRODUCT:
      parts.append(flat)
    else:
      small.setdefault(jnp.dtype(x.dtype), []).append(flat)
  parts += [jnp.concatenate(xs, axis=lead) if len(xs) > 1 else xs[0] for xs in small.values()]
  if not parts:
    return jnp.ones(leaves[0].shape[:lead] if leaves and lead else (), jnp.bool_)
  nonfinite = [jnp.isnan(flat @ jax.lax.optimization_barrier(jnp.zeros(flat.shape[-1:], flat.dtype)))
               for flat in parts]
  return ~functools.reduce(jnp.logical_or, nonfinite)


# Leaves with at least this many entries per flag get a product of their own in _all_finite.
_OWN_PRODUCT = 1024


def _lead(mask: jax.Array, x: jax.Array) -> jax.Array:
  """``mask`` (leading axes of ``x``) broadcast against ``x``."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def _check_runtime_inputs(opt_state: Any, local: bool, has_terms: bool) -> tuple[str, ...]:
  inputs = runtime_inputs(opt_state)
  unknown = [name for name in inputs if name not in RUNTIME_INPUTS]
  if unknown:
    raise ValueError(
        f"tx requests runtime inputs that dj.simulate cannot compute: {unknown}; it computes "
        f"{', '.join(map(repr, RUNTIME_INPUTS))}.")
  per_contribution = [name for name in inputs if name in LANE_INPUTS]
  if local and per_contribution:
    raise ValueError(
        f"local_steps: tx requests per-contribution inputs {per_contribution} (variance reduction), which "
        f"are defined for gradients, not for local-SGD pseudo-gradients; pass local_steps=None.")
  unmasked = [type(x).__name__ for name in ("sample_grads", "sample_scalars", "sample_snapshot_grads")
              for x in requesting_states(opt_state, name) if "sample_mask" not in x.runtime_inputs()]
  if unmasked:
    raise ValueError(
        f"tx: {unmasked} request per-example inputs without sample_mask; dj.simulate pads every update's "
        f"examples to one static shape and masks the padding, so it feeds per-example inputs only to "
        f"transformations that take sample_mask (dj.saga, dj.prox_asaga).")
  if ("sample_scalars" in inputs) != has_terms:
    raise ValueError(
        "sample_terms is required when tx requests sample_scalars (dj.saga(table='scalars')), and only "
        f"then; tx requests {list(inputs) or 'no runtime inputs'} and sample_terms is "
        f"{'given' if has_terms else 'None'}.")
  for name in _SNAPSHOT_INPUTS:
    if name in inputs and "full_grad" not in inputs:
      raise ValueError(f"tx requests {name} without full_grad; an SVRG snapshot needs both (see dj.svrg).")
  snapshot_states = _snapshot_states(opt_state)
  if len(snapshot_states) > 1:
    raise ValueError(
        f"tx: at most one transformation in a chain may request {' or '.join(_SNAPSHOT_INPUTS)} (one SVRG "
        f"snapshot); found {len(snapshot_states)}.")
  return inputs


def _wants_snapshot(inputs: tuple[str, ...]) -> bool:
  """Whether a lane input is taken at the snapshot (so lanes need the snapshot parameters)."""
  return any(name in inputs for name in _SNAPSHOT_INPUTS)


def _snapshot_states(opt_state: Any) -> list[Any]:
  """The states requesting a snapshot input, each once (one may request both)."""
  found = {}
  for name in _SNAPSHOT_INPUTS:
    found.update({id(x): x for x in requesting_states(opt_state, name)})
  return list(found.values())


def _snapshot_params(opt_state: Any) -> Any:
  """The SVRG snapshot held in ``opt_state`` (see ``dj.svrg``, ``dj.hsag``)."""
  return _snapshot_states(opt_state)[0].snapshot_params()


def _full_grad_weights(opt_state: Any) -> Any:
  """Per-example weights of the full gradient (``None``: the plain mean), from the state requesting ``full_grad``:
  ``dj.hsag`` asks only for the examples outside its SAGA set."""
  states = [x for x in requesting_states(opt_state, "full_grad") if hasattr(x, "full_grad_weights")]
  return states[0].full_grad_weights() if states else None


def _source_schedule(source: Any, num_updates: int | None, seed: int) -> tuple[Schedule, np.ndarray | None]:
  """The schedule to run, and for a delay model the version each of its models reads at (``[U, G]``)."""
  if isinstance(source, Schedule):
    if num_updates is None:
      return source, None
    if num_updates > source.num_updates:
      raise ValueError(
          f"num_updates={num_updates} but the schedule (source) has only {source.num_updates} "
          f"updates; pass num_updates <= {source.num_updates} or a longer schedule.")
    return source[:num_updates], None
  if isinstance(source, delays_lib.DelayModel):
    if num_updates is None:
      raise ValueError("num_updates is required when source is a delay model; got None.")
    return _stale_read_schedule(source, num_updates, seed)
  raise TypeError(
      f"source must be a dj.cluster.Schedule or a delay model from dj.delays, got "
      f"{type(source).__name__}.")


def _fingerprint(schedules: list[Schedule], *, tx: Any, loss_fn: Callable[..., Any], params: Any, opt_state: Any,
                 data: Any, eval_fn: Any, local_optimizer: Any, inputs: tuple[str, ...], batch_size: int,
                 terms: Any, plan: StepPlan, plugin_programs: dict[str, Any], **options: Any) -> dict[str, str]:
  """The run's identity, by component: what a checkpoint must match to be resumed (``_engine.identity``)."""
  num_contrib = plan.upd_worker.shape[2]
  samples = num_contrib * _max_batches(plan) * batch_size
  extra = _input_examples(params, inputs, samples, terms, num_contrib)
  programs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
      "tx": (lambda g, s, p, e: tx.update(g, s, p, staleness=jnp.int32(0), stale_params=p, worker=jnp.int32(0), **e),
             (params, opt_state, params, extra)),
      "loss_fn": (loss_fn, (params, batch_like(data, batch_size))),
  }
  if eval_fn is not None:
    programs["eval_fn"] = (eval_fn, (params, opt_state))
  if local_optimizer is not None:
    programs["local_optimizer"] = (local_optimizer.update, (params, local_optimizer.init(params), params))
  programs.update(plugin_programs)
  # Runs of their own schedules (dj.Runs(sources=...)): every run's, in order.
  schedule = (_schedule_digest(schedules[0]) if len(schedules) == 1 else
              _checkpoint.digest(*[_schedule_digest(own) for own in schedules]))
  return engine.identity(schedule=schedule, options=options, params=params, data=data,
                         programs=programs, trees={"optimizer state": opt_state})


# Recent plans, by their arguments' digest: a sweep over one schedule (seeds, hyper-parameters) plans it
# once. Few, because a long run's plan holds tables of several rows per update.
_PLANS_KEPT = 2
_plans: collections.OrderedDict[str, StepPlan] = collections.OrderedDict()


def _schedule_digest(schedule: Schedule) -> str:
  """A digest of everything in ``schedule`` that the run depends on, from its sparse contributions.

  The dense ``[updates, workers]`` views would cost memory that grows with workers x updates (and are
  refused past ``DENSE_LIMIT``); the compressed rows say the same, in one canonical order.
  """
  c = schedule.contributions
  return _checkpoint.digest(schedule.time, schedule.offsets, c.worker, c.read_version, c.num_batches)


class ProgramSizes(NamedTuple):
  """The static sizes of the compiled chunk that a plan fixes, rounded up so that runs of one sweep share them.

  Runs that differ only in seed or schedule draw plans whose widths differ by a few (updates per step
  11 or 12, a gradient buffer of 4 or 5 blocks, 168 or 169 steps): exact sizes would compile a program
  per run. Rounded up, they share one. Padding costs nothing where the step loops over a dynamic count
  (updates and reads per step: powers of two), memory for the gradient buffer (blocks of ``lanes``
  rows: the power of two above the plan's blocks, at most twice as many; the plan's own where that would
  not fit the device's memory or ``max_memory``) and masked steps for the chunk
  (:func:`_shared_length`). Results do not depend on any of them.
  """
  max_len: int  # updates applied per step
  max_reads: int  # parameter reads per step
  reads_per_update: int  # reads after one update: unrolled up to 2, a loop beyond (3 stands for any)
  buffer_size: int  # rows of the gradient buffer
  num_slots: int  # read parameters each worker keeps


# The most bytes of a chunk's minibatch indices drawn on the host (every run's, for runs of their own schedules);
# a larger table is drawn in the step instead (the same indices).
_HOST_DRAWS_BYTES = 64 << 20


def _next_power_of_two(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _shared_length(n: int) -> int:
  """``n`` rounded up to four significant bits (at most 1/8 more): the scan length of a chunk."""
  shift = max(int(n).bit_length() - 4, 0)
  return -(-int(n) >> shift) << shift


def _program_sizes(plan: StepPlan, rounded: bool = True) -> ProgramSizes:
  """The sizes ``plan`` fixes, rounded up (see :class:`ProgramSizes`), or its own with ``rounded=False``."""
  reads = int((plan.read_end - plan.read_begin).max()) if plan.read_end.size else 0
  if not rounded:
    return ProgramSizes(max_len=plan.upd_index.shape[1], max_reads=plan.read_width,
                        reads_per_update=min(reads, 3), buffer_size=plan.buffer_size, num_slots=plan.num_slots)
  width = plan.lanes * plan.num_devices
  return ProgramSizes(max_len=_next_power_of_two(plan.upd_index.shape[1]),
                      max_reads=_next_power_of_two(plan.read_width),
                      reads_per_update=min(reads, 3),
                      buffer_size=_next_power_of_two(plan.buffer_size // width + 1) * width,
                      num_slots=plan.num_slots)


def _check_like(like: Any, schedule: Schedule) -> tuple[Schedule, ...]:
  """``Execution.like`` for ``dj.simulate``, checked: schedules of ``schedule``'s workers."""
  for i, other in enumerate(like):
    if not isinstance(other, Schedule):
      raise TypeError(f"Execution.like[{i}] must be a dj.cluster.Schedule, got {type(other).__name__}.")
    if other.num_workers != schedule.num_workers:
      raise ValueError(f"Execution.like[{i}] has {other.num_workers} workers, but source has "
                       f"{schedule.num_workers}: one program serves schedules of the same workers.")
  return tuple(like)


def _check_sources(sources: tuple[Any, ...], kind: type = Schedule, what: str = "workers") -> tuple[Any, ...]:
  """``Runs.sources`` checked: schedules of type ``kind`` (``dj.simulate``'s; ``dj.simulate_gossip`` passes
  ``GossipSchedule``) of one set of ``what`` (workers, replicas)."""
  for i, other in enumerate(sources):
    if not isinstance(other, kind):
      raise TypeError(f"Runs.sources[{i}] must be a dj.cluster.{kind.__name__}, got {type(other).__name__}.")
    if other.num_workers != sources[0].num_workers:
      raise ValueError(f"Runs.sources[{i}] has {other.num_workers} {what}, but Runs.sources[0] has "
                       f"{sources[0].num_workers}: runs in one program follow schedules of the same {what}.")
  return sources


class _PlanSummary(NamedTuple):
  """What a schedule of ``Execution.like`` contributes to the shared program: its plan's sizes, not its tables."""
  sizes: ProgramSizes
  contributions: int  # most contributions per update
  batches: int  # most minibatches per contribution
  num_steps: int


def _summary(plan: StepPlan) -> _PlanSummary:
  return _PlanSummary(_program_sizes(plan), plan.upd_worker.shape[2], _max_batches(plan), plan.num_steps)


# The summaries of recent Execution.like schedules, by their plan arguments' digest: every run of a sweep names
# the same schedules, which are then planned once in a process, not once per run. Small tuples, so many.
_SUMMARIES_KEPT = 1024
_summaries: collections.OrderedDict[str, _PlanSummary] = collections.OrderedDict()


def _cached_summary(schedule: Schedule, *args: Any, **kwargs: Any) -> _PlanSummary:
  """``_summary(plan_steps(schedule, *args, **kwargs))``, planned once for equal arguments among the last many."""
  return _kept(_summaries, _SUMMARIES_KEPT, _plan_digest(schedule, args, kwargs),
               lambda: _summary(plan_steps(schedule, *args, **kwargs)))


def _shared_sizes(plan: StepPlan, others: Sequence[_PlanSummary], names: Sequence[str],
                  own_name: str = "source") -> ProgramSizes:
  """The sizes of one program for ``plan`` (``own_name``'s) and every plan summarized in ``others`` (planned
  with ``plan``'s lanes; ``names`` says where each came from): the largest of each. The most contributions per
  update and minibatches per contribution are not padded (they shape what a transformation is given, and the
  minibatch draws), so they must be equal."""
  own = _summary(plan)
  for name, other in zip(names, others, strict=True):
    for what, mine, theirs in (("contributions per update", own.contributions, other.contributions),
                               ("minibatches per contribution", own.batches, other.batches)):
      if theirs != mine:
        raise ValueError(
            f"{name} has up to {theirs} {what}, but {own_name} up to {mine}: schedules that share one "
            f"program have the same most {what}.")
  return ProgramSizes(*(max(values) for values in zip(own.sizes, *(o.sizes for o in others), strict=True)))


# Table fields with a column per update of the step, and per read of the step.
_UPDATE_COLUMNS = ("upd_index", "upd_pos", "upd_worker", "upd_batches", "upd_staleness", "read_begin", "read_end")
_READ_COLUMNS = ("read_worker", "read_slot", "read_group")


def _padded_tables(rows: dict[str, np.ndarray], sizes: ProgramSizes, num_workers: int) -> dict[str, np.ndarray]:
  """A chunk's tables widened to ``sizes`` with entries no step reads (updates and reads past their step's
  count; a padding read names worker ``num_workers``, which writes nothing)."""
  def widen(x: np.ndarray, width: int, fill: int) -> np.ndarray:
    pad = np.full((x.shape[0], width - x.shape[1]) + x.shape[2:], fill, x.dtype)
    return np.concatenate([x, pad], axis=1)

  out = dict(rows)
  for name in _UPDATE_COLUMNS:
    out[name] = widen(rows[name], sizes.max_len, 0)
  for name in _READ_COLUMNS:
    out[name] = widen(rows[name], sizes.max_reads, num_workers if name == "read_worker" else 0)
  return out


def _plan_digest(schedule: Schedule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
  """A digest of ``plan_steps``'s arguments. Arrays go in whole: digest reads their bytes, where a repr would elide
  long ones."""
  named = [part for name, value in sorted(kwargs.items()) for part in (name, value)]
  return _checkpoint.digest(_schedule_digest(schedule), *args, *named)


def _kept(store: collections.OrderedDict[str, Any], kept: int, key: str, make: Callable[[], Any]) -> Any:
  """``store[key]``, made by ``make()`` if absent; ``store`` keeps the ``kept`` most recently used."""
  if key in store:
    store.move_to_end(key)
    return store[key]
  value = store[key] = make()
  while len(store) > kept:
    store.popitem(last=False)
  return value


def _cached_plan(schedule: Schedule, *args: Any, **kwargs: Any) -> StepPlan:
  """``plan_steps(schedule, *args, **kwargs)``, planned once for equal arguments among the last few."""
  return _kept(_plans, _PLANS_KEPT, _plan_digest(schedule, args, kwargs), lambda: plan_steps(schedule, *args, **kwargs))


def _compile_key(*, loss_fn: Callable[..., Any], has_aux: bool, tx: Any, params: Any, opt_state: Any, data: Any,
                 batch_size: int, eval_fn: Any, sample_terms: Any, local_optimizer: Any, inputs: tuple[str, ...],
                 terms: Any, plan: StepPlan, sizes: ProgramSizes, options: dict[str, Any],
                 plugin_programs: dict[str, Any]) -> dict[str, Any] | None:
  """What the compiled chunk depends on beyond its arguments' shapes: ``{"chunk": key, "eval_fn": key}``, or
  ``None`` when a function calls back into Python (such programs are compiled afresh every run).

  The user's functions count by the programs they trace to (so a new ``optax.sgd(0.1)`` or a new closure
  of the same model is the same program, while a different learning rate literal is another); the plan
  by its static sizes; the options by value.
  """
  params_spec, state_spec = tree_like(params), tree_like(opt_state)
  batch = batch_like(data, batch_size)
  num_contrib = plan.upd_worker.shape[2]
  extra = _input_examples(params, inputs, num_contrib * _max_batches(plan) * batch_size, terms, num_contrib)
  programs = {
      "loss_fn": program_key(jax.value_and_grad(loss_fn, has_aux=has_aux), params_spec, batch),
      "tx": program_key(lambda g, s, p, e: tx.update(g, s, p, staleness=jnp.int32(0), stale_params=p,
                                                      worker=jnp.int32(0), **e), params_spec, state_spec,
                         params_spec, extra),
      "read_params": program_key(read_params, state_spec, params_spec, jnp.int32(0)),
      "eval_fn": None if eval_fn is None else program_key(eval_fn.params_only, params_spec) if isinstance(
          eval_fn, _ParamsEval) else program_key(eval_fn, params_spec, state_spec),
      "sample_terms": None if sample_terms is None else program_key(sample_terms, params_spec, batch),
      "local_optimizer": None if local_optimizer is None else program_key(
          local_optimizer.update, params_spec, local_optimizer.init(params), params_spec),
      "snapshot": program_key(_snapshot_params, state_spec) if _wants_snapshot(inputs) else None,
      **{name: program_key(fn, *args) for name, (fn, args) in plugin_programs.items()},
  }
  if any(key is False for key in programs.values()):
    return None
  plan_sizes = dict(num_workers=plan.num_workers, num_devices=plan.num_devices, num_contrib=num_contrib,
                    max_len=sizes.max_len, reads_per_update=sizes.reads_per_update)
  structure = tuple(_checkpoint.tree_digest(t, values=False) for t in (params, opt_state, data))
  chunk = ("simulate", tuple(sorted(programs.items())), structure, tuple(sorted(plan_sizes.items())),
           tuple(sorted(options.items())))
  return {"chunk": chunk, "eval_fn": (programs["eval_fn"], structure[0])}


@overload
def simulate(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, params: Any, data: Any,
             source: Schedule | delays_lib.DelayModel, *, num_updates: int | None = None, seed: int = 0,
             sampling: Sampling | None = None, worker: Worker | None = None, record: Record | None = None,
             checkpoint: Checkpoint | None = None, execution: Execution | None = None) -> SimulationResult: ...


@overload
def simulate(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, params: Any, data: Any,
             source: Schedule | delays_lib.DelayModel, *, num_updates: int | None = None, seed: Runs,
             sampling: Sampling | None = None, worker: Worker | None = None, record: Record | None = None,
             checkpoint: Checkpoint | None = None, execution: Execution | None = None) -> list[SimulationResult]: ...


def simulate(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    params: Any,
    data: Any,
    source: Schedule | delays_lib.DelayModel,
    *,
    num_updates: int | None = None,
    seed: int | Runs = 0,
    sampling: Sampling | None = None,
    worker: Worker | None = None,
    record: Record | None = None,
    checkpoint: Checkpoint | None = None,
    execution: Execution | None = None,
) -> SimulationResult | list[SimulationResult]:
  r"""Trains under a delay schedule exactly, computing independent gradients in parallel.

  The rule, for updates :math:`u = 0, \dots, U - 1` of the server parameters
  :math:`w_u` (version :math:`u`) and optimizer state :math:`s_u`: each worker
  :math:`m` contributing to update :math:`u` read version
  :math:`v = \text{read\_version}[u, m]`, i.e. the parameters
  :math:`\tilde w_{u,m} = w_v` (or what a transformation such as DANA says
  workers read), and computes there its contribution :math:`g_{u,m}`: by
  default (``dj.workers.Gradient``) the mean of :math:`n_{u,m}` =
  ``num_batches[u, m]`` fresh minibatch gradients of ``loss_fn``. The server
  then applies, in order,

  .. math::

    g_u = \sum_m \frac{n_{u,m}}{\sum_{m'} n_{u,m'}}\, g_{u,m}, \qquad
    (\Delta, s_{u+1}) = \text{tx.update}(g_u, s_u, w_u,\ \text{staleness}=\tau_u,\
    \text{stale\_params}=\tilde w_{u,m^*},\ \text{worker}=m^*), \qquad
    w_{u+1} = w_u + \Delta

  with :math:`m^*` the update's stalest contribution (the lowest worker index
  among equally stale ones) and :math:`\tau_u = u - \text{read\_version}[u,
  m^*]` (int32 scalars). An update without contributions changes nothing.
  On one device the result equals this sequential definition bit for bit,
  whatever ``chunk_size`` (and ``Execution.lanes`` up to rounding: see
  ``dj.Execution``); the same seed gives the same result. On a ``workers`` mesh of several devices the gradients are the
  same computations, but XLA compiles a device's share of a step's lanes
  into another program than all of them on one device: linear models agree
  bit for bit, nonlinear ones to a relative error of a few 1e-7 (4e-7 after
  200 updates of a tanh MLP; ``tests/runtime/test_device_count.py``).

  With a delay model as ``source``, update :math:`t` has one contribution,
  read at version :math:`\max(0, t - d_t)`, from worker :math:`t \bmod
  (\text{max\_delay} + 1)`; with ``dj.delays.per_leaf`` each leaf is read at
  its own version and ``staleness`` is a pytree like ``params``; with
  ``dj.delays.torn`` each block of coordinates is read at its own version
  (a torn read) and ``staleness`` is the stalest block's.

  Example::

    >>> import jax.numpy as jnp, numpy as np, optax
    >>> import delayjax as dj
    >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    >>> data = {"x": x, "y": x @ np.arange(4, dtype=np.float32)}
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(8), num_updates=500, seed=0)
    >>> result = dj.simulate(loss_fn, optax.sgd(0.05), jnp.zeros(4), data, schedule,
    ...                      sampling=dj.Sampling(batch_size=16))
    >>> bool(result.history.loss[-50:].mean() < 0.01), int(result.history.staleness.max()) > 0
    (True, True)

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, or ``(scalar, aux)`` (told
      apart by its output's structure; ``aux`` is discarded). ``batch`` is
      ``data`` indexed on its leading axis by the minibatch's indices.
    tx: an Optax transformation; it receives ``staleness``, ``stale_params``,
      ``worker`` and the runtime inputs it requests (``dj.runtime_inputs``:
      see ``dj.workers.Gradient``).
    params: the initial parameters (version 0).
    data: a pytree of arrays sharing a leading dimension (the examples), kept
      on every device.
    source: a ``dj.cluster.Schedule``, or a delay model from ``dj.delays``;
      ``None`` with ``seed=dj.Runs(sources=...)`` (a schedule per run).
    num_updates: updates to run; a schedule's first ``num_updates`` (default:
      all of it); required for a delay model.
    seed: an int in ``[0, 2**32)`` seeding the minibatches (and a delay
      model's delays), or ``dj.Runs(...)``: several runs in one program.
    sampling: ``dj.Sampling``: batch size and how workers draw minibatches.
    worker: what a worker computes (``dj.workers``): ``Gradient()`` (default)
      or ``LocalSteps(...)`` (local SGD, DiLoCo).
    record: ``dj.Record``: evaluations, history, callback, non-finite values
      (``"skip"`` is defined here).
    checkpoint: ``dj.Checkpoint``, or ``None``: no checkpoints.
    execution: ``dj.Execution``: mesh (a ``workers`` axis; workers are
      padded to a multiple of its size with idle ones), chunk size, lanes,
      memory limit.

  How it runs (the module docstring says more): the host plans *steps* of
  ``lanes`` independent gradients per device, then applies the updates whose
  gradients are in, in order; steps run ``chunk_size`` at a time in one
  compiled ``lax.scan``, cached: a later call with the same program neither
  traces nor compiles, whatever its seed and initial and data values.

  Returns:
    A :class:`SimulationResult` (``params``, ``opt_state``, ``history``,
    ``stats``); with ``seed=dj.Runs(...)``, a list of them, one per run.

  Raises:
    ValueError, TypeError: on bad arguments, naming the argument, before
    anything is allocated or compiled.
  """
  try:
    run = _prepare(loss_fn, tx, params, data, source, num_updates=num_updates, seed=seed, sampling=sampling,
                   worker=worker, record=record, checkpoint=checkpoint, execution=execution)
  except _LanesDiffer as differ:
    # Runs of their own schedules whose plans choose different lanes: one program per lane count, each run
    # planned as its separate call would be.
    results: list[Any] = [None] * seed.num_runs
    for lanes in sorted(set(differ.lanes)):
      group = [r for r, own in enumerate(differ.lanes) if own == lanes]
      part = Runs(seeds=[seed.seeds[r] for r in group],
                  hyperparams={name: [values[r] for r in group] for name, values in seed.hyperparams.items()} or None,
                  sources=[seed.sources[r] for r in group],
                  params=None if seed.params is None else [seed.params[r] for r in group])
      # Each lane count's runs are checkpointed in a folder of their own (one program, one checkpoint).
      own = None if checkpoint is None else dataclasses.replace(
          checkpoint, directory=os.path.join(os.fspath(checkpoint.directory), f"lanes-{lanes}"))
      for r, result in zip(group, simulate(
          loss_fn, tx, params, data, None, num_updates=num_updates, seed=part, sampling=sampling, worker=worker,
          record=record, checkpoint=own, execution=dataclasses.replace(execution or Execution(), lanes=lanes)),
          strict=True):
        results[r] = result
    return results
  carry, records = engine.run(_program(run), mesh=run.mesh, checkpoint=run.checkpoint,
                              checkpoint_name=_CHECKPOINT_FILE, callback=run.callback)
  return _results(run, carry, records)


# Documented under its public name: help() shows where users find it, not where it lives.
simulate.__module__ = "delayjax"


def _batched_runs(runs: Runs | None, mesh: Any,
                  source: Any) -> tuple[list[int] | None, dict[str, list[Any]], int | None]:
  """``(seeds, hyper-parameter values, number of runs)`` of ``seed=dj.Runs(...)`` (``(None, {}, None)`` for one
  run), refused where batched runs are not defined."""
  if runs is None:
    return None, {}, None
  check_runs_device(runs, mesh)
  seeds = list(runs.seeds)
  if runs.sources is not None and source is not None:
    raise ValueError(
        f"with seed=dj.Runs(sources=[...]) every run follows its own schedule: pass source=None, got "
        f"{type(source).__name__}.")
  if isinstance(source, delays_lib.DelayModel) and len(set(seeds)) > 1:
    raise ValueError(
        "several seeds with a delay model as source would draw different delays for every run; pass a "
        "Schedule (dj.runtime.schedule_from_delays(model, num_updates, seed)) to share one.")
  return seeds, runs.hyperparams, runs.num_runs


def _evaluated(num_updates: int, every: int | None, evaluates: bool) -> tuple[np.ndarray, np.ndarray]:
  """The evaluation points of a run of ``num_updates`` updates (``Record.every``'s, if it ``evaluates``; none
  otherwise), and whether each update ends at one."""
  points = history_lib.eval_points(num_updates, every) if evaluates else np.zeros(0, np.int64)
  flag = np.zeros(num_updates, bool)
  flag[points[points > 0] - 1] = True
  return points, flag


class _LanesDiffer(Exception):
  """Raised by ``_prepare`` for runs of their own schedules (``dj.Runs(sources=...)``) without
  ``Execution.lanes`` whose plans choose different lanes (``lanes``: each run's); ``simulate`` then computes each
  lane count's runs by a program of its own."""

  def __init__(self, lanes: list[int]):
    super().__init__(lanes)
    self.lanes = lanes


class _ServerRun(types.SimpleNamespace):
  """What one ``dj.simulate`` call has checked, planned and traced (its locals), handed from phase to phase."""


def _evaluation(record: Record) -> Callable[[Any, Any], Any] | None:
  """``Record.eval_fn`` as ``evaluate(params, opt_state)``, whether or not it takes the state."""
  eval_fn = record.eval_fn
  if eval_fn is None or record.eval_state:
    return eval_fn
  return _ParamsEval(eval_fn)


class _ParamsEval:
  """An evaluation of the parameters alone (``params_only``, the user's ``Record.eval_fn``), called as
  ``evaluate(params, opt_state)``. The initial evaluation calls ``params_only`` itself, compiled without the
  state: runs of different optimizers on one model share that program."""

  def __init__(self, params_only: Callable[[Any], Any]):
    self.params_only = params_only

  def __call__(self, params: Any, opt_state: Any) -> Any:
    return self.params_only(params)


def _svrg_epoch(inputs: tuple[str, ...], snapshot_every: int | None, full_batch_size: int | None,
                num_examples: int, batch_size: int) -> int | None:
  """SVRG's epoch length in updates when ``tx`` requests ``full_grad``; its options refused otherwise."""
  if "full_grad" in inputs:
    # Johnson & Zhang's m = 2n single-example updates per epoch, in minibatches.
    return snapshot_every or -(-2 * num_examples // batch_size)
  if snapshot_every is not None or full_batch_size is not None:
    name, value = ("snapshot_every", snapshot_every) if snapshot_every is not None else (
        "full_batch_size", full_batch_size)
    raise ValueError(
        f"Gradient.{name}={value} is only used when tx requests full_grad (dj.svrg); tx requests "
        f"{list(inputs) or 'no runtime inputs'}.")
  return None


def _prepare(loss_fn, tx, params, data, source, *, num_updates, seed, sampling, worker, record, checkpoint,
             execution) -> _ServerRun:
  """``dj.simulate``'s arguments checked, its schedule planned, its step traced and its carry made."""
  runtime = "dj.simulate"
  check_not_traced(runtime, params=params, data=data)
  seed, runs_option, sampling, record, execution = runtime_options(
      runtime, seed=seed, sampling=sampling, record=record, execution=execution, no_effect=("phases",), server=True)
  worker = check_worker(worker)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
  checkpoint = engine.checkpoint_arguments(checkpoint)
  checkpoint_dir = checkpoint.directory
  batch_size, num_examples = check_sampling(data, sampling.batch_size, sampling.scheme, sampling.shards)
  check_params(params)
  eval_fn, eval_every, callback = _evaluation(record), record.every, record.callback
  skip_nonfinite, keep_updates = record.skip_nonfinite, record.keeps_updates
  mesh, chunk_size, lanes, max_memory = execution.mesh, execution.chunk_size, execution.lanes, execution.max_memory
  shards, sampling = sampling.shards, sampling.scheme
  snapshot_every = full_batch_size = sample_terms = None
  if isinstance(worker, Gradient):
    snapshot_every, full_batch_size, sample_terms = worker.snapshot_every, worker.full_batch_size, worker.sample_terms
  if num_updates is not None:
    num_updates = check_int("num_updates", num_updates, minimum=1)
  num_devices = engine.check_mesh(mesh)
  seeds, hyper_values, runs = _batched_runs(runs_option, mesh, source)
  # Runs of schedules of their own (dj.Runs(sources=...)): the first one's plan fixes the lanes, all of them the
  # program's sizes; each run's tables come from its own plan.
  run_sources = None if runs_option is None or runs_option.sources is None else _check_sources(runs_option.sources)
  if run_sources is not None:
    source = run_sources[0]
  schedule, model_versions = _source_schedule(source, num_updates, seed)
  group_versions, leaf_groups = _leaf_reads(source, model_versions, params)
  # Each run's schedule (a run of its own schedule is cut at num_updates as the first is).
  schedules = [schedule] + [_source_schedule(other, num_updates, seed)[0] for other in (run_sources or ())[1:]]
  num_updates = schedule.num_updates
  num_workers = -(-schedule.num_workers // num_devices) * num_devices
  worker = worker.bind(schedule.num_workers, num_workers)
  worker_steps, keep_local_state = worker.local_steps, worker.sequential
  local_optimizer = getattr(worker, "optimizer", None)

  tx = optax.with_extra_args_support(tx)
  # The optimizer state's shapes are enough for every check and for the memory estimate: the state itself
  # is made only once the run is known to fit.
  opt_state = jax.eval_shape(tx.init, params)
  check_worker_capacity(opt_state, schedule.num_workers, "source")
  inputs = _check_runtime_inputs(opt_state, local=not worker.requests_allowed(), has_terms=sample_terms is not None)
  # A transformation that would do nothing on a schedule (a buffer it never fills, a delay window it never
  # reaches) is refused or warned about now. Under dj.per_contribution it counts contributions, else updates.
  for other in schedules:
    check_schedule(opt_state, max_staleness=int(other.max_staleness.max()) if other.max_staleness.size else 0,
                   num_contributions=other.num_contributions if "contribution_grads" in inputs else int(
                       np.count_nonzero(np.diff(other.offsets))))
  terms = None if sample_terms is None else _terms_spec(sample_terms, params, data, batch_size)
  if engine.takes_value(tx, params, opt_state, {"staleness": jnp.int32(0), "stale_params": params,
                                                 "worker": jnp.int32(0), **_input_examples(params, inputs, 1, terms)}):
    # A transformation that needs the loss (optax.contrib.reduce_on_plateau) is given each update's as value.
    inputs = inputs + ("value",)
  epoch = _svrg_epoch(inputs, snapshot_every, full_batch_size, num_examples, batch_size)
  def plan_options(other: Schedule) -> dict[str, Any]:
    # A contribution is computed once its update's epoch has begun, so every lane of a step computes
    # its snapshot gradient at the step's snapshot.
    return dict(local_steps=worker_steps, sequential_workers=keep_local_state,
                not_before=None if epoch is None else np.arange(other.num_updates) // epoch * epoch)

  # Each run's plan as its separate call would make it: with Execution.lanes, or with the lanes it chooses.
  plans = [_cached_plan(other, num_workers, num_devices, lanes, group_versions=group_versions, **plan_options(other))
           for other in schedules]
  if len({own.lanes for own in plans}) > 1:
    raise _LanesDiffer([own.lanes for own in plans])
  plan = plans[0]
  sizes = _program_sizes(plan)
  like = _check_like(execution.like or (), schedule)
  if group_versions is not None and like:
    raise ValueError(
        f"Execution.like is defined for a schedule or a delay model read whole; source {source!r} reads its "
        f"leaves or blocks at versions of their own.")
  others = [_cached_summary(other, num_workers, num_devices, plan.lanes, **plan_options(other)) for other in like]
  others += [_summary(other) for other in plans[1:]]
  if others:
    sizes = _shared_sizes(plan, others, [f"Execution.like[{i}]" for i in range(len(like))] + [
        f"Runs.sources[{i}]" for i in range(1, len(plans))], "source" if run_sources is None else "Runs.sources[0]")
  # The general step (an update may have no contribution) serves every schedule; the other is shorter.
  always_applies = all(bool(np.all(np.diff(other.offsets) > 0)) for other in (*schedules, *like))
  longest = max([plan.num_steps] + [other.num_steps for other in others])
  if chunk_size is None:
    num_chunks = max(1, -(-longest // 256))
    chunk_size = _shared_length(-(-longest // num_chunks))
  # Runs of their own schedules run until the longest plan's last step.
  num_chunks = -(-max(other.num_steps for other in plans) // chunk_size)

  # The default worker's minibatches are drawn on the host, a chunk at a time (_sampling.lane_examples), where
  # the table they make stays small; batched runs that share their tables (one schedule, several seeds) draw
  # their own in the step, as a plug-in does.
  host_draws = isinstance(worker, Gradient) and (runs is None or run_sources is not None) and (
      chunk_size * plan.lanes * num_devices * _max_batches(plan) * batch_size * 4 * (runs or 1) <= _HOST_DRAWS_BYTES)
  if sampling == "shard":
    shard_rows, shard_sizes = shard_table(shards, num_examples, schedule.num_workers, num_workers)
  else:
    shard_rows, shard_sizes = np.zeros((num_workers, 1), np.int32), np.ones(num_workers, np.int32)

  run_evals = [_evaluated(other.num_updates, eval_every, eval_fn is not None) for other in schedules]
  eval_points, eval_flag = run_evals[0]
  run_params = [params] * (runs or 1) if runs_option is None or runs_option.params is None else _check_run_params(
      runs_option.params, params)

  # The gradients' stale parameters are buffered only for a tx whose result depends on them.
  keep_stale = _uses_stale_params(tx, params, inputs, plan.upd_worker.shape[2] * _max_batches(plan) * batch_size,
                                  terms, plan.upd_worker.shape[2])

  has_aux, plugin_programs = None, {}
  payload = worker.payload_like(params, inputs, _max_batches(plan) * batch_size, terms)
  if payload is None:
    # A plug-in of the user's: its push is traced (so is the loss) for its payload's shapes.
    has_aux = loss_has_aux(loss_fn, params, data, batch_size)
    payload, plugin_programs = _plugin_programs(worker, loss_fn, has_aux, params, data, inputs, num_examples,
                                                batch_size, sampling, _max_batches(plan), full_batch_size, shard_rows)

  def initial(buffer_size: int, shapes: bool = False) -> Any:
    if shapes:
      one = _initial_carry(params, opt_state, plan, buffer_size, sizes.num_slots, payload, leaf_groups,
                           worker.init_state(params) if keep_local_state else None, keep_stale, shapes=True)
      return one if runs is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct((runs,) + x.shape, x.dtype), one)
    states = [tx.init(own) for own in run_params] if runs_option and runs_option.params else [opt_state] * len(
        run_params)
    carries = [_initial_carry(own, state, plans[r % len(plans)], buffer_size, sizes.num_slots, payload, leaf_groups,
                              worker.init_state(own) if keep_local_state else None, keep_stale)
               for r, (own, state) in enumerate(zip(run_params, _run_states(states, hyper_values), strict=True))]
    # Several runs: every leaf of the carry gains a leading run axis.
    return carries[0] if runs is None else jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *carries)

  # Sized from shapes, before anything is allocated: a run too large for the device is refused, not killed.
  memory = _memory_terms(initial(sizes.buffer_size, shapes=True), data, num_devices)
  limit = engine.memory_limit(max_memory, mesh)
  if limit is not None and sum(memory.values()) > limit[0] and sizes.buffer_size > plan.buffer_size:
    # The shared buffer size does not fit where the plan's own may: this run's program is its own.
    sizes = sizes._replace(buffer_size=plan.buffer_size)
    memory = _memory_terms(initial(sizes.buffer_size, shapes=True), data, num_devices)
  engine.check_memory(runtime, memory, limit, dict(_MEMORY_TERMS))
  opt_state = tx.init(params)
  # The loss is traced only now, after every check that can refuse the run (but a plug-in's own payload).
  if has_aux is None:
    has_aux = loss_has_aux(loss_fn, params, data, batch_size)
  step = _step_function(
      keep_stale=keep_stale, loss_fn=loss_fn, has_aux=has_aux, tx=tx, params=params, opt_state=opt_state,
      eval_fn=eval_fn, num_examples=num_examples, batch_size=batch_size, sampling=sampling, plan=plan,
      skip_nonfinite=skip_nonfinite, always_applies=always_applies,
      distributed=mesh is not None, inputs=inputs, sizes=sizes, worker=worker, max_batches=_max_batches(plan),
      full_batch_size=full_batch_size, leaf_groups=leaf_groups, host_draws=host_draws)
  carry = initial(sizes.buffer_size)
  run = _ServerRun(**{name: value for name, value in locals().items() if name != "initial"})
  run.compile_key, run.fingerprint = _keys(run)
  return run


def _keys(run: _ServerRun) -> tuple[Any, Any]:
  """A prepared run's compile-cache key and, with a checkpoint, its identity (both trace its functions)."""
  (loss_fn, has_aux, tx, params, opt_state, data, batch_size, eval_fn, sample_terms, local_optimizer, inputs, terms,
   plan, sizes, keep_stale, num_examples, sampling, skip_nonfinite, schedule, worker_steps, full_batch_size,
   leaf_groups, keep_local_state, checkpoint_dir, seed, chunk_size, num_workers, eval_every, shards, epoch,
   group_versions) = (getattr(run, name) for name in (
       "loss_fn", "has_aux", "tx", "params", "opt_state", "data", "batch_size", "eval_fn", "sample_terms",
       "local_optimizer", "inputs", "terms", "plan", "sizes", "keep_stale", "num_examples", "sampling",
       "skip_nonfinite", "schedule", "worker_steps", "full_batch_size", "leaf_groups", "keep_local_state",
       "checkpoint_dir", "seed", "chunk_size", "num_workers", "eval_every", "shards", "epoch", "group_versions"))
  # Traced only now, after every check that can refuse the run. The compiled chunk is shared by every run whose
  # program is the same: a sweep over seeds, initial parameters, data values or hyper-parameters held in the
  # optimizer state compiles once.
  compile_key = _compile_key(
      loss_fn=loss_fn, has_aux=has_aux, tx=tx, params=params, opt_state=opt_state, data=data,
      batch_size=batch_size, eval_fn=eval_fn, sample_terms=sample_terms, local_optimizer=local_optimizer,
      inputs=inputs, terms=terms, plan=plan, sizes=sizes, options=dict(
          keep_stale=keep_stale, num_examples=num_examples, batch_size=batch_size, sampling=sampling,
          skip_nonfinite=skip_nonfinite, always_applies=run.always_applies,
          inputs=inputs, local_steps=None if worker_steps is None else tuple(worker_steps.tolist()),
          max_batches=_max_batches(plan), terms=str(terms), full_batch_size=full_batch_size,
          leaf_groups=leaf_groups, keep_local_state=keep_local_state, host_draws=run.host_draws),
      plugin_programs=run.plugin_programs)
  # Only a checkpoint needs the run's identity (it traces tx and loss_fn and hashes the data).
  fingerprint = "" if checkpoint_dir is None else _fingerprint(
      run.schedules, tx=tx, loss_fn=loss_fn, params=params, opt_state=opt_state, data=data, eval_fn=eval_fn,
      local_optimizer=local_optimizer, inputs=inputs, batch_size=batch_size, terms=terms, plan=plan,
      plugin_programs=run.plugin_programs, seed=seed, sampling=sampling, chunk_size=chunk_size,
      num_workers=num_workers, lanes=plan.lanes,
      skip_nonfinite=skip_nonfinite, eval_every=eval_every, has_eval=eval_fn is not None,
      shards=None if shards is None else _fingerprint_shards(shards),
      # Only when used, so the options of runs without them stay as they were.
      **({} if worker_steps is None else {"local_steps": tuple(worker_steps.tolist())}),
      **({"keep_local_state": True} if keep_local_state else {}),
      # Several runs in one program: their seeds, initial parameters and hyper-parameters are the run's too.
      **({} if run.runs is None else {"runs": (tuple(run.seeds), _checkpoint.tree_digest(run.run_params, values=True),
                                               _checkpoint.digest(sorted(run.hyper_values.items())))}),
      # The carry's buffers are sized for every schedule of Execution.like: a checkpoint holds them at that size.
      **({"program_sizes": tuple(run.sizes)} if run.like else {}),
      **({} if epoch is None else {"snapshot_every": epoch, "full_batch_size": full_batch_size}),
      **({} if group_versions is None else {
          "group_versions": hashlib.sha256(np.ascontiguousarray(group_versions).tobytes()).hexdigest(),
          "leaf_groups": leaf_groups.identity()}))

  return compile_key, fingerprint


def _program(run: _ServerRun) -> engine.Program:
  """The engine's program of a prepared run: its chunk tables, how its outputs become history rows, its step."""
  (plan, sizes, num_workers, eval_flag, epoch, chunk_size, keep_updates, runs, skip_nonfinite, eval_fn, params,
   num_updates, num_chunks, compile_key, carry, data, shard_rows, shard_sizes, seed, seeds, step,
   fingerprint) = (getattr(run, name) for name in (
       "plan", "sizes", "num_workers", "eval_flag", "epoch", "chunk_size", "keep_updates", "runs",
       "skip_nonfinite", "eval_fn", "params", "num_updates", "num_chunks", "compile_key", "carry", "data",
       "shard_rows", "shard_sizes", "seed", "seeds", "step", "fingerprint"))

  plans, run_evals = run.plans, run.run_evals
  own_tables = run.run_sources is not None
  max_batches = _max_batches(plan)

  def draws(rows: dict[str, np.ndarray], seed: int) -> np.ndarray:
    return lane_examples(
        rows["lane_active"], rows["lane_draw"], rows["lane_worker"], max_batches, update=rows["lane_update"],
        seed=seed, num_examples=run.num_examples, batch_size=run.batch_size, sampling=run.sampling,
        shard_rows=shard_rows, shard_sizes=shard_sizes)

  def plan_tables(plan: StepPlan, eval_flag: np.ndarray, chunk: int) -> dict[str, np.ndarray]:
    """A plan's rows of the chunk (its minibatches are drawn by the caller, :func:`draws`)."""
    rows = _padded_tables(plan.tables(chunk * chunk_size, chunk_size), sizes, num_workers)
    valid = np.arange(sizes.max_len) < rows["upd_count"][:, None]
    rows["upd_eval"] = eval_flag[rows["upd_index"]] & valid
    if epoch is not None:
      rows["upd_refresh"] = (rows["upd_index"] % epoch == 0) & valid
      rows["snap_fresh"] = plan.version_of_step(chunk * chunk_size, chunk_size) % epoch == 0
    return rows

  def tables(chunk: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    if own_tables:
      # Each run's rows from its own plan, stacked on a leading run axis.
      rows = jax.tree.map(lambda *xs: np.stack(xs), *(
          plan_tables(own, flag, chunk) for own, (_, flag) in zip(plans, run_evals, strict=True)))
      if run.host_draws:
        # The minibatches of the runs of one seed drawn together, their steps one after the other: a draw's
        # host work is per call (a quarter of the calls for experiments/dai_staleness's four bounds per seed).
        rows["lane_examples"] = np.zeros(rows["lane_active"].shape + (max_batches, run.batch_size), np.int32)
        for own_seed in dict.fromkeys(seeds):
          members = np.flatnonzero(np.asarray(seeds) == own_seed)
          flat = {k: rows[k][members].reshape((-1,) + rows[k].shape[2:])
                  for k in ("lane_active", "lane_draw", "lane_worker", "lane_update")}
          rows["lane_examples"][members] = draws(flat, own_seed).reshape(
              (len(members),) + rows["lane_examples"].shape[1:])
    else:
      rows = plan_tables(plan, eval_flag, chunk)
      if run.host_draws:
        rows["lane_examples"] = draws(rows, seed)
    return ({k: v for k, v in rows.items() if k.startswith("lane_")},
            {k: v for k, v in rows.items() if not k.startswith("lane_")})

  def collect_own(tables: Any, outputs: Any) -> dict[str, Any]:
    """A chunk's rows for runs of their own tables: the lists as ``(run, update, worker)`` triples, and the
    losses and metrics as one array (pytree) per run, as their plans' updates differ in number."""
    (lane, tab), (loss, metrics, finite, rejected) = tables, jax.tree.map(engine.host, outputs)
    valid = np.arange(sizes.max_len) < tab["upd_count"][..., None]
    run_of, step_of, lane_of = np.nonzero(lane["lane_active"] & ~finite)
    rows = {"nonfinite": np.stack([run_of, lane["lane_update"][run_of, step_of, lane_of],
                                   lane["lane_worker"][run_of, step_of, lane_of]], axis=1).astype(np.int64)}
    if keep_updates:
      rows["loss"] = tuple(loss[r][valid[r]] for r in range(runs))
    if skip_nonfinite:
      run_of, step_of, row_of = np.nonzero(valid & (rejected >= 0))
      rows["skipped"] = np.stack([run_of, tab["upd_index"][run_of, step_of, row_of],
                                  rejected[run_of, step_of, row_of]], axis=1).astype(np.int64)
    if eval_fn is not None:
      rows["metrics"] = tuple(jax.tree.map(lambda x: x[r][tab["upd_eval"][r]], metrics) for r in range(runs))
    return rows

  def collect(chunk: int, tables: Any, outputs: Any) -> dict[str, Any]:
    """The chunk's rows, each with a run axis after the row axis (``(run, update, worker)`` triples for the
    lists), whether or not the runs were batched."""
    if not keep_updates:
      # The chunk's per-update losses stay on the device, unread: the host keeps no per-update rows.
      outputs = ((), *outputs[1:])
    if own_tables:
      return collect_own(tables, outputs)
    (lane, tab), outputs = tables, jax.tree.map(
        lambda x: engine.host(x) if runs else engine.host(x)[None], outputs)
    loss, metrics, finite, rejected = outputs
    valid = np.arange(sizes.max_len) < tab["upd_count"][:, None]
    run, step_of, lane_of = np.nonzero(lane["lane_active"] & ~finite)
    rows = {"nonfinite": np.stack([run, lane["lane_update"][step_of, lane_of], lane["lane_worker"][step_of, lane_of]],
                                  axis=1).astype(np.int64)}
    if keep_updates:
      rows["loss"] = np.moveaxis(loss, 0, -1)[valid]
    if skip_nonfinite:
      run, step_of, row_of = np.nonzero(valid & (rejected >= 0))
      rows["skipped"] = np.stack([run, tab["upd_index"][step_of, row_of], rejected[run, step_of, row_of]],
                                 axis=1).astype(np.int64)
    if eval_fn is not None:
      rows["metrics"] = jax.tree.map(lambda x: np.moveaxis(x, 0, 2)[tab["upd_eval"]], metrics)
    return rows

  num_runs = runs or 1
  metric_shapes = None if eval_fn is None else jax.eval_shape(eval_fn, params, run.opt_state)
  records_like = {"nonfinite": np.zeros((0, 3), np.int64)}
  if keep_updates:
    records_like["loss"] = tuple(np.zeros(0, np.float32) for _ in range(runs)) if own_tables else np.zeros(
        (0, num_runs), np.float32)
  if skip_nonfinite:
    records_like["skipped"] = np.zeros((0, 3), np.int64)
  if eval_fn is not None:
    records_like["metrics"] = tuple(jax.tree.map(lambda s: np.zeros((0,) + s.shape, s.dtype), metric_shapes)
                                    for _ in range(runs)) if own_tables else jax.tree.map(
        lambda s: np.zeros((0, num_runs) + s.shape, s.dtype), metric_shapes)

  def progress(chunk: int) -> dict[str, Any]:
    # Runs of their own schedules: the updates of all of them.
    done = sum(int(np.sum(own.upd_count[:(chunk + 1) * chunk_size])) for own in plans)
    total = sum(other.num_updates for other in run.schedules) if own_tables else num_updates
    return {"updates_done": done, "num_updates": total, "chunk": chunk, "num_chunks": num_chunks}

  def initial_rows(carry: Any) -> dict[str, Any]:
    if own_tables:
      # The runs' carries, each evaluated by the single run's program (as the engine computes their chunks):
      # each equals the separate run's evaluation bit for bit.
      return {"metrics": tuple(jax.tree.map(lambda x: engine.host(x)[None], evaluate(c)) for c in carry)}
    metrics = evaluate(carry)
    return {"metrics": jax.tree.map(lambda x: engine.host(x)[None] if runs else engine.host(x)[None, None], metrics)}

  batched = runs is not None and not own_tables
  params_only = eval_fn.params_only if isinstance(eval_fn, _ParamsEval) else None
  initial_fn = eval_fn if params_only is None else params_only
  # The size of the model a step updates (one run's parameters), which chooses the compile options.
  step_entries = engine.entries(params)
  jitted_eval = None if eval_fn is None else engine.cached(
      None if compile_key is None else ("eval", compile_key["eval_fn"], batched, params_only is None),
      lambda: engine.jit_like_chunk(jax.vmap(initial_fn) if batched else initial_fn, step_entries, run.mesh))

  def evaluate(carry: Any) -> Any:
    return jitted_eval(carry[0]) if params_only is not None else jitted_eval(carry[0], carry[1])

  return engine.Program(
      carry=carry, carry_specs=CARRY_SPECS,
      constants=(data, (shard_rows, shard_sizes), np.uint32(seed) if runs is None else np.asarray(seeds, np.uint32)),
      constant_specs=(P(), (P(AXIS), P(AXIS)), P()), runs=runs, constant_run_axes=(None, (None, None), 0),
      table_run_axes=0 if own_tables else None, step=step, table_specs=(P(None, AXIS), P()),
      output_specs=(P(), P(), P(), P()), num_chunks=num_chunks, tables=tables, collect=collect,
      records_like=records_like, progress=progress, fingerprint=fingerprint,
      check=lambda carry: _all_finite(_inexact(carry[:2])),
      cache_key=None if compile_key is None else compile_key["chunk"], step_entries=step_entries,
      # A single run's rows, as its history has them (no run axis); batched runs keep theirs.
      rows_view=None if runs else lambda rows: {k: v if k == "nonfinite" else jax.tree.map(lambda x: x[:, 0], v)
                                                for k, v in rows.items()},
      initial=None if eval_fn is None else initial_rows)


def _results(run: _ServerRun, carry: Any, records: dict[str, Any]) -> SimulationResult | list[SimulationResult]:
  """A finished run's result (or one per run of ``dj.Runs``): its final state, history and statistics."""
  (chunk_size, keep_updates, eval_fn, skip_nonfinite, runs, seeds, num_workers, num_devices, num_chunks, memory,
   epoch, schedules, plans, run_evals) = (getattr(run, name) for name in (
       "chunk_size", "keep_updates", "eval_fn", "skip_nonfinite", "runs", "seeds", "num_workers", "num_devices",
       "num_chunks", "memory", "epoch", "schedules", "plans", "run_evals"))
  own_tables = run.run_sources is not None

  def run_history(r: int) -> History:
    # Runs of their own schedules keep their own rows; batched runs of one schedule a column each.
    schedule, plan, (eval_points, _) = (schedules[r], plans[r], run_evals[r]) if own_tables else (
        schedules[0], plans[0], run_evals[0])
    num_updates, times = schedule.num_updates, np.asarray(schedule.time)
    steps = np.zeros(num_chunks * chunk_size, np.int64)
    steps[:plan.num_steps] = plan.upd_count
    updates_per_chunk = steps.reshape(num_chunks, chunk_size).sum(axis=1)

    def of_run(pairs):
      return history_lib.sorted_pairs(pairs[pairs[:, 0] == r][:, 1:])

    def column(record):
      return record[r] if own_tables else jax.tree.map(lambda x: x[:, r], record)

    hist = History(
        update=np.arange(num_updates if keep_updates else 0, dtype=np.int64),
        time=times.copy() if keep_updates else np.zeros(0, np.float64),
        loss=column(records["loss"]).astype(np.float32) if keep_updates else np.zeros(0, np.float32),
        staleness=schedule.max_staleness if keep_updates else np.zeros(0, np.int64),
        eval_update=eval_points,
        eval_time=np.where(eval_points > 0, times[np.maximum(eval_points - 1, 0)], 0.0),
        eval_metrics=None if eval_fn is None else column(records["metrics"]),
        nonfinite=of_run(records["nonfinite"]),
        skipped=of_run(records["skipped"]) if skip_nonfinite else np.zeros((0, 2), np.int64),
        nonfinite_state=history_lib.chunk_span(
            updates_per_chunk, records["check"] if runs is None else records["check"][:, r]),
    )
    history_lib.nonfinite_report("dj.simulate" if runs is None else f"dj.simulate (run {r}, seed {seeds[r]})",
                                 hist.nonfinite, hist.skipped if skip_nonfinite else None, hist.nonfinite_state,
                                 can_skip=not skip_nonfinite)
    return hist

  def run_stats(r: int) -> dict[str, Any]:
    plan, schedule = (plans[r], schedules[r]) if own_tables else (plans[0], schedules[0])
    stats = {
        "num_waves": plan.num_waves,
        "mean_wave_length": schedule.num_updates / plan.num_waves,
        "num_steps": plan.num_steps,
        "lanes": plan.lanes,
        "lane_utilization": plan.lane_utilization(),
        "num_slots": plan.num_slots,
        "num_workers": num_workers,
        "num_devices": num_devices,
        "chunk_size": chunk_size,
        "num_chunks": num_chunks,
        "memory": {**memory, "total": sum(memory.values())},
    }
    if epoch is not None:
      stats["snapshot_every"] = epoch
    return stats

  if runs is None:
    return SimulationResult(carry[0], carry[1], run_history(0), run_stats(0))
  return [SimulationResult(*finals, run_history(r), run_stats(r))
          for r, finals in enumerate(_run_rows((carry[0], carry[1]), runs))]


def _run_rows(tree: Any, runs: int) -> list[Any]:
  """Each run's part of ``tree`` (every leaf has a leading run axis), cut on the host and placed again: slicing
  on the device would compile a program per leaf's shape and dtype, a tenth of a second each (a key array, which
  the host cannot hold, is sliced there)."""
  put = engine.placer(None)

  def rows(x: Any) -> list[Any]:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return [x[r] for r in range(runs)]
    value = engine.host(x)
    return [put(value[r], None) for r in range(runs)]

  leaves, treedef = jax.tree.flatten(tree)
  columns = [rows(x) for x in leaves]
  return [treedef.unflatten([column[r] for column in columns]) for r in range(runs)]


# What each term of the run's memory is, in the carry's order (see CARRY_SPECS), and what shrinks it.
_MEMORY_TERMS = (
    ("parameters", "a smaller model"),
    ("optimizer state", "a transformation with less state (per-worker tables grow with num_workers)"),
    ("read parameter copies", "fewer workers per device (a mesh over more devices) or a schedule whose reads "
                              "spread over fewer versions (stats['num_slots'] copies per worker)"),
    ("lane parameters", "fewer lanes"),
    ("gradient buffer", "fewer lanes or a schedule with shorter waits between a gradient and its update"),
    ("stale-parameter buffer", "fewer lanes, or a tx that does not read stale_params"),
    ("loss buffer", "fewer lanes"),
    ("finiteness buffer", "fewer lanes"),
    ("snapshot flag", "fewer flags"),
    ("local optimizer states", "keep_local_state=False or fewer workers per device"),
)


def _memory_terms(carry: tuple[Any, ...], data: Any, num_devices: int) -> dict[str, int]:
  """Bytes per device of what the run keeps on the devices, by term (from the carry's shapes)."""
  return engine.memory_terms({name: (part, spec == P(AXIS)) for (name, _), spec, part in zip(
      _MEMORY_TERMS, CARRY_SPECS, carry, strict=True)}, data, num_devices)


def _initial_carry(params: Any, opt_state: Any, plan: StepPlan, size: int, num_slots: int, payload: Any,
                   leaf_groups: LeafGroups | BlockGroups | None, worker_state: Any,
                   keep_stale: bool, shapes: bool = False) -> tuple[Any, ...]:
  """The server runtime's carry before the first step (host arrays; see ``CARRY_SPECS``).

  ``payload``: the shapes of one contribution's payload (``_payload_shapes``).
  ``worker_state``: one worker's own initial state (a sequential worker
  plug-in's ``init_state``), which every worker starts from, or ``None``. ``keep_stale``: whether to buffer the
  gradients' stale parameters (an empty tuple otherwise). ``size``: rows of the gradient buffer; ``num_slots``:
  read parameters kept per worker (the plan's, or more for a program shared with other schedules).
  ``shapes``: only the carry's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves; nothing allocated).
  """
  def dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype

  def buffer(x, *lead):
    if shapes:
      return jax.ShapeDtypeStruct(lead + np.shape(x), dtype(x))
    return np.zeros(lead + np.shape(x), dtype(x))

  slots = jax.tree.map(lambda x: buffer(x, plan.num_workers, num_slots), params)
  first = plan.tables(0, 1)
  stale_args = (opt_state, params, slots, first["lane_worker"][0], first["lane_worker"][0], first["lane_slot"][0],
                first["lane_fresh"][0])
  if shapes:
    # Only the memory check reads the shapes: each lane's parameters are the read parameters (shaped like
    # params), one row per lane. Tracing read_params for them cost every run about 0.07 s.
    lanes = first["lane_worker"].shape[1]
    first_stale = jax.tree.map(lambda x: jax.ShapeDtypeStruct((lanes,) + np.shape(x), dtype(x)), params)
  else:
    first_stale = _first_lanes(*stale_args, leaf_groups)
  carry = (params, opt_state, slots, first_stale,
           jax.tree.map(lambda x: buffer(x, size), payload),
           jax.tree.map(lambda x: buffer(x, size), params) if keep_stale else (),
           buffer(np.float32(0), size), buffer(np.bool_(True), size), np.asarray(False),
           () if worker_state is None else jax.tree.map(lambda x: buffer(x, plan.num_workers), worker_state))
  if shapes:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype(x)), carry)
  # The buffers of losses start at 0 and the finiteness flags at True; the workers' states at worker_state.
  carry = list(carry)
  carry[7] = np.ones(size, bool)
  if worker_state is not None:
    carry[9] = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (plan.num_workers,) + np.shape(x)).copy(),
                            worker_state)
  return tuple(carry)


def _plugin_programs(worker: Worker, loss_fn: Callable[..., Any], has_aux: bool, params: Any, data: Any,
                     inputs: tuple[str, ...], num_examples: int, batch_size: int, sampling: str, max_batches: int,
                     full_batch_size: int | None, shard_rows: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
  """A plug-in's payload shapes, from ``worker.contribute`` traced abstractly, and its programs (``{name:
  (fn, example args)}``: the push, and ``at_update`` if it learns there), which the run's identity and
  compile key count like ``loss_fn``'s."""
  lanes = Lanes(loss_fn=loss_fn, has_aux=has_aux, worker=worker, inputs=inputs, num_examples=num_examples,
                batch_size=batch_size, sampling=sampling, max_batches=max_batches, full_batch_size=full_batch_size)
  scalar = jax.ShapeDtypeStruct((), np.int32)
  args = (engine.shapes(data), jax.ShapeDtypeStruct((), np.uint32), engine.shapes(params),
          engine.shapes(params) if _wants_snapshot(inputs) else (), scalar, scalar, scalar, scalar,
          jax.ShapeDtypeStruct(shard_rows.shape[1:], np.int32), scalar, engine.shapes(worker.init_state(params)))
  payload = jax.eval_shape(lanes.push, *args)[1]
  if not isinstance(payload, dict) or "grad" not in payload and not worker.learns_at_update:
    raise TypeError(
        f"{type(worker).__name__}.contribute must return (loss, payload, state) with payload a dict holding "
        f"'grad' (or define at_update); got payload {jax.tree.structure(payload)}.")
  programs = {"worker": (lanes.push, args)}
  if worker.learns_at_update:
    programs["worker at_update"] = (
        lambda seed, p, payload, i: lanes.at_update(seed, p, [payload], i, i[None], [i]),
        (jax.ShapeDtypeStruct((), np.uint32), engine.shapes(params), payload, scalar))
  return payload, programs


# Module level, so that its compiled programs are reused from run to run.
_first_stale = jax.jit(_lanes_stale, static_argnums=7)


def _first_lanes(opt_state: Any, params: Any, slots: Any, rows: np.ndarray, workers: np.ndarray, slot: np.ndarray,
                 fresh: np.ndarray, leaf_groups: LeafGroups | BlockGroups | None) -> Any:
  """:func:`_lanes_stale` for the first step, on the host.

  Unless a state of ``tx`` defines ``read_params`` (or the reads are in groups), a lane's parameters are
  ``params`` themselves (``fresh``) or its worker's slot: a selection, which NumPy makes exactly, where the
  compiled ``_first_stale`` cost a compilation per optimizer state's structure (0.3 to 0.8 s each).
  """
  if leaf_groups is not None or defines_read(opt_state):
    return jax.device_get(_first_stale(opt_state, params, slots, rows, workers, slot, fresh, leaf_groups))
  take = np.asarray(fresh)[:, 0]

  def lane(p, s):
    # Indexed as JAX indexes: a negative index from the end, then clamped into range (padding lanes).
    held = s[_clamped(rows, s.shape[0]), _clamped(slot, s.shape[1])]
    return np.where(_lead(take, held), np.asarray(p)[None], held)

  return jax.tree.map(lane, params, slots)


def _clamped(index: np.ndarray, size: int) -> np.ndarray:
  index = np.asarray(index)
  return np.clip(np.where(index < 0, index + size, index), 0, size - 1)


def _max_batches(plan: StepPlan) -> int:
  """The most minibatches one contribution draws (every lane draws that many, masked beyond its own)."""
  return int(plan.lane_batches.max()) if plan.lane_batches.size else 1


def _fingerprint_shards(shards: Sequence[Any]) -> str:
  h = hashlib.sha256()
  for s in shards:
    h.update(np.ascontiguousarray(np.asarray(s, np.int64)).tobytes() + b"|")
  return h.hexdigest()


def _step_function(*, keep_stale: bool, loss_fn, has_aux, tx, params, opt_state, eval_fn, num_examples, batch_size,
                   sampling, plan: StepPlan, sizes: ProgramSizes, skip_nonfinite, always_applies, distributed: bool,
                   inputs: tuple[str, ...], worker: Worker, max_batches: int, full_batch_size: int | None,
                   leaf_groups: LeafGroups | BlockGroups | None, host_draws: bool):
  """The server runtime's step (see ``_engine.Program.step``): compute a vector of gradients, then apply,
  in order, the updates whose gradients are all computed. What a lane computes is ``_lanes.Lanes``'.
  ``host_draws``: the lanes take their first minibatches from the tables' ``lane_examples``."""
  # Only sizes are taken from the plan: the step (kept in the compile cache) must not hold its tables.
  num_workers = plan.num_workers
  per_device = num_workers // plan.num_devices
  num_contrib = plan.upd_worker.shape[2]
  max_len = sizes.max_len
  metric_shapes = jax.eval_shape(eval_fn, params, opt_state) if eval_fn is not None else ()
  svrg = _wants_snapshot(inputs)
  per_example = "sample_indices" in inputs
  per_contribution = "contribution_grads" in inputs
  keep_local_state = worker.sequential
  learns_at_update = worker.learns_at_update
  # A static bound on the reads after one update: unrolled when small (the
  # common case), a loop otherwise.
  reads_per_update = sizes.reads_per_update
  lanes = Lanes(loss_fn=loss_fn, has_aux=has_aux, worker=worker, inputs=inputs, num_examples=num_examples,
                batch_size=batch_size, sampling=sampling, max_batches=max_batches, full_batch_size=full_batch_size)
  gather = functools.partial(_gather, distributed)
  c = types.SimpleNamespace(**{name: value for name, value in locals().items() if name in _STEP_CONFIG})
  return functools.partial(_server_step, c)


def _gather(distributed: bool, tree: Any) -> Any:
  """All-gathers the lane axis of every leaf, with one collective per dtype.

  Each collective is a rendezvous of all devices; a handful of them per
  step would cost more than the data they move.
  """
  if not distributed:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out = [None] * len(leaves)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    groups.setdefault(jnp.dtype(x.dtype), []).append(i)
  for dtype, members in groups.items():
    wire = jnp.uint8 if dtype == jnp.bool_ else dtype
    flat = jnp.concatenate([leaves[i].reshape(leaves[i].shape[0], -1).astype(wire) for i in members], axis=1)
    flat = jax.lax.all_gather(flat, AXIS, axis=0, tiled=True)
    start = 0
    for i in members:
      size = math.prod(leaves[i].shape[1:])
      out[i] = flat[:, start:start + size].reshape((flat.shape[0],) + leaves[i].shape[1:]).astype(dtype)
      start += size
  return jax.tree.unflatten(treedef, out)


def _store(buf: Any, at: Any, x: Any) -> Any:
  return jax.lax.dynamic_update_slice_in_dim(buf, x, at, axis=0)


# What the server step reads of its configuration (set by _step_function; a step is traced once).
_STEP_CONFIG = (
    "keep_stale", "tx", "eval_fn", "skip_nonfinite", "always_applies", "inputs", "leaf_groups", "num_workers",
    "per_device", "num_contrib", "max_len", "metric_shapes", "svrg", "per_example", "per_contribution",
    "keep_local_state", "learns_at_update", "reads_per_update", "lanes", "gather", "distributed", "host_draws")



class _StepContext(NamedTuple):
  """What one step gives each of its updates: its tables, the constants, the buffers, the read helpers."""

  tab: Any
  data: Any
  seed: Any
  payload_buf: Any
  stale_buf: Any
  loss_buf: Any
  finite_buf: Any
  local_rows: Callable[[Any], Any]
  store_read: Callable[..., Any]
  read: Callable[..., Any]


def _server_step(c: types.SimpleNamespace, carry: Any, tabs: Any, constants: Any) -> tuple[Any, Any]:
  """The server runtime's step (see ``_engine.Program.step``): compute a vector of gradients, then apply,
  in order, the updates whose gradients are all computed (:func:`_apply_update`)."""
  data, (shard_rows, shard_sizes), seed = constants
  params, opt_state, slots, stale, payload_buf, stale_buf, loss_buf, finite_buf, snapshot_due, local_states = carry
  lane, tab = tabs
  offset = jax.lax.axis_index(AXIS) * c.per_device if c.distributed else 0

  def local_rows(workers):
    # Padding (worker = num_workers) and other devices' workers fall outside
    # this device's rows and are dropped.
    rows = workers - offset
    return jnp.where((rows >= 0) & (rows < c.per_device), rows, c.per_device)

  # `stale`, the parameters each lane computes at, was assembled at the end
  # of the previous step (the server state has not changed since).
  workers = lane["lane_worker"]
  if c.svrg:
    # The step's lanes are all in the epoch of its version V; if V starts it (or the epoch's
    # snapshot is still due: no update applied since it began), the snapshot is the current parameters.
    snap = optax.tree_utils.tree_where(tab["snap_fresh"] | snapshot_due, params, _snapshot_params(opt_state))
  else:
    snap = ()
  # Each worker's local optimizer state: the planner computes a worker's contributions in
  # separate steps, so each starts from the state its previous one left.
  lane_states = jax.tree.map(lambda x: x[local_rows(workers)], local_states)
  examples = lane["lane_examples"] if c.host_draws else None
  loss, payload, lane_states = jax.vmap(c.lanes.push, in_axes=(None, None, 0, None, 0, 0, 0, 0, 0, 0, 0, 0))(
      data, seed, stale, snap, lane["lane_update"], workers, lane["lane_draw"], lane["lane_batches"],
      shard_rows[local_rows(workers)], shard_sizes[local_rows(workers)], lane_states, examples)
  if c.keep_local_state:
    # Masked lanes (padding) write nothing.
    kept_rows = jnp.where(lane["lane_active"], local_rows(workers), c.per_device)
    local_states = jax.tree.map(lambda x, new: x.at[kept_rows].set(new, mode="drop"), local_states, lane_states)
  # What a plug-in that learns at the update pushes (data, log-probabilities) is reported like a gradient.
  checked = {k: v for k, v in payload.items() if k in _MIXED + _PER_EXAMPLE or c.learns_at_update}
  finite = jax.vmap(_all_finite)(checked) if checked else jnp.ones(loss.shape, jnp.bool_)
  finite_all, loss_all, payload_all, stale_all = c.gather((finite, loss, payload, stale if c.keep_stale else ()))
  # The step's lanes fill a contiguous block of the buffers.
  at = tab["buffer_offset"]
  payload_buf = jax.tree.map(lambda b, g: _store(b, at, g), payload_buf, payload_all)
  if c.keep_stale:
    stale_buf = jax.tree.map(lambda b, s: _store(b, at, s), stale_buf, stale_all)
  loss_buf = _store(loss_buf, at, loss_all)
  if c.skip_nonfinite:
    # Only skipping reads the flags back (to leave such gradients out); the report takes them from the outputs.
    finite_buf = _store(finite_buf, at, finite_all)

  def store_read(slots, value, row, slot, group):
    if c.leaf_groups is None:
      return jax.tree.map(lambda s, v: s.at[row, slot].set(v, mode="drop"), slots, value)
    # A read of one group: only that group's leaves (per_leaf) or coordinates (torn) are stored.
    return c.leaf_groups.store(slots, value, row, slot, group, c.per_device)

  def read(i, state):
    params, opt_state, slots = state
    reader = tab["read_worker"][i]
    value = read_params(opt_state, params, reader)
    slots = store_read(slots, value, local_rows(reader), tab["read_slot"][i], tab["read_group"][i])
    return params, opt_state, slots

  # Reads of this version for later steps come first in the list; they are
  # stored only now, after the gradients that may still have needed a slot.
  _, _, slots = jax.lax.fori_loop(0, tab["read_first"], read, (params, opt_state, slots))

  losses = jnp.zeros((c.max_len,), jnp.float32)
  metrics = jax.tree.map(lambda s: jnp.zeros((c.max_len,) + s.shape, s.dtype), c.metric_shapes)
  # With skip_nonfinite: the worker speaking for each update left out for a non-finite update or state.
  rejected = jnp.full((c.max_len,), -1, jnp.int32) if c.skip_nonfinite else ()
  params, opt_state, slots, losses, metrics, snapshot_due, rejected = jax.lax.fori_loop(
      0, tab["upd_count"], functools.partial(_apply_update, c, _StepContext(
          tab, data, seed, payload_buf, stale_buf, loss_buf, finite_buf, local_rows, store_read, read)),
      (params, opt_state, slots, losses, metrics, snapshot_due, rejected))
  # The next step's parameters are assembled last: gathering from the slots
  # before writing them would make XLA copy the slots every step.
  stale = _lanes_stale(opt_state, params, slots, local_rows(lane["lane_next_worker"]), lane["lane_next_worker"],
                      lane["lane_next_slot"], lane["lane_next_fresh"], c.leaf_groups)
  carry = (params, opt_state, slots, stale, payload_buf, stale_buf, loss_buf, finite_buf, snapshot_due,
           local_states)
  return carry, (losses, metrics, finite_all, rejected)


def _apply_update(c: types.SimpleNamespace, ctx: _StepContext, i: Any, state: Any) -> Any:
  """Update ``i`` of a step: its contributions combined, ``tx`` applied, the reads after it stored."""
  params, opt_state, slots, losses, metrics, snapshot_due, rejected = state
  positions, batches, staleness = ctx.tab["upd_pos"][i], ctx.tab["upd_batches"][i], ctx.tab["upd_staleness"][i]
  present = batches > 0
  kept = present & ctx.finite_buf[positions] if c.skip_nonfinite else present
  kept_batches = jnp.where(kept, batches, 0)
  total = jnp.maximum(jnp.sum(kept_batches), 1)
  weights = kept_batches.astype(jnp.float32) / total.astype(jnp.float32)
  payloads, loss = _contributions(c, ctx, i, params, positions, batches, staleness)

  def mix(*rows):
    terms = [jnp.where(kept[k], (kept_batches[k].astype(x.dtype) / total.astype(x.dtype)) * x,
                       jnp.zeros((), x.dtype)) for k, x in enumerate(rows)]
    return sum(terms[1:], terms[0])

  mixed = {k: jax.tree.map(mix, *[p[k] for p in payloads]) for k in _MIXED if k in payloads[0]}
  # Contributions are sorted stalest first: the first kept one speaks for the update.
  first = jnp.argmax(kept)
  # Transformations that ignore stale_params are given params (and the
  # stale parameters are not even kept).
  stale_params = jax.tree.map(lambda b: b[positions[first]], ctx.stale_buf) if c.keep_stale else params
  # Without requests the update's index is not even read: the default program is unchanged.
  refresh = (ctx.tab["upd_refresh"][i] | snapshot_due) if "full_grad" in c.inputs else None
  extra = _update_inputs(c, ctx, i, params, opt_state, positions, staleness, kept, weights, payloads, mixed, refresh,
                         loss)
  tau = staleness[first, 0] if c.leaf_groups is None else c.leaf_groups.staleness(staleness[first], params)
  updates, new_state = c.tx.update(mixed["grad"], opt_state, params, staleness=tau,
                                   stale_params=stale_params, worker=ctx.tab["upd_worker"][i][first], **extra)
  new_params = optax.apply_updates(params, updates)
  if c.skip_nonfinite or not c.always_applies:
    applied = jnp.any(kept)
    if c.skip_nonfinite:
      # As optax.apply_if_finite, and for the state too (Adam's second moment can overflow while
      # its update stays finite): such an update is left out whole.
      finite = _all_finite(_inexact((updates, new_state)))
      rejected = rejected.at[i].set(jnp.where(applied & ~finite, ctx.tab["upd_worker"][i][first], -1))
      applied = applied & finite
    new_params = optax.tree_utils.tree_where(applied, new_params, params)
    new_state = optax.tree_utils.tree_where(applied, new_state, opt_state)
    if refresh is not None:
      # An update left out cannot take its epoch's snapshot: the next applied one takes it, at
      # the same parameters.
      snapshot_due = refresh & ~applied
  params, opt_state = new_params, new_state
  slots = _reads_after(c, ctx, i, params, opt_state, slots)
  losses = losses.at[i].set(loss)
  if c.eval_fn is not None:
    # A cond, not a where: evaluation is costly and due only every eval_every updates, and its
    # predicate comes from the host tables, the same on every device.
    value = jax.lax.cond(ctx.tab["upd_eval"][i], c.eval_fn,
                         lambda p, s: jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), c.metric_shapes),
                         params, opt_state)
    metrics = jax.tree.map(lambda m, v: m.at[i].set(v), metrics, value)
  return params, opt_state, slots, losses, metrics, snapshot_due, rejected


def _contributions(c: types.SimpleNamespace, ctx: _StepContext, i: Any, params: Any, positions: Any, batches: Any,
                   staleness: Any) -> tuple[list[dict[str, Any]], jax.Array]:
  """Update ``i``'s contributions' payloads (stalest first) and its loss, their mean weighted by minibatches
  (all present ones, kept or not). A worker plug-in that learns at the update (``Worker.at_update``) makes
  each payload now, at the server's ``params``, from what it pushed."""
  present = batches > 0
  payloads = [jax.tree.map(lambda b: b[positions[k]], ctx.payload_buf) for k in range(c.num_contrib)]
  if c.learns_at_update:
    k_losses, payloads = c.lanes.at_update(ctx.seed, params, payloads, ctx.tab["upd_index"][i],
                                           ctx.tab["upd_worker"][i], [staleness[k, 0] for k in range(c.num_contrib)])
  else:
    k_losses = [ctx.loss_buf[positions[k]] for k in range(c.num_contrib)]
  all_batches = jnp.maximum(jnp.sum(batches), 1).astype(jnp.float32)
  loss = sum(jnp.where(present[k], batches[k].astype(jnp.float32) / all_batches * k_losses[k], 0.0)
             for k in range(c.num_contrib))
  return payloads, loss


def _update_inputs(c: types.SimpleNamespace, ctx: _StepContext, i: Any, params: Any, opt_state: Any, positions: Any,
                   staleness: Any, kept: Any, weights: Any, payloads: list[dict[str, Any]], mixed: dict[str, Any],
                   refresh: Any, loss: Any) -> dict[str, Any]:
  """The runtime inputs ``tx`` requested for update ``i`` (``dj.runtime_inputs``), beside its gradient;
  ``value``, the update's loss, for a ``tx`` that needs it."""
  full_weights = _full_grad_weights(opt_state) if "full_grad" in c.inputs else None
  extra = (c.lanes.server_inputs(ctx.data, ctx.seed, params, ctx.tab["upd_index"][i], refresh,
                                 full_weights=full_weights) if c.inputs else {})
  if "value" in c.inputs:
    extra["value"] = loss
  if "snapshot_grad" in c.inputs:
    extra["snapshot_grad"] = mixed["snapshot_grad"]
  if c.per_example:
    # The examples of all contributions, stalest first; those of absent or skipped
    # contributions and of draws beyond a contribution's own batches are masked.
    def joined(*rows):
      return jnp.concatenate(rows)

    extra["sample_indices"] = joined(*[p["sample_indices"] for p in payloads])
    extra.update({k: jax.tree.map(joined, *[p[k] for p in payloads]) for k in _PER_EXAMPLE if k in payloads[0]})
    extra["sample_mask"] = jnp.concatenate([kept[k] & p["sample_valid"] for k, p in enumerate(payloads)])
  if c.per_contribution:
    # Each contribution's own inputs, in the update's order (stalest first); left-out ones weigh 0.
    extra["contribution_grads"] = jax.tree.map(lambda *rows: jnp.stack(rows), *[p["grad"] for p in payloads])
    extra["contribution_stale_params"] = (
        jax.tree.map(lambda b: b[positions], ctx.stale_buf) if c.keep_stale
        else jax.tree.map(lambda p: jnp.broadcast_to(p, (c.num_contrib,) + p.shape), params))
    extra["contribution_staleness"] = (
        staleness[:, 0] if c.leaf_groups is None else c.leaf_groups.staleness(staleness, params))
    extra["contribution_workers"] = ctx.tab["upd_worker"][i]
    extra["contribution_weights"] = weights
  return extra


def _reads_after(c: types.SimpleNamespace, ctx: _StepContext, i: Any, params: Any, opt_state: Any,
                 slots: Any) -> Any:
  """The slots, with the reads of the version update ``i`` made stored."""
  begin, end = ctx.tab["read_begin"][i], ctx.tab["read_end"][i]
  if c.reads_per_update > 2:
    return jax.lax.fori_loop(begin, end, ctx.read, (params, opt_state, slots))[2]
  for r in range(c.reads_per_update):
    index = begin + r
    reader = jnp.where(index < end, ctx.tab["read_worker"][index], c.num_workers)
    value = read_params(opt_state, params, reader)
    slots = ctx.store_read(slots, value, ctx.local_rows(reader), ctx.tab["read_slot"][index],
                           ctx.tab["read_group"][index])
  return slots
