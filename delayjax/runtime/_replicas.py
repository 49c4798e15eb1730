"""The replica runtime: exact decentralized (gossip) training of M replicas on a gossip schedule.

How it runs: the host packs the events into *steps* (see
``_replica_plan.py``): each computes one gradient per replica with a read
from the previous step (``vmap`` over the replicas, like the server
runtime's lanes), then runs a few *phases* of three slots (mixes of
disjoint groups; gradient events of distinct replicas, ``vmap`` over the
replicas with each replica's optimizer state; reads), in an order that
keeps every replica's events in the schedule's order, so the result is
the sequential one. Steps run in chunks of one compiled ``lax.scan`` on
the shared engine (checkpoints after every chunk, bit-identical resume,
the non-finite report). With ``mesh`` the replicas are split over its
``workers`` axis (``M`` must be a multiple of its size). How messages
move depends on the schedule alone, so one device and a mesh add the same
mixing terms in the same order (each product rounded on its own): a
linear model is the same bit for bit; a nonlinear one agrees to a relative
error of a few 1e-7, from the gradients, which XLA compiles differently
for a device's share of the replicas (``tests/runtime/test_device_count.py``).
When every mix's sources sit at no more than four fixed offsets :math:`(b - a) \bmod M` and none is late (a ring, a
torus row, a fixed permutation round), each offset is a roll of the
replica axis, ``lax.ppermute`` of whole blocks between devices;
otherwise (random partners, late messages) every device all-gathers the
messages and picks its rows (each receiver's sources of nonzero weight), the
documented fallback, and a mix in which a receiver takes more than 8 weights
is applied as a dense ``[M, M]`` matrix. Mixes of parameters and mixes of
gradients each take their own form.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from delayjax.cluster._gossip import GossipSchedule
from delayjax.gossip._method import GRADS as METHOD_GRADS
from delayjax.gossip._method import GossipMethod, check_method_schedule
from delayjax.runtime import _checkpoint, _engine
from delayjax.runtime._arguments import (batch_like, check_not_traced, check_params, check_sampling, loss_has_aux,
                                         tree_like)
from delayjax.runtime._options import Checkpoint, Execution, Record, Runs, Sampling, runs_sources, runtime_options
from delayjax.runtime._checkpoint import gathered
from delayjax.runtime._engine import AXIS
from delayjax.runtime._history import chunk_span, nonfinite_report, sorted_pairs
from delayjax.runtime._replica_plan import (DENSE_WIDTH, SLOT_GRAD, SLOT_MIX, SLOT_READ, MixForm, ReplicaPlan,
                                            make_plan, pack_lanes)
from delayjax.runtime._sampling import lane_examples, shard_table
from delayjax.runtime._simulate import (_all_finite, _check_run_params, _check_sources, _inexact, _run_states,
                                        _shared_length)

_CHECKPOINT_FILE = "simulate_gossip"


class GossipHistory(NamedTuple):
  """What happened during a gossip simulation, one row per step of the run (NumPy, host side).

  A step computes one gradient per replica with a pending read and applies
  the events the plan packed into it (see ``stats``); rows are cumulative
  where they count.

  Attributes:
    events: int64 ``[S]``, schedule events done after the step.
    gradients: int64 ``[S]``, ``GRAD`` events done (gradients applied, over all replicas).
    time: float64 ``[S]``, simulated time reached (the latest event done).
    loss: float32 ``[S]``, mean minibatch loss of the gradients computed in
      the step (NaN for a step that computes none).
    loss_spread: float32 ``[S]``, their largest minus smallest loss.
    consensus: float32 ``[S]``, the consensus distance after the step,
      :math:`\\frac1M \\sum_i \\lVert z_i - \\bar z \\rVert^2` over the models
      :math:`z_i` the replicas compute gradients at (``x_i``; ``x_i / w_i``
      for push-sum), :math:`\\bar z` their mean.
    eval_gradients, eval_time: int64 / float64 ``[E]``: gradients applied and
      simulated time at each evaluation (0 before the first step, then the
      steps at which another ``eval_every`` gradients were applied, and the
      last).
    eval_metrics: ``eval_fn`` of the average model :math:`\\bar z`, a leading
      ``[E]`` axis on every leaf (``None`` without ``eval_fn``).
    replica_metrics: ``eval_fn`` of every replica's model, leaves ``[E, M]``.
    nonfinite: int64 ``[n, 2]``: ``(replica, gradient index)`` of every
      gradient with a NaN or infinite entry, sorted.
    nonfinite_state: ``None``, or the events ``(first, last)`` (counted as in
      ``events``, from 0) of the chunk after which some replica's
      parameters, optimizer state or method state were first found
      non-finite (checked after every chunk). Either report also raises a
      ``RuntimeWarning``.

  With ``simulate_gossip(..., history="evaluations")`` the six per-step
  fields (``events`` to ``consensus``) are empty (length 0, their dtypes):
  the host keeps, and a checkpoint stores, only the evaluations and the
  non-finite reports.
  """

  events: np.ndarray
  gradients: np.ndarray
  time: np.ndarray
  loss: np.ndarray
  loss_spread: np.ndarray
  consensus: np.ndarray
  eval_gradients: np.ndarray
  eval_time: np.ndarray
  eval_metrics: Any
  replica_metrics: Any
  nonfinite: np.ndarray
  nonfinite_state: tuple[int, int] | None = None


class GossipResult(NamedTuple):
  """The outcome of :func:`simulate_gossip`.

  Attributes:
    params: every replica's parameters, leaves with a leading ``[M]`` axis.
    opt_state: every replica's optimizer state, likewise.
    extra: every replica's method state (push-sum weight, momentum twin, ...).
    average: the average model :math:`\\bar z` (the mean of what replicas
      compute gradients at).
    history: a :class:`GossipHistory`.
    stats: ``num_steps``, ``phases`` (slot triples per step), ``slots`` (slot
      kinds compiled into a phase), ``lanes`` (gradients computed per device
      per step), ``lane_utilization`` (gradients needed / computed),
      ``mixing`` (how mixes of parameters are combined: ``"gather"``,
      ``"shift"`` or ``"dense"``; of gradients where there are none),
      ``gradient_mixing`` (of gradients, ``None`` without), ``history``
      (messages kept per replica), ``num_devices``, ``chunk_size``,
      ``num_chunks``.
  """

  params: Any
  opt_state: Any
  extra: Any
  average: Any
  history: GossipHistory
  stats: dict[str, Any]


def _where(mask: jax.Array, new: Any, old: Any) -> Any:
  """Per replica (``mask`` on the leading axis): ``new`` where set, ``old`` elsewhere."""
  return jax.tree.map(lambda n, o: jnp.where(mask.reshape(mask.shape + (1,) * (o.ndim - 1)), n, o), new, old)


def simulate_gossip(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    method: GossipMethod,
    params: Any,
    data: Any,
    schedule: GossipSchedule | None,
    *,
    seed: int | Runs = 0,
    sampling: Sampling | None = None,
    record: Record | None = None,
    checkpoint: Checkpoint | None = None,
    execution: Execution | None = None,
) -> GossipResult | list[GossipResult]:
  r"""Trains ``M`` replicas by a decentralized method, exactly as a gossip schedule says.

  Every replica :math:`i` starts from ``params`` with ``tx.init(params)`` and
  ``method.init(params)``, and the schedule's events run in its order:

  * ``READ`` of replica :math:`i`: it stores :math:`z_i` =
    ``method.grad_params`` (its parameters; :math:`x_i / w_i` for SGP) and
    computes, on its :math:`n` = ``num_batches`` minibatches, the mean
    gradient of ``loss_fn`` there. The replica's :math:`b`-th minibatch
    (counted over all its gradients, ``GossipSchedule.batch_index``) is
    ``minibatch_indices(seed, 0, i, b, ...)``.
  * ``GRAD`` of replica :math:`i`: ``method.apply`` with the replica's own
    optimizer state (``tx`` is applied to each replica separately).
  * ``MIX`` of ``PARAMS``: every member is first advanced to the event's
    time (``method.advance``, A2CiD2's flow), their messages
    (``method.message``: the parameters; with the push-sum weight for SGP) are
    taken, possibly ``lag`` versions old (each replica's past messages are
    kept), and every receiving member gets ``method.receive`` of
    :math:`\sum_b W_{ab}\, m_b`. ``MIX`` of ``GRADS``: the receiving members'
    pending gradients become :math:`\sum_b W_{ab}\, g_b`. A method whose rule
    is not defined for late messages (``late_messages=False``: LayUp,
    A2CiD2) refuses a schedule with ``lag > 0``.

  How it runs, and what a mesh gives against one device: see the module
  docstring (``delayjax.runtime._replicas``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, or ``(scalar, aux)`` (told
      apart by its output's structure; ``aux`` is discarded).
    tx: any Optax transformation, each replica with its own state. It is
      given no extra arguments (a replica's gradient is never stale), so a
      transformation that needs ``staleness``, ``stale_params`` or
      ``worker`` is refused.
    method: a :class:`~delayjax.gossip.GossipMethod`, e.g. ``dj.gossip.sgp()``.
    params: the initial parameters of every replica.
    data: a pytree of arrays sharing a leading example axis, on every device.
    schedule: a ``GossipSchedule`` (``dj.cluster``); ``None`` with
      ``seed=dj.Runs(sources=...)`` (a schedule per run).
    seed: the minibatch seed, an int in ``[0, 2**32)``, or ``dj.Runs(...)``:
      several runs in one call, computed side by side (see below).
    sampling: ``dj.Sampling``: batch size and scheme, per replica.
    record: ``dj.Record``: ``eval_fn`` is evaluated on the average model and
      on every replica (see :class:`GossipHistory`), after the steps in which
      another ``every`` gradients were applied (and at the start and the
      end): such a step keeps the models in a snapshot its chunk holds
      (``stats["memory"]["evaluation snapshots"]``), evaluated after the
      chunk by one program of its own, the same at the start, whatever the
      chunks' length (a default chunk is shortened where a large model's
      snapshots would outgrow its replicas' parameters);
      ``history="updates"`` keeps a row per step (``events``,
      ``gradients``, ``time``, ``loss``, ``loss_spread``, ``consensus``).
      Non-finite values are reported; ``nonfinite="skip"`` is not defined
      for replicas (a replica has no other contribution to fall back on).
    checkpoint: ``dj.Checkpoint``, or ``None``.
    execution: ``dj.Execution``: a ``workers`` mesh (``M`` a multiple of its
      size), ``chunk_size``, ``phases`` (slot triples per step; default
      chosen from the schedule), ``max_memory``, and ``like``: other gossip
      schedules whose runs share this run's compiled program (a sweep over
      topologies, paradigms or failures), to float rounding.

  Several runs (``seed=dj.Runs(seeds=..., sources=..., params=..., hyperparams=...)``): run ``r`` has its own
  seed, schedule (``Runs.sources[r]``, else ``schedule``), initial parameters and ``inject_hyperparams``
  values; every run is planned with the other runs' schedules added to ``Execution.like``, so that all
  share one compiled program (without ``Execution.phases``, one per number of phases their plans choose),
  and each is computed by a call of its own of that program, chunk by chunk beside the others (on a CPU,
  several at a time: a small model's program leaves the other cores idle).
  Each result equals, bit for bit, the single call of its seed, schedule, parameters and hyper-parameters
  with ``Execution(like=...)`` naming the call's ``like`` and the other runs' schedules. One device; with
  ``checkpoint``, each run is checkpointed on its own (``simulate_gossip-run{r}``) and a call that finds them
  resumes each run where it was; ``Record.callback`` is told each run's chunks, with the run's index as
  ``"run"``.

  Returns:
    A :class:`GossipResult`; with ``seed=dj.Runs(...)``, a list of them, one per run.

  Raises:
    ValueError, TypeError: on bad arguments, naming the argument.

  Example::

    >>> import jax.numpy as jnp, numpy as np, optax
    >>> import delayjax as dj
    >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    >>> data = {"x": x, "y": x @ np.arange(4, dtype=np.float32)}
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> ring = dj.cluster.d_psgd(dj.topology.ring(4))
    >>> schedule = dj.cluster.simulate_gossip(ring, dj.cluster.workers(4), num_steps=100, seed=0)
    >>> result = dj.simulate_gossip(loss_fn, optax.sgd(0.05), dj.gossip.d_psgd(), jnp.zeros(4), data, schedule,
    ...                             sampling=dj.Sampling(batch_size=16))
    >>> result.params.shape, result.stats["mixing"], bool(result.history.consensus[-1] < 1e-2)
    ((4, 4), 'shift', True)
  """
  if isinstance(seed, Runs):
    return _simulate_runs(loss_fn, tx, method, params, data, schedule, seed, sampling=sampling, record=record,
                          checkpoint=checkpoint, execution=execution)
  run = _prepare(loss_fn, tx, method, params, data, schedule, seed=seed, sampling=sampling, record=record,
                 checkpoint=checkpoint, execution=execution)
  final, records = _engine.run(_program(run), mesh=run.mesh, checkpoint=run.checkpoint,
                               checkpoint_name=_CHECKPOINT_FILE, callback=run.callback)
  return _results(run, final, records)


def _simulate_runs(loss_fn, tx, method, params, data, schedule, runs: Runs, *, sampling, record, checkpoint,
                   execution) -> list[GossipResult]:
  """``dj.simulate_gossip`` of ``seed=dj.Runs(...)``: every run prepared as its own call (with the other runs'
  schedules as ``like``), then computed side by side by ``_engine.run_together``."""
  _, _, sampling, record, execution = runtime_options("dj.simulate_gossip", seed=0, sampling=sampling, record=record,
                                                      execution=execution, no_effect=("lanes",))
  sources = runs_sources(runs, schedule, execution)
  if runs.sources is not None:
    sources = _check_sources(sources, GossipSchedule, "replicas")
  run_params = [params] * runs.num_runs if runs.params is None else _check_run_params(runs.params, params)
  traced: dict[Any, Any] = {}

  def prepare(r):
    # The other runs' schedules fix the plan's sizes with the call's own like: one compiled program for all.
    others = () if runs.sources is None else sources[:r] + sources[r + 1:]
    like = (execution.like or ()) + others
    return _prepare(
        loss_fn, tx, method, run_params[r], data, sources[r], seed=runs.seeds[r], sampling=sampling,
        record=dataclasses.replace(record, callback=None), checkpoint=checkpoint,
        execution=dataclasses.replace(execution, like=like or None), hyperparams=(runs.hyperparams, r),
        traced=traced)

  prepared, done = _engine.run_runs("dj.simulate_gossip", runs.num_runs, prepare, _program,
                                    max_memory=execution.max_memory, hints=_MEMORY_HINTS, callback=record.callback,
                                    checkpoint_name=_CHECKPOINT_FILE)
  return [_results(run, final, records) for run, (final, records) in zip(prepared, done, strict=True)]


def _check_like(like: Any, schedule: GossipSchedule) -> tuple[GossipSchedule, ...]:
  """``Execution.like``, checked: a sequence of gossip schedules of ``schedule``'s replicas."""
  if isinstance(like, GossipSchedule) or not isinstance(like, (list, tuple)):
    raise TypeError(
        f"Execution.like must be a list or tuple of dj.cluster.GossipSchedule, got {type(like).__name__}.")
  for i, other in enumerate(like):
    if not isinstance(other, GossipSchedule):
      raise TypeError(f"Execution.like[{i}] must be a dj.cluster.GossipSchedule, got {type(other).__name__}.")
    if other.num_workers != schedule.num_workers:
      raise ValueError(f"Execution.like[{i}] has {other.num_workers} replicas, but schedule has "
                       f"{schedule.num_workers}; one program serves schedules of the same replicas only.")
  return tuple(like)


def _replica_memory(runtime: str, params: Any, init_state: Any, method: GossipMethod, plan: ReplicaPlan, m: int,
                    data: Any, num_devices: int, execution: Execution, slots: int,
                    models_like: Any) -> dict[str, int]:
  """The ``m`` replicas' state per device, by term, sized from shapes before anything is allocated (a run too
  large for the device is refused, not killed); ``slots``: the evaluation snapshots a chunk keeps, each of the
  average's and every replica's models (``models_like``)."""
  message_like = jax.eval_shape(method.message, params, init_state[2]) if plan.history > 1 else ()
  models_like = models_like if slots else ()
  parts = {name: (_engine.shapes(tree, lead), True)
           for name, tree, lead in (("replica parameters", params, (3 * m,)), ("optimizer states", init_state[1], (m,)),
                                    ("method states", init_state[2], (m,)),
                                    ("message history", message_like, (m, plan.history)),
                                    ("evaluation snapshots", models_like, (slots, m)))}
  # Each device keeps the average models whole.
  parts["evaluation snapshots (average)"] = (_engine.shapes(models_like, (slots,)), False)
  memory = _engine.memory_terms(parts, data, num_devices)
  _engine.check_memory(runtime, memory, _engine.memory_limit(execution.max_memory, execution.mesh), _MEMORY_HINTS)
  return memory


class _ReplicaRun(types.SimpleNamespace):
  """What one ``dj.simulate_gossip`` call has checked, planned and made (its locals), handed from phase to phase."""


def _prepare(loss_fn, tx, method, params, data, schedule, *, seed, sampling, record, checkpoint,
             execution, hyperparams=None, traced=None) -> _ReplicaRun:
  """``dj.simulate_gossip``'s arguments checked against the schedule, its events planned, its carry made
  (``hyperparams``: ``(Runs.hyperparams, r)`` for run ``r`` of several, whose ``optax.inject_hyperparams``
  values every replica's optimizer state starts with; ``traced``: a dict the runs of one call share, which
  keeps what their functions trace to, traced once for all: ``Runs.params`` all have the call's ``params``'
  structure, shapes and dtypes, ``_check_run_params``)."""
  runtime = "dj.simulate_gossip"
  check_not_traced(runtime, params=params, data=data)
  seed, _, sampling, record, execution = runtime_options(runtime, seed=seed, sampling=sampling, record=record,
                                                        execution=execution, no_effect=("lanes",))
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
  if not isinstance(method, GossipMethod):
    raise TypeError(f"method must be a dj.gossip method (GossipMethod), e.g. dj.gossip.d_psgd(); got "
                    f"{type(method).__name__}.")
  if not isinstance(schedule, GossipSchedule):
    raise TypeError(f"schedule must be a dj.cluster.GossipSchedule, got {type(schedule).__name__}.")
  like = _check_like(execution.like or (), schedule)
  batch_size, num_examples = check_sampling(data, sampling.batch_size, sampling.scheme, sampling.shards)
  check_params(params)
  sampling, shards = sampling.scheme, sampling.shards
  keep_steps = record.keeps_updates
  checkpoint = _engine.checkpoint_arguments(checkpoint)
  checkpoint_dir = checkpoint.directory
  eval_fn, eval_every, callback = record.eval_fn, record.every, record.callback
  mesh, chunk_size, phases = execution.mesh, execution.chunk_size, execution.phases
  num_devices = _engine.check_mesh(mesh)
  m = schedule.num_workers
  if m % num_devices:
    raise ValueError(f"the schedule's {m} replicas must split evenly over the mesh's {num_devices} "
                     f"'{AXIS}' devices.")
  if schedule.num_events == 0:
    raise ValueError("schedule has no events.")
  # A method whose rule does not conserve what the schedule's mixes move (no push-sum weight on
  # column-stochastic mixes) would silently change the model's mass: refused, naming both.
  check_method_schedule(method, schedule)
  if method.mixes == METHOD_GRADS and np.any(schedule.mixes == 0):
    raise ValueError(f"method {method.name!r} mixes gradients, but the schedule has PARAMS mixes; use a "
                     f"schedule whose mixes are GRADS (e.g. a GossipGraD paradigm).")

  if not method.late_messages and np.any(schedule.lag > 0):
    raise ValueError(f"method {method.name!r} is not defined for late messages, but the schedule's mixes have "
                     f"lag up to {int(schedule.lag.max())}; use a schedule without message lag (lag = 0).")
  # The arguments are checked: the compiler's probe runs beside the planning.
  _engine.start_compiler_probe()
  plan = make_plan(schedule, phases=phases, num_devices=num_devices, like=like)
  if plan.forms["mix"].name == "dense" and plan.history > 1:
    raise ValueError(f"mixes in which a replica takes more than {DENSE_WIDTH} nonzero weights are not supported "
                     f"with late messages (lag > 0); the schedule's largest group has {schedule.group_size} "
                     f"members.")
  tables = dict(plan.tables)

  # Gradients a step applies at most: one per replica and phase.
  step_gradients = m * plan.phases
  if chunk_size is None:
    num_chunks = max(1, -(-plan.num_steps // 256))
    # Rounded up as dj.simulate rounds its chunks: runs whose step counts differ a little (the seeds of a
    # sweep) share one scan length, so one compiled program; the padding steps change nothing.
    chunk_size = _shared_length(-(-plan.num_steps // num_chunks))
    if eval_fn is not None:
      chunk_size = min(chunk_size, _snapshot_chunk_limit(params, m, step_gradients, eval_every))
  num_chunks = -(-plan.num_steps // chunk_size)
  padded = num_chunks * chunk_size

  # Evaluation after the steps at which the gradients applied pass another multiple of eval_every.
  grads_done = tables["step_grads"]
  eval_flag = np.zeros(plan.num_steps, bool)
  if eval_fn is not None:
    eval_flag[-1] = True
    if eval_every is not None:
      before = np.r_[0, grads_done[:-1]]
      eval_flag |= grads_done // eval_every > before // eval_every
  # An evaluated step keeps the models it evaluates in the chunk's next snapshot slot (evaluate, after the
  # chunk); the other steps name no slot. The slots' count bounds any chunk's evaluations by the sizes alone,
  # so that the runs sharing a program (like) share it.
  slots = 0 if eval_fn is None else _snapshot_slots(chunk_size, step_gradients, eval_every)

  def pad(x):
    extra = padded - x.shape[0]
    return x if extra == 0 else np.concatenate([x, np.zeros((extra,) + x.shape[1:], x.dtype)])

  if sampling == "shard":
    shard_rows, shard_sizes = shard_table(shards, num_examples, m, m)
  else:
    shard_rows, shard_sizes = np.zeros((m, 1), np.int32), np.ones(m, np.int32)
  tables.update(pack_lanes(tables, num_devices, plan.lanes))
  tables = {k: pad(v) for k, v in tables.items()}
  if eval_fn is not None:
    by_chunk = pad(eval_flag).reshape(num_chunks, chunk_size)
    tables["eval_slot"] = np.where(by_chunk, np.cumsum(by_chunk, axis=1) - 1, slots).astype(np.int32).reshape(padded)
    assert tables["eval_slot"].max() <= slots
  host_tables = {k: tables[k] for k in ("step_time", "step_events", "step_grads", "lane_index", "lane_draw",
                                        "lane_worker")}
  device_tables = {k: v for k, v in tables.items() if k not in host_tables}

  opt_state = tx.init(params)
  if hyperparams is not None and hyperparams[0]:
    values, r = hyperparams
    opt_state = _run_states([opt_state] * len(next(iter(values.values()))), values)[r]
  init_state = (params, opt_state, method.init(params))
  _engine.check_extra_args(tx, params, init_state[1], runtime, {})
  traced = {} if traced is None else traced
  if "models" not in traced:
    traced["models"] = _models_like(method.grad_params, *tree_like((params, init_state[2])))
  models_like, models_are_params = traced["models"]
  memory = _replica_memory(runtime, params, init_state, method, plan, m, data, num_devices, execution, slots,
                           models_like)
  # The loss is traced only now, after every check that can refuse the run.
  if "has_aux" not in traced:
    traced["has_aux"] = loss_has_aux(loss_fn, params, data, batch_size)
  has_aux = traced["has_aux"]
  stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (m,) + np.shape(x)).copy(), init_state)
  replica_params, opt_state, extra = stacked
  snap = jax.tree.map(np.zeros_like, replica_params)
  gbuf = jax.tree.map(np.zeros_like, replica_params)
  if plan.history > 1:
    message_key = _engine.program_cache_key(("simulate_gossip", "message"), method.message, params, init_state[2])
    first = _engine.cached(message_key, lambda: jax.jit(method.message))(params, init_state[2])
    hist = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (m, plan.history) + np.shape(x)).copy(), first)
  else:
    hist = ()
  # The snapshot slots: the average model and every replica's (z), each [slots, ...] and [slots, M, ...].
  kept = () if eval_fn is None else (
      jax.tree.map(lambda s: np.zeros((slots,) + s.shape, s.dtype), models_like),
      jax.tree.map(lambda s: np.zeros((slots, m) + s.shape, s.dtype), models_like))
  carry = (replica_params, opt_state, extra, snap, gbuf, hist, kept)
  carry_specs = (P(AXIS),) * 6 + ((P(), P(None, AXIS)) if eval_fn is not None else P(),)
  constants = data
  constant_specs = P()
  # Per-replica tables are split over the mesh on their replica axis: [S, M] lanes, [S, P, M] slots.
  table_specs = {k: P() if v.ndim == 1 else P(None, AXIS) if k.startswith("lane_") else P(None, None, AXIS)
                 for k, v in device_tables.items()}
  table_specs["lane_examples"] = P(None, AXIS)
  if "metric_like" not in traced:
    if eval_fn is None or mesh is not None:
      traced["metric_like"] = None if eval_fn is None else jax.eval_shape(eval_fn, params)
    else:
      # One trace for the evaluations' compile-cache key too (_program).
      traced["eval_fn"], traced["metric_like"] = _engine.program_key_and_shape(eval_fn, params)
  metric_like = traced["metric_like"]
  if metric_like is not None and any(np.shape(x) != () for x in jax.tree.leaves(metric_like)):
    raise ValueError(
        f"Record.eval_fn must return a pytree of scalars here (each is evaluated on the average model and on every "
        f"replica); got shapes {jax.tree.map(lambda x: list(x.shape), metric_like)}.")

  step = _step_function(
      loss_fn=loss_fn, has_aux=has_aux, tx=tx, method=method, plan=plan, slots=slots, num_workers=m,
      sharded=mesh is not None, num_devices=num_devices)
  output_specs = {"loss": P(), "loss_min": P(), "loss_max": P(), "count": P(), "consensus": P(), "finite": P()}

  return _ReplicaRun(**locals())


def _program(run: _ReplicaRun) -> _engine.Program:
  """The engine's program of a prepared replica run: its chunk tables, how outputs become rows, its step."""
  (batch_size, carry, carry_specs, checkpoint_dir, chunk_size, constant_specs, constants, data, device_tables,
   eval_every, eval_fn, host_tables, keep_steps, loss_fn, m, mesh, method, metric_like, num_chunks, num_devices,
   num_examples, output_specs, params, plan, sampling, schedule, seed, shard_rows, shard_sizes, shards, slots,
   step, table_specs, tx) = (getattr(run, name) for name in (
       "batch_size", "carry", "carry_specs", "checkpoint_dir", "chunk_size", "constant_specs", "constants",
       "data", "device_tables", "eval_every", "eval_fn", "host_tables", "keep_steps", "loss_fn", "m", "mesh",
       "method", "metric_like", "num_chunks", "num_devices", "num_examples", "output_specs", "params", "plan",
       "sampling", "schedule", "seed", "shard_rows", "shard_sizes", "shards", "slots", "step", "table_specs",
       "tx"))
  def chunk_tables(chunk):
    steps = slice(chunk * chunk_size, (chunk + 1) * chunk_size)
    out = {k: v[steps] for k, v in device_tables.items()}
    # Minibatch indices are drawn on the host, a chunk at a time, outside the compiled steps: the random
    # number generator would otherwise dominate their compile time.
    out["lane_examples"] = lane_examples(
        out["lane_active"], host_tables["lane_draw"][steps], host_tables["lane_worker"][steps], plan.max_batches,
        batches=out["lane_batches"], seed=seed,
        num_examples=num_examples, batch_size=batch_size, sampling=sampling, shard_rows=shard_rows,
        shard_sizes=shard_sizes)
    return out

  def collect(chunk, tabs, outputs):
    steps = slice(chunk * chunk_size, min((chunk + 1) * chunk_size, plan.num_steps))
    n = steps.stop - steps.start
    finite = _engine.host(outputs["finite"])[:n]
    bad = tabs["lane_active"][:n] & ~finite
    rows = np.stack([host_tables["lane_worker"][steps][bad], host_tables["lane_index"][steps][bad]], axis=1)
    rec = {"nonfinite": rows.astype(np.int64)}
    # Without per-step rows the chunk's losses and consensus distances stay on the devices, unread.
    if keep_steps:
      count = _engine.host(outputs["count"])[:n]
      loss = np.where(count > 0, _engine.host(outputs["loss"])[:n] / np.maximum(count, 1), np.nan)
      with np.errstate(invalid="ignore"):
        spread = np.where(count > 0, _engine.host(outputs["loss_max"])[:n] - _engine.host(outputs["loss_min"])[:n],
                          np.nan)
      rec.update(loss=loss.astype(np.float32), spread=spread.astype(np.float32),
                 consensus=_engine.host(outputs["consensus"])[:n].astype(np.float32))
    return rec

  def evaluate(chunk, tabs, placed):
    # The chunk's evaluated steps, in order, each the models its snapshot slot kept.
    count = int(np.sum(tabs["eval_slot"] < slots))
    means, zs = (jax.tree.map(lambda x: gathered(x)[:count], part) for part in placed[6])
    evaluation = evaluated()
    return _metric_rows([evaluation(jax.tree.map(lambda x: x[i], means), jax.tree.map(lambda x: x[i], zs))
                         for i in range(count)], metric_like, m)

  records_like = {"nonfinite": np.zeros((0, 2), np.int64)}
  if keep_steps:
    records_like.update(loss=np.zeros(0, np.float32), spread=np.zeros(0, np.float32),
                        consensus=np.zeros(0, np.float32))
  if eval_fn is not None:
    records_like.update(_metric_rows([], metric_like, m))

  def initial(placed):
    # Called once the chunk's compile is under way (not on a resume: _results compiles it then), and once for the runs
    # of one program.
    if models is not None:
      run.models_compiled = _engine.cached(
          None if keys is None else (*keys["models"], "compiled"),
          lambda: _engine._in_background(models.lower(tree_like(carry[0]), tree_like(carry[2])).compile))
    if eval_fn is None:
      return {}
    # Every replica starts from params (z = x / 1 for push-sum), by the program that evaluates the chunks' models.
    start = jax.tree.map(lambda s, x: np.asarray(x, s.dtype), models_like, params)
    replicas = jax.tree.map(lambda x: np.broadcast_to(x, (m,) + x.shape), start)
    return _metric_rows([evaluated()(start, replicas)], metric_like, m)

  def progress(chunk):
    return {"steps_done": min((chunk + 1) * chunk_size, plan.num_steps), "num_steps": plan.num_steps,
            "chunk": chunk, "num_chunks": num_chunks}

  # Only a checkpoint needs the run's identity (it traces tx and loss_fn and hashes the data).
  fingerprint = "" if checkpoint_dir is None else _fingerprint(
      schedule, tx=tx, loss_fn=loss_fn, method=method, eval_fn=eval_fn, params=params, data=data,
      batch_size=batch_size, options=dict(
          method=method.name, seed=seed, batch_size=batch_size, sampling=sampling, chunk_size=chunk_size,
          phases=plan.phases, mixing=plan.forms, has_eval=eval_fn is not None, snapshot_slots=slots,
          eval_every=eval_every, num_devices=num_devices,
          shards=None if shards is None else hashlib.sha256(
              b"".join(np.ascontiguousarray(np.asarray(s)).tobytes() for s in shards)).hexdigest()))
  # Compiled once per program: runs whose steps trace to the same program (closed-over arrays included) share
  # the jitted chunk and evaluation, so runs differing only in the seed or the initial parameters compile once
  # when their plans have the same sizes. On a mesh the step holds collectives that trace only inside its
  # shard_map: compiled afresh.
  # A step's row of the tables, by shapes alone (drawing chunk 0's minibatches for it would draw them twice).
  row = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in device_tables.items()}
  row["lane_examples"] = jax.ShapeDtypeStruct(device_tables["lane_active"].shape[1:] + (plan.max_batches, batch_size),
                                              np.int32)
  # Every replica's parameters: the size of the model the chunk updates, which chooses its compile options.
  step_entries = _engine.entries(carry[0])
  # The evaluations' program, traced first (in this thread: a jax.config context such as enable_x64 holds in it
  # only) and compiled in the background while the chunk's program is keyed and traced; its executable is called
  # from the thread that computed a chunk.
  models_like = run.models_like
  # eval_fn's key, from the trace that gave its metrics' shapes (_prepare; none on a mesh).
  eval_key = None if eval_fn is None else run.traced.get("eval_fn")
  evaluated = None if eval_fn is None else _engine.cached(
      None if not eval_key else ("simulate_gossip", "evaluation", eval_key, m, step_entries,
                                 _checkpoint.tree_digest(models_like, values=False)),
      lambda: _engine._in_background(_engine.jit_like_chunk(_evaluation(eval_fn), step_entries, mesh).lower(*(
          jax.tree.map(lambda s: jax.ShapeDtypeStruct(lead + s.shape, s.dtype), models_like)
          for lead in ((), (m,)))).compile))
  keys = None if mesh is not None else _step_keys(run, row)
  cache_key = None if keys is None else keys["chunk"]
  # The replicas' models at the end (the result's average) as one program, compiled beside the chunk's (initial):
  # computed op by op after the runs, push-sum's x / w compiled a program per operation there (0.06 s of
  # gossip_topology's one seed).
  # A rule whose gradient is taken at the parameters themselves (D-PSGD's) has them as its models: no program.
  models = None if run.models_are_params else _engine.cached(
      None if keys is None else keys["models"], lambda: jax.jit(jax.vmap(method.grad_params)))
  run.models, run.models_compiled = models, None
  return _engine.Program(
      carry=carry, carry_specs=carry_specs, constants=constants, constant_specs=constant_specs, step=step,
      table_specs=table_specs, output_specs=output_specs, num_chunks=num_chunks, tables=chunk_tables,
      step_entries=step_entries,
      collect=collect, records_like=records_like, progress=progress, fingerprint=fingerprint,
      initial=initial, evaluate=None if eval_fn is None else evaluate,
      # Every replica's parameters, optimizer state and method state finite, after each chunk.
      check=lambda carry: _replicas_finite(carry[:3], mesh is not None), cache_key=cache_key)


def _evaluation(eval_fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
  """``evaluation(average, replicas)``: ``eval_fn`` of the average model and of each of the ``M`` replicas'
  models (a leading axis), as one batched program; its metrics' leaves ``[M + 1]``, the average's first."""
  def evaluation(average, replicas):
    models = jax.tree.map(lambda a, z: jnp.concatenate([a[None], z]), average, replicas)
    return jax.vmap(eval_fn)(models)

  return evaluation


def _metric_rows(rows: list[Any], metric_like: Any, m: int) -> dict[str, Any]:
  """The records ``"metrics"`` (``[E]`` leaves) and ``"replica_metrics"`` (``[E, M]``) of ``E`` evaluations'
  metrics (each :func:`_evaluation`'s, ``[M + 1]`` leaves)."""
  if not rows:
    return {"metrics": jax.tree.map(lambda s: np.zeros((0,), s.dtype), metric_like),
            "replica_metrics": jax.tree.map(lambda s: np.zeros((0, m), s.dtype), metric_like)}
  stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows)
  return {"metrics": jax.tree.map(lambda x: x[:, 0], stacked),
          "replica_metrics": jax.tree.map(lambda x: x[:, 1:], stacked)}


def _snapshot_slots(chunk_size: int, step_gradients: int, eval_every: int | None) -> int:
  """The most evaluations a chunk of ``chunk_size`` steps can hold when a step applies at most
  ``step_gradients`` gradients: one each time the gradients applied pass another multiple of ``eval_every``
  (at most ``chunk_size * step_gradients // eval_every + 1`` in a chunk) and the run's last step."""
  if eval_every is None:
    return 1
  return min(chunk_size, chunk_size * step_gradients // eval_every + 2)


# What the snapshots of a chunk of the default length may take at least: more where the replicas' own
# parameters take more (see _snapshot_chunk_limit).
_SNAPSHOT_BYTES = 64 << 20


def _snapshot_chunk_limit(params: Any, m: int, step_gradients: int, eval_every: int | None) -> int:
  """The longest default chunk (a power of two) whose evaluation snapshots (:func:`_snapshot_slots`, each the
  average and ``m`` replicas' models) take at most as many bytes as the replicas' three copies of the parameters
  or :data:`_SNAPSHOT_BYTES`, whichever is more (at least 1 step): a large model evaluated often is run in
  shorter chunks rather than keep many snapshots; the numbers do not depend on the chunks' length."""
  model = _engine.tree_bytes(params)
  budget = max(3 * m * model, _SNAPSHOT_BYTES)
  length = 1
  while length < 4096 and _snapshot_slots(2 * length, step_gradients, eval_every) * (m + 1) * model <= budget:
    length *= 2
  return length


def _results(run: _ReplicaRun, final: Any, records: dict[str, Any]) -> GossipResult:
  """A finished replica run's result: the replicas' final states, their average, the history, statistics."""
  (chunk_size, eval_flag, eval_fn, grads_done, host_tables, keep_steps, memory, method, num_chunks, num_devices,
   plan) = (getattr(run, name) for name in (
       "chunk_size", "eval_flag", "eval_fn", "grads_done", "host_tables", "keep_steps", "memory", "method",
       "num_chunks", "num_devices", "plan"))
  params_out, opt_out, extra_out = (jax.tree.map(gathered, x) for x in final[:3])
  if run.models_compiled is not None:
    run.models_compiled()
  z = params_out if run.models is None else run.models(params_out, extra_out)
  # On the host, accumulated in float64 and rounded once to the dtype jnp.mean gives: a jnp.mean would compile
  # a program per leaf shape (0.03 s, between two calls of a sweep of small runs).
  average = jax.tree.map(
      lambda x: np.mean(np.asarray(x, np.float64), axis=0).astype(jnp.result_type(x.dtype, float)), z)
  steps_evaluated = np.flatnonzero(eval_flag)
  # Empty arrays of their own without per-step rows (a view would keep the whole run's rows alive).
  kept = plan.num_steps if keep_steps else 0
  history = GossipHistory(
      events=host_tables["step_events"][:kept].copy(),
      gradients=host_tables["step_grads"][:kept].copy(),
      time=host_tables["step_time"][:kept].copy(),
      loss=records.get("loss", np.zeros(0, np.float32)), loss_spread=records.get("spread", np.zeros(0, np.float32)),
      consensus=records.get("consensus", np.zeros(0, np.float32)),
      eval_gradients=(np.r_[0, grads_done[steps_evaluated]].astype(np.int64) if eval_fn is not None
                      else np.zeros(0, np.int64)),
      eval_time=(np.r_[0.0, host_tables["step_time"][steps_evaluated]] if eval_fn is not None
                 else np.zeros(0)),
      eval_metrics=records.get("metrics"), replica_metrics=records.get("replica_metrics"),
      nonfinite=sorted_pairs(records["nonfinite"]),
      nonfinite_state=chunk_span(np.diff(np.r_[0, host_tables["step_events"][
          np.minimum(np.arange(1, num_chunks + 1) * chunk_size, plan.num_steps) - 1]]), records["check"]))
  # The warning names the first bad gradient as (gradient index, replica).
  nonfinite_report("dj.simulate_gossip", sorted_pairs(history.nonfinite[:, ::-1]), None, history.nonfinite_state,
                   stacklevel=2, source="replica")
  stats = {"num_steps": plan.num_steps, "phases": plan.phases, "lanes": plan.lanes,
           "slots": int(plan.used.any(axis=0).sum()),
           "lane_utilization": plan.lane_utilization,
           "mixing": plan.forms["mix" if plan.has_pmix or not plan.has_gmix else "gmix"].name,
           "gradient_mixing": plan.forms["gmix"].name if plan.has_gmix else None, "history": plan.history,
           "num_devices": num_devices, "chunk_size": chunk_size, "num_chunks": num_chunks,
           "memory": {**memory, "total": sum(memory.values())}}
  return GossipResult(params_out, opt_out, extra_out, average, history, stats)


# What shrinks each term of a replica run's memory (the replica parameters count three copies: the
# parameters, the snapshot a read takes and the pending gradient).
_MEMORY_HINTS = {
    "replica parameters": "fewer replicas per device (a mesh with more devices) or a smaller model",
    "optimizer states": "a lighter optimizer or fewer replicas per device",
    "method states": "fewer replicas per device",
    "message history": "a schedule with less message lag (each replica keeps its last lag + 1 messages)",
    "evaluation snapshots": "evaluations less often (dj.Record's every) or shorter chunks (Execution.chunk_size)",
    "evaluation snapshots (average)": "evaluations less often (dj.Record's every) or shorter chunks "
                                      "(Execution.chunk_size)",
}


def _fingerprint(schedule: GossipSchedule, *, tx: Any, loss_fn: Callable[..., Any], method: GossipMethod,
                 eval_fn: Any, params: Any, data: Any, batch_size: int, options: dict[str, Any]) -> dict[str, str]:
  """The run's identity, by component (``_engine.identity``): what a checkpoint must match to be resumed."""
  opt_state, extra = tx.init(params), method.init(params)
  dt, weight = jnp.float32(1.0), jnp.float32(0.5)
  message = jax.eval_shape(method.message, params, extra)
  # The method's own rules, traced with a fixed optimizer so that its digest changes with the method only.
  reference = optax.sgd(1.0)
  programs = {
      # The traced programs carry the hyper-parameters (a learning rate is a literal in them).
      "tx": (tx.update, (params, opt_state, params)),
      "loss_fn": (lambda p, b: loss_fn(p, b), (params, batch_like(data, batch_size))),
      "method": (lambda p, s, e, m: (method.apply(reference, p, s, p, e, dt), method.message(p, e),
                                     method.receive(p, e, m, weight, dt),
                                     () if method.advance is None else method.advance(p, e, dt)),
                 (params, reference.init(params), extra, message)),
  }
  if eval_fn is not None:
    programs["eval_fn"] = (eval_fn, (params,))
  return _engine.identity(
      schedule=_checkpoint.digest(*(getattr(schedule, n) for n in (
          "time", "kind", "worker", "num_batches", "mix", "members", "weights", "lag", "receives", "mixes"))),
      options=options, params=params, data=data, programs=programs)


def _roll(x: jax.Array, shift: int, num_workers: int, num_devices: int, sharded: bool) -> jax.Array:
  """``y[i] = x[(i + shift) mod M]`` along the replica axis: ``jnp.roll`` on one device, ``ppermute``
  of whole blocks across the mesh (each device holds ``M / D`` consecutive replicas)."""
  if not sharded:
    return jnp.roll(x, -shift, axis=0)
  block = num_workers // num_devices
  q, r = divmod(shift % num_workers, block)

  def from_device(offset):
    offset %= num_devices
    if offset == 0:
      return x
    return jax.lax.ppermute(x, AXIS, [((d + offset) % num_devices, d) for d in range(num_devices)])

  first = from_device(q)
  if r == 0:
    return first
  return jnp.concatenate([first[r:], from_device(q + 1)[:r]], axis=0)


def _total(x: jax.Array, sharded: bool) -> jax.Array:
  """The sum of ``x`` over the mesh's devices (``x`` itself on one device)."""
  return jax.lax.psum(x, AXIS) if sharded else x


def _gather_all(tree: Any, sharded: bool) -> Any:
  """Every device's rows of ``tree``'s leaves, in device order (``tree`` itself on one device)."""
  return jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=True), tree) if sharded else tree


def _lane_function(loss_fn: Callable[..., Any], has_aux: bool, max_batches: int) -> Callable[..., Any]:
  """One lane's loss and gradient at its stale parameters, averaged over its (up to ``max_batches``)
  minibatches."""
  def lane(data, stale, examples, batches):
    def one(b):
      batch = jax.tree.map(lambda x: x[examples[b]], data)
      out, grad = jax.value_and_grad(loss_fn, has_aux=has_aux)(stale, batch)
      return jnp.asarray(out[0] if has_aux else out).astype(jnp.float32), grad

    if max_batches == 1:
      return one(0)

    def body(acc, b):
      loss, grad = one(b)
      keep = b < batches
      return (acc[0] + jnp.where(keep, loss, 0.0),
              jax.tree.map(lambda a, g: a + jnp.where(keep, g, jnp.zeros((), g.dtype)), acc[1], grad)), None

    (loss, grad), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, stale)),
                                   jnp.arange(max_batches, dtype=jnp.int32))
    n = jnp.maximum(batches, 1)
    return loss / n.astype(jnp.float32), jax.tree.map(lambda g: g / n.astype(g.dtype), grad)

  return lane


# The most bytes a dense mix's [M, M, ...] products may take to be computed all at once (:func:`_dense_sum`);
# larger ones are summed in a loop (:func:`_ordered_sum`).
_DENSE_PRODUCTS_BYTES = 1 << 24


def _mixing_functions(*, method: GossipMethod, plan: ReplicaPlan, num_workers: int, num_devices: int,
                      sharded: bool) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
  """``(combine, params_mix, write_history)``: a mix's weighted sums of messages (in a :class:`MixForm`),
  a mix of parameters (advance, message, combine, receive), and the kept past messages written after an
  update."""
  history = plan.history

  def combine(values, weight, src, form: MixForm):
    """Rows ``sum_k weight[a, k] * values[src[a, k]]`` for the local receivers ``a``."""
    if form.name == "shift":
      return _products_sum(
          weight,
          lambda k: jax.tree.map(lambda x: _roll(x, form.shifts[k], num_workers, num_devices, sharded), values),
          len(form.shifts))
    full = _gather_all(values, sharded)
    if form.name == "dense":
      # Row k of the gathered messages, broadcast over the local receivers by the weights' column k. All the
      # [M, M, ...] products at once where they are small (for a small model a loop's iterations cost more than
      # its arithmetic: 795 steps of 16 softmax regressions took 0.40 s with the loop, 0.28 s without, and
      # compiled in 0.74 s against 0.57 s); decided on the whole run's sizes, so every device count takes the
      # same path.
      products = num_workers * num_workers * sum(x[0].size * x.dtype.itemsize for x in jax.tree.leaves(full))
      if products <= _DENSE_PRODUCTS_BYTES:
        return _dense_sum(weight, full)
      return _ordered_sum(weight, lambda k: jax.tree.map(lambda x: x[k][None], full), weight.shape[1])
    return _gather_rows(full, weight, src)

  def gathered_with_history(current, hist):
    """All messages followed by every replica's kept past messages: ``M + M * H`` rows."""
    full_c, full_h = _gather_all(current, sharded), _gather_all(hist, sharded)
    return jax.tree.map(lambda c, h: jnp.concatenate([c, h.reshape((-1,) + h.shape[2:])], axis=0), full_c, full_h)

  def write_history(hist, mask, slot, params, extra):
    if history == 1:
      return hist
    msg = jax.vmap(method.message)(params, extra)
    onehot = (jnp.arange(history)[None, :] == slot[:, None]) & mask[:, None]
    return jax.tree.map(lambda h, v: jnp.where(onehot.reshape(onehot.shape + (1,) * (v.ndim - 1)), v[:, None], h),
                        hist, msg)

  def params_mix(params, extra, hist, tab):
    recv, member = tab["mix_recv"], tab["mix_member"]
    if method.advance is not None:
      advanced = jax.vmap(method.advance)(params, extra, tab["mix_dt"])
      params, extra = _where(member, advanced[0], params), _where(member, advanced[1], extra)
    msgs = jax.vmap(method.message)(params, extra)
    if history > 1:
      full = gathered_with_history(msgs, hist)
      mixed = _gather_rows(full, tab["mix_weight"], tab["mix_src"])
    else:
      mixed = combine(msgs, tab["mix_weight"], tab.get("mix_src"), plan.forms["mix"])
    new_params, new_extra = jax.vmap(method.receive)(params, extra, mixed, tab["mix_self"], tab["mix_dt"])
    params, extra = _where(recv, new_params, params), _where(recv, new_extra, extra)
    hist = write_history(hist, recv, tab["mix_hist"], params, extra)
    return params, extra, hist

  return combine, params_mix, write_history


def _step_outputs(loss: jax.Array, active: jax.Array, finite: jax.Array, z: Any, mean: Any, num_workers: int,
                  sharded: bool) -> dict[str, Any]:
  """A step's rows: the lanes' summed, lowest and highest losses and count, the consensus distance of the
  replicas' models ``z`` from their ``mean``, and which lanes' gradients were finite."""
  consensus = sum(_total(jnp.sum(jnp.square(x - mu[None]).astype(jnp.float32)), sharded)
                  for x, mu in zip(jax.tree.leaves(z), jax.tree.leaves(mean))) / num_workers
  big = jnp.asarray(np.inf, jnp.float32)
  return {
      "loss": _total(jnp.sum(jnp.where(active, loss, 0.0)), sharded),
      "loss_min": -jax.lax.pmax(-jnp.min(jnp.where(active, loss, big)), AXIS) if sharded
      else jnp.min(jnp.where(active, loss, big)),
      "loss_max": jax.lax.pmax(jnp.max(jnp.where(active, loss, -big)), AXIS) if sharded
      else jnp.max(jnp.where(active, loss, -big)),
      "count": _total(jnp.sum(active.astype(jnp.int32)), sharded),
      "consensus": consensus,
      "finite": _gather_all(finite, sharded) if sharded else finite,
  }


def _step_function(*, loss_fn, has_aux, tx, method, plan: ReplicaPlan, slots, num_workers, sharded, num_devices):
  """One step of the replica runtime (per device under ``shard_map``). What it reads of its arguments is what
  the compile-cache key names (:func:`_step_keys`): a step that reads more must name it there too."""
  lane = _lane_function(loss_fn, has_aux, plan.max_batches)
  combine, params_mix, write_history = _mixing_functions(method=method, plan=plan, num_workers=num_workers,
                                                         num_devices=num_devices, sharded=sharded)
  kinds = plan.used.any(axis=0)

  def phase(state, tab):
    """One phase: its mixes, then its gradient events, then its reads (slot kinds no step uses left out)."""
    params, opt_state, extra, snap, gbuf, hist = state
    if kinds[SLOT_MIX]:
      if plan.has_gmix:
        gbuf = _if_any(tab["gmix_recv"], lambda g: _where(
            tab["gmix_recv"], combine(g, tab["gmix_weight"], tab.get("gmix_src"), plan.forms["gmix"]), g), gbuf,
            sharded)
      if plan.has_pmix:
        params, extra, hist = _if_any(tab["mix_recv"], lambda state: params_mix(*state, tab), (params, extra, hist),
                                      sharded)
    if kinds[SLOT_GRAD]:
      mask = tab["grad_mask"]
      new = jax.vmap(method.apply, in_axes=(None, 0, 0, 0, 0, 0))(tx, gbuf, opt_state, params, extra, tab["grad_dt"])
      params, opt_state, extra = (_where(mask, new[0], params), _where(mask, new[1], opt_state),
                                  _where(mask, new[2], extra))
      hist = write_history(hist, mask, tab["grad_hist"], params, extra)
    if kinds[SLOT_READ]:
      snap = _where(tab["read_mask"], jax.vmap(method.grad_params)(params, extra), snap)
    return (params, opt_state, extra, snap, gbuf, hist), None

  def step(carry, tab, consts):
    params, opt_state, extra, snap, gbuf, hist, kept = carry
    data = consts
    active, rows = tab["lane_active"], tab["lane_replica"]
    stale = jax.tree.map(lambda x: x[rows], snap)
    loss, grads = jax.vmap(lane, in_axes=(None, 0, 0, 0))(data, stale, tab["lane_examples"], tab["lane_batches"])
    finite = _all_finite(grads, lead=1)
    gbuf = _lanes_written(gbuf, grads, active, rows)
    state = (params, opt_state, extra, snap, gbuf, hist)
    phase_tabs = {k: v for k, v in tab.items() if k.startswith(("grad_", "read_", "mix_", "gmix_"))}
    # One phase compiled once, scanned over the step's phases.
    if plan.phases == 1:
      state, _ = phase(state, jax.tree.map(lambda x: x[0], phase_tabs))
    else:
      state, _ = jax.lax.scan(phase, state, phase_tabs)
    params, opt_state, extra, snap, gbuf, hist = state

    z = jax.vmap(method.grad_params)(params, extra)
    mean = jax.tree.map(lambda x: _total(jnp.sum(x, axis=0), sharded) / jnp.asarray(num_workers, x.dtype), z)
    out = _step_outputs(loss, active, finite, z, mean, num_workers, sharded)
    if slots:
      # An evaluated step keeps the average model and the replicas' in its slot; evaluate reads them after the
      # chunk (an evaluation compiled into the chunk's program would be compiled twice, here and for the initial
      # models: a small model's chunk compiled 0.1 s longer).
      slot = tab["eval_slot"]
      kept = jax.lax.cond(slot < slots, lambda kept: jax.tree.map(
          lambda buffer, x: jax.lax.dynamic_update_index_in_dim(buffer, x, slot, 0), kept, (mean, z)),
          lambda kept: kept, kept)
    return (params, opt_state, extra, snap, gbuf, hist, kept), out

  return step


def _step_keys(run: _ReplicaRun, row: dict[str, Any]) -> dict[str, Any] | None:
  """The compile-cache keys of a replica run's chunk and final models' program (one device): ``{"chunk": key,
  "models": key}``, or ``None`` when a function calls back into Python (such programs are compiled afresh every
  run).

  The key names everything :func:`_step_function` builds the step from: the user's functions by the programs
  they trace to (``loss_fn``'s gradient; ``method.apply`` with ``tx``; ``grad_params``; ``message``,
  ``receive`` and ``advance`` where the plan's mixes or kept messages call them), the plan's static choices,
  and the shapes and dtypes of the step's arguments (the carry, with its evaluation snapshots, a row of the
  tables, the data), as ``dj.simulate``'s key does (the evaluations' program is keyed by ``eval_fn``'s, apart:
  the step only keeps the models they read). Tracing these parts costs a fifth of tracing the whole step, which
  a sweep of many short runs paid once per run.
  """
  plan, method, tx = run.plan, run.method, run.tx
  params, opt_state, extra = tree_like(run.init_state)
  dt = jax.ShapeDtypeStruct((), jnp.float32)
  calls_message = plan.has_pmix or plan.history > 1
  # The runs of one call (dj.Runs) trace the same functions on the same shapes: traced once for all of them.
  traced = run.traced
  known = traced.get((calls_message, plan.has_pmix))
  programs = known if known is not None else {
      "loss_fn": _engine.program_key(jax.value_and_grad(run.loss_fn, has_aux=run.has_aux), params,
                                     batch_like(run.data, run.batch_size)),
      "apply": _engine.program_key(lambda g, s, p, e, t: method.apply(tx, g, s, p, e, t), params, opt_state, params,
                                   extra, dt),
      "grad_params": _engine.program_key(method.grad_params, params, extra),
      "message": _engine.program_key(method.message, params, extra) if calls_message else None,
      "receive": _engine.program_key(method.receive, params, extra, jax.eval_shape(method.message, params, extra),
                                     dt, dt) if plan.has_pmix else None,
      "advance": _engine.program_key(method.advance, params, extra, dt)
      if plan.has_pmix and method.advance is not None else None,
  }
  traced[calls_message, plan.has_pmix] = programs
  if any(key is False for key in programs.values()):
    return None
  static = dict(has_aux=run.has_aux, num_workers=run.m, num_devices=run.num_devices, phases=plan.phases,
                kinds=tuple(bool(k) for k in plan.used.any(axis=0)), forms=tuple(sorted(plan.forms.items())),
                history=plan.history, has_pmix=plan.has_pmix, has_gmix=plan.has_gmix, max_batches=plan.max_batches)
  shapes = _checkpoint.tree_digest((tree_like(run.carry), row, tree_like(run.constants)), values=False)
  return {"chunk": ("simulate_gossip", "chunk", tuple(sorted(programs.items())), tuple(sorted(static.items())),
                    shapes),
          "models": ("simulate_gossip", "models", programs["grad_params"], run.m,
                     _checkpoint.tree_digest((params, extra), values=False))}


def _models_like(fn: Callable[[Any, Any], Any], params: Any, extra: Any) -> tuple[Any, bool]:
  """From one trace of a rule's ``grad_params``: the structure, shapes and dtypes of ``fn(params, extra)`` (a
  replica's model), and whether it is ``params`` itself (its program computes nothing and returns its first
  argument's leaves, in order)."""
  closed, like = jax.make_jaxpr(fn, return_shape=True)(params, extra)
  jaxpr = closed.jaxpr
  return like, not jaxpr.eqns and list(jaxpr.outvars) == list(jaxpr.invars[:len(jax.tree.leaves(params))])


def _lanes_written(gbuf: Any, grads: Any, active: jax.Array, rows: jax.Array) -> Any:
  """``gbuf`` with row ``rows[l]`` set to lane ``l``'s gradient for every active lane ``l``.

  The active lanes' rows are distinct (:func:`~delayjax.runtime._replica_plan.pack_lanes`), so each row takes
  the gradient of the one lane that names it, gathered, or keeps its own: a scatter would be lowered to a loop
  over the lanes, a sixth of a small model's step (16 replicas of softmax regression on the digits).
  """
  names = (rows[None, :] == jnp.arange(jax.tree.leaves(gbuf)[0].shape[0], dtype=rows.dtype)[:, None]) & active[None]
  lane = jnp.argmax(names, axis=1)
  return _where(jnp.any(names, axis=1), jax.tree.map(lambda g: g[lane], grads), gbuf)


def _if_any(mask: jax.Array, update: Callable[[Any], Any], state: Any, sharded: bool) -> Any:
  """``update(state)`` where some replica of ``mask`` (on any device) takes part, ``state`` unchanged where none
  does: a program serving several schedules holds every kind of mix they use (all-reduce's mix of gradients,
  gossip's of parameters), and a step of one run seldom uses them all. Every value ``update`` returns is
  computed as it would be outside the conditional (its products are computed apart, :func:`_apart`, and it
  ends in a selection per replica), so skipping changes no rounding."""
  some = _total(jnp.any(mask).astype(jnp.int32), sharded) > 0
  return jax.lax.cond(some, update, lambda s: s, state)


def _replicas_finite(tree: Any, sharded: bool) -> jax.Array:
  """Whether every floating-point entry of ``tree`` is finite, on every device."""
  finite = _all_finite(_inexact(tree))
  return jax.lax.pmin(finite.astype(jnp.int32), AXIS) > 0 if sharded else finite


def _gather_rows(values: Any, weight: jax.Array, src: jax.Array) -> Any:
  """``sum_k weight[:, k] * x[src[:, k]]`` for every leaf ``x`` of ``values`` (see :func:`_products_sum`)."""
  return _products_sum(weight, lambda k: jax.tree.map(lambda x: x[src[:, k]], values), src.shape[1])


def _products_sum(weight: jax.Array, term: Callable[[int], Any], num_terms: int) -> Any:
  """``sum_k weight[:, k] * term(k)`` over ``k = 0 .. num_terms - 1``, leaf by leaf, with the same roundings
  on one device and on a mesh.

  Every product is rounded to the leaves' dtype, then the products are added in ``k`` order. Written as
  plain ``w0 * x0 + w1 * x1 + ...``, the products and sums would be fused into one loop that the CPU
  compiler contracts into fused multiply-adds, choosing per shape which product keeps its rounding, so one
  device (``[M, ...]`` leaves) and a mesh (``[M / D, ...]`` per device) would differ in the last bit. Here
  all the products are computed apart (:func:`_apart`) and the sums come after them; the terms are made with
  the products, so that they are fused into them rather than written out. For the few terms of a gossip mix
  (up to 8 per receiver) this costs one extra write and read of the products, far less than a loop over the
  terms (:func:`_ordered_sum`, kept for the ``[M, M]`` dense mixes whose products would not fit in
  ``_DENSE_PRODUCTS_BYTES``).
  """
  def products(weight_first):
    def scaled(k, x):
      column = weight[:, k].astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
      return column * x if weight_first else x * column
    return [jax.tree.map(functools.partial(scaled, k), term(k)) for k in range(num_terms)]

  if num_terms == 1:
    return products(True)[0]
  rounded = _apart(weight, products)
  acc = rounded[0]
  for p in rounded[1:]:
    acc = jax.tree.map(jnp.add, acc, p)
  return acc


def _apart(weight: jax.Array, products: Callable[[bool], Any]) -> Any:
  """``products(True)``, computed inside a conditional, which no fusion crosses: no product it returns is
  contracted into a multiply-add with what is done with it next.

  The predicate (on ``weight[0, 0]``) is always true, on every device, so that a mesh's collectives in the
  products are taken alike, but is not known when compiling. ``products(False)`` computes the same values with
  the operands of each multiply swapped: the branches are written apart, so that neither is removed.
  """
  corner = weight[0, 0]
  return jax.lax.cond(jnp.isnan(corner) | (corner == corner), lambda: products(True), lambda: products(False))


def _dense_sum(weight: jax.Array, full: Any) -> Any:
  """``sum_k weight[:, k] * full[k]`` over all ``k`` (the rows of ``full``'s leaves), leaf by leaf, with the same
  roundings as :func:`_products_sum` and :func:`_ordered_sum`.

  All the products at once, ``[R, K, ...]`` per leaf: one broadcast multiply computed apart (:func:`_apart`),
  then added in ``k`` order. One multiply per leaf and branch, where :func:`_products_sum` writes one per term.
  """
  def products(weight_first):
    def leaf(x):
      w = weight.astype(x.dtype).reshape(weight.shape + (1,) * (x.ndim - 1))
      return w * x[None] if weight_first else x[None] * w
    return jax.tree.map(leaf, full)

  def in_order(p):
    acc = p[:, 0]
    for k in range(1, p.shape[1]):
      acc = acc + p[:, k]
    return acc

  return jax.tree.map(in_order, _apart(weight, products))


def _ordered_sum(weight: jax.Array, term: Callable[[jax.Array], Any], num_terms: int) -> Any:
  """``sum_k weight[:, k] * term(k)`` over ``k = 0 .. num_terms - 1``, leaf by leaf, with the same roundings
  on one device and on a mesh.

  Every product is rounded to the leaves' dtype, then the products are added in ``k`` order. Written as
  plain ``w0 * x0 + w1 * x1 + ...`` (or as a matrix product), the products and sums would be fused into one
  loop that the CPU compiler contracts into fused multiply-adds, choosing per shape which product keeps its
  rounding, so one device (``[M, ...]`` leaves) and a mesh (``[M / D, ...]`` per device) would differ in the
  last bit. Here a loop (``lax.scan``, which no fusion crosses) computes product ``k`` while adding product
  ``k - 1``, carried from the previous iteration: no sum ever takes a product computed in the same loop body.
  """
  def scaled(k):
    w = weight[:, k]
    return jax.tree.map(lambda x: w.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1)) * x, term(k))

  first = scaled(0)
  if num_terms == 1:
    return first

  def body(carry, k):
    acc, previous = carry
    return (jax.tree.map(jnp.add, acc, previous), scaled(k)), None

  zero = jax.tree.map(jnp.zeros_like, first)
  # The first iteration adds product 0 to zeros (exact but for the sign of a zero sum).
  (acc, last), _ = jax.lax.scan(body, (zero, first), jnp.arange(1, num_terms))
  return jax.tree.map(jnp.add, acc, last)
