"""The runtimes' options: small typed objects, each checked when it is made, shared by the three runtimes.

``dj.simulate``, ``dj.simulate_gossip`` and ``dj.simulate_pipeline`` take the
same option objects for the concerns they share, as ``diffrax.diffeqsolve``
takes ``SaveAt`` or a step-size controller:

=====================  ========================================================
``sampling=``          :class:`Sampling`: how workers draw their minibatches
``record=``            :class:`Record`: what the run records and when, and what
                       it does with non-finite values
``checkpoint=``        :class:`Checkpoint`: where the run is saved, and resume
``execution=``         :class:`Execution`: devices, chunks, lanes, memory (the
                       results do not depend on them)
``seed=``              an int, or :class:`Runs`: many runs in one program
``worker=``            a worker plug-in (``dj.workers``): what a worker computes
=====================  ========================================================

An option that has no effect in a combination is an error naming both (for
example ``Execution(lanes=...)`` with the replica runtime, which has no lanes).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np

from delayjax._checks import check_bool, check_choice, check_float, check_int, check_seed
from delayjax.runtime._sampling import SAMPLINGS

__all__ = ["Checkpoint", "Execution", "Record", "Runs", "Sampling"]

HISTORIES = ("updates", "evaluations")
NONFINITE = ("report", "skip")


def _optional_int(name: str, value: Any, minimum: int = 1) -> int | None:
  return None if value is None else check_int(name, value, minimum=minimum)


def _optional_callable(name: str, value: Any) -> Any:
  if value is not None and not callable(value):
    raise TypeError(f"{name} must be callable or None, got {type(value).__name__}.")
  return value


def check_option(name: str, value: Any, cls: type, runtime: str) -> Any:
  """``value`` if it is a ``cls`` (``cls()`` for ``None``), or a ``TypeError`` naming the keyword and the class."""
  if value is None:
    return cls()
  if not isinstance(value, cls):
    raise TypeError(
        f"{runtime}'s {name} must be a dj.{cls.__name__} (e.g. {name}=dj.{cls.__name__}(...)) or None, got "
        f"{type(value).__name__} {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How workers draw their minibatches from ``data``.

  The minibatch of (update, worker, draw) is exactly
  ``dj.runtime.minibatch_indices(seed, update, worker, draw, ...)``: which
  examples a gradient uses depends on the seed and on these, never on the
  devices, lanes or chunks.

  Args:
    batch_size: examples per minibatch (default 32).
    scheme: ``"iid"`` (uniform with replacement), ``"epoch"`` (each worker
      walks a fresh permutation per epoch) or ``"shard"`` (each worker draws
      from its own shard: non-iid splits). ``dj.simulate_pipeline`` draws
      ``"iid"`` only.
    shards: with ``scheme="shard"``, one index array per worker; default
      contiguous, near-equal pieces. Only with ``"shard"``.
  """

  batch_size: int = 32
  scheme: str = "iid"
  shards: Sequence[Any] | None = None

  def __post_init__(self):
    object.__setattr__(self, "batch_size", check_int("Sampling.batch_size", self.batch_size, minimum=1))
    check_choice("Sampling.scheme", self.scheme, SAMPLINGS)
    if self.shards is not None and self.scheme != "shard":
      raise ValueError(
          f"Sampling.shards is only used with Sampling.scheme='shard'; got scheme={self.scheme!r}.")


@dataclasses.dataclass(frozen=True)
class Record:
  """What a run records and when, and what it does about non-finite values.

  Args:
    eval_fn: ``eval_fn(params) -> pytree of arrays``, evaluated at version 0,
      every ``every`` updates and at the end (``history.eval_update``,
      ``eval_time``, ``eval_metrics``). For the pipeline runtime it receives
      the tuple of stage parameters.
    eval_state: ``eval_fn`` is called as ``eval_fn(params, opt_state)``
      (``dj.simulate`` only), e.g. to evaluate schedule-free's averaged
      parameters, ``optax.contrib.schedule_free_eval_params(opt_state,
      params)``. Needs ``eval_fn``.
    every: updates between evaluations; ``None``: at the start and the end
      only. Needs ``eval_fn``.
    history: what the host keeps of every update (every event step for the
      replica runtime): ``"updates"`` (default) keeps a row per update
      (``history.update``, ``time``, ``loss``, ``staleness``: 28 bytes each,
      in memory and in a checkpoint); ``"evaluations"`` keeps none of them,
      for sweeps of long runs that read only evaluations. Everything else is
      the same bit for bit, and so is the compiled program. It is not part
      of the run's identity: a checkpoint written with ``"updates"``
      resumes with ``"evaluations"``; the reverse is refused (the rows were
      never written).
    callback: called on the host after every chunk with a dict of the run's
      progress (``dj.simulate`` and ``dj.simulate_pipeline``:
      ``updates_done``, ``num_updates``, ``chunk``, ``num_chunks``;
      ``dj.simulate_gossip``: ``steps_done``, ``num_steps``, ``chunk``,
      ``num_chunks``), and ``"rows"``: the chunk's new history rows, by
      name, laid out as the history's (``"loss"``: one row per update of the
      chunk, or per step for the replica runtime; ``"metrics"``: one row
      per evaluation in the chunk, like ``eval_fn``'s output; batched
      ``dj.Runs`` rows have a run axis after the row axis), so a callback
      can log metrics as they come.
    nonfinite: ``"report"`` (default): non-finite gradients, parameters or
      optimizer state are listed in the history (``nonfinite``,
      ``nonfinite_state``) and a ``RuntimeWarning`` names the first.
      ``"skip"`` (``dj.simulate`` only, where an update has contributions to
      leave out) also leaves non-finite contributions out of their update
      (weights renormalized over the rest) and skips an update whose result
      or new state is not finite, as ``optax.apply_if_finite`` does
      (``history.skipped``).
  """

  eval_fn: Callable[[Any], Any] | None = None
  every: int | None = None
  history: str = "updates"
  callback: Callable[[dict[str, Any]], None] | None = None
  nonfinite: str = "report"
  eval_state: bool = False

  def __post_init__(self):
    _optional_callable("Record.eval_fn", self.eval_fn)
    check_bool("Record.eval_state", self.eval_state)
    if self.eval_state and self.eval_fn is None:
      raise ValueError("Record.eval_state=True has no effect without Record.eval_fn (nothing to evaluate).")
    object.__setattr__(self, "every", _optional_int("Record.every", self.every))
    if self.every is not None and self.eval_fn is None:
      raise ValueError(
          f"Record.every={self.every} has no effect without Record.eval_fn (nothing to evaluate); pass "
          f"eval_fn=... or leave every=None.")
    check_choice("Record.history", self.history, HISTORIES)
    _optional_callable("Record.callback", self.callback)
    check_choice("Record.nonfinite", self.nonfinite, NONFINITE)

  @property
  def keeps_updates(self) -> bool:
    return self.history == "updates"

  @property
  def skip_nonfinite(self) -> bool:
    return self.nonfinite == "skip"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """Where a run is checkpointed, and whether it resumes.

  After every chunk (or fewer: see ``min_interval``) the whole state is
  written to ``directory`` (an Orbax checkpoint, committed by a rename; with
  a mesh across processes every process writes its own shards, and every
  process must see the directory), the history appended, with a checksum of
  each process's shards. A run
  that finds a checkpoint of the same run there continues from it,
  bit-identically to an uninterrupted run, also after ``kill -9``. The
  checkpoint records the run's identity: every function that changes the
  numbers (``loss_fn``, ``tx``, ``eval_fn``, the gossip method, the stage
  functions, a worker's local optimizer: their traced programs), the
  schedule, the options, the parameters' and state's structure and the
  data. Resuming another run is a ``ValueError`` listing what differs. While
  a run writes, the directory is locked: a second live process is refused,
  naming the holder; the lock of a killed process is taken over.

  Writing takes time (about 0.15 s a write for a small model on a CPU,
  more than a short run's chunks themselves): ``min_interval`` trades it
  against the work an interruption can lose. With ``min_interval > 0`` a
  chunk's end writes only once that many seconds of wall time have passed
  since the run started or since its last write; the rows of the chunks
  in between are kept and written with the next checkpoint. An interrupted
  run then loses at most about ``min_interval`` seconds of work (plus the
  chunk that was running), and a run shorter than ``min_interval`` writes
  none (an earlier checkpoint in the directory is left as it was). The
  results do not depend on it: a run resumed from any of its checkpoints
  ends bit-identically to one never interrupted.

  Args:
    directory: the checkpoint directory (created if missing; it must be
      writable, checked before anything compiles).
    resume: whether to continue from a checkpoint found there (default
      ``True``); ``False`` starts afresh and overwrites it.
    changes: identity components allowed to differ on resume, for a
      knowingly changed run: e.g. ``("tx",)`` continues with a new learning
      rate after a restart. Any other difference is still refused. The
      components are named in the refusal's message (``options``, ``tx``,
      ``loss_fn``, ``data``, ...). ``schedule`` cannot be changed: the
      checkpoint's gradients in flight belong to its schedule's plan.
    min_interval: seconds of wall time, at least, between two writes
      (finite, ``>= 0``); ``0`` (the default) writes after every chunk. With
      a mesh in a multi-process run it must be ``0``: every process writes
      its shards at the same chunk, and their clocks could disagree on which.
  """

  directory: str | os.PathLike[str]
  resume: bool = True
  changes: tuple[str, ...] = ()
  min_interval: float = 0.0

  def __post_init__(self):
    if not isinstance(self.directory, (str, os.PathLike)):
      raise TypeError(
          f"Checkpoint.directory must be a path (str or os.PathLike), got {type(self.directory).__name__}.")
    check_bool("Checkpoint.resume", self.resume)
    changes = self.changes
    if isinstance(changes, str) or not isinstance(changes, (tuple, list)) or not all(
        isinstance(c, str) for c in changes):
      raise TypeError(f"Checkpoint.changes must be a tuple of component names (str), got {changes!r}.")
    object.__setattr__(self, "changes", tuple(changes))
    object.__setattr__(self, "min_interval", check_float("Checkpoint.min_interval", self.min_interval, minimum=0.0))


@dataclasses.dataclass(frozen=True)
class Execution:
  """How and where the program runs. The results do not depend on ``chunk_size`` or ``phases``, and on ``lanes``
  only through rounding: the lanes are one ``vmap`` of the gradient, which XLA may compile with another summation
  order inside a gradient for another width (one lane is compiled without it). The tests' float32 runs are
  bit-identical across lanes; float64 least-squares runs with ``lanes=1`` differed from the default by about
  1e-15 relative (1e-10 after a run of SVRG in ``experiments.variance_reduction``), so a sweep that compares bits
  fixes ``lanes``.

  Args:
    mesh: ``None`` (one device), or a ``jax.sharding.Mesh`` whose one axis of
      size > 1 is ``workers`` (``dj.simulate``, ``dj.simulate_gossip``) or
      ``stages`` (``dj.simulate_pipeline``), possibly spanning processes
      (``jax.distributed``; every process makes the same call). Which results
      are bit-identical to one device is stated in each runtime's docstring.
    chunk_size: steps per compiled dispatch (and between checkpoints and
      callbacks); default about 256, balanced so the last chunk is not mostly
      padding.
    lanes: ``dj.simulate`` only: gradients per device in one step (one
      ``vmap``); default chosen from the schedule.
    phases: ``dj.simulate_gossip`` only: event phases per step; default
      chosen from the schedule.
    max_memory: bytes per device the run may hold. Default: the device's own
      limit where JAX reports one (GPUs, TPUs); on a CPU the memory the
      machine has available (``MemAvailable``). The run's state is sized from
      shapes (``jax.eval_shape``) before anything is allocated; a run that
      needs more is a ``ValueError`` naming its largest term.
    like: other schedules of the same workers, so that one compiled program
      serves all of them (a sweep over paradigms, staleness bounds,
      topologies or failures).
      ``dj.simulate_gossip``: gossip schedules of the same replicas. The
      step's shape then fits this run's schedule and every one of ``like``
      (the mixing forms, the mixes, the messages kept, the minibatches per
      gradient; every slot kind, a lane for every replica), and runs of any
      of them with the same functions, shapes, ``chunk_size`` and ``phases``
      (give it: it is otherwise chosen per schedule) reuse one program. The
      mixing forms (one for mixes of parameters, one for mixes of gradients)
      may then add a mix's terms in another order: the result agrees with
      the run without ``like`` to float rounding, not bit for bit.
      ``dj.simulate``: ``dj.cluster.Schedule`` s of as many workers, with as
      many contributions per update and minibatches per contribution at
      most as ``source``. The step's sizes (updates and reads per step, the
      gradient buffer, the read slots) are the largest any of them needs and
      the default ``chunk_size`` is chosen for the longest, so runs of any of
      them with the same functions, shapes and ``lanes`` (give it: it is
      otherwise chosen per schedule) reuse one program. The sizes only pad:
      the result equals the run without ``like`` bit for bit.
  """

  mesh: jax.sharding.Mesh | None = None
  chunk_size: int | None = None
  lanes: int | None = None
  phases: int | None = None
  max_memory: int | None = None
  like: Sequence[Any] | None = None

  def __post_init__(self):
    if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
      raise TypeError(f"Execution.mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}.")
    if self.like is not None:
      # The schedules' own type is the runtime's to check; a list becomes a tuple so the option stays hashable.
      if not isinstance(self.like, (list, tuple)):
        raise TypeError(f"Execution.like must be a list or tuple of schedules (dj.cluster.Schedule for "
                        f"dj.simulate, dj.cluster.GossipSchedule for dj.simulate_gossip), got "
                        f"{type(self.like).__name__}.")
      object.__setattr__(self, "like", tuple(self.like))
    for name in ("chunk_size", "lanes", "phases", "max_memory"):
      object.__setattr__(self, name, _optional_int(f"Execution.{name}", getattr(self, name)))

  def refuse(self, runtime: str, *names: str) -> None:
    """Raises if any option ``names`` is set: ``runtime`` has no use for it."""
    for name in names:
      if getattr(self, name) is not None:
        raise ValueError(f"Execution.{name}={getattr(self, name)!r} has no effect in {runtime}, which has no {name}.")


@dataclasses.dataclass(frozen=True)
class Runs:
  """Several runs computed as one program (``seed=dj.Runs(...)``), returned as a list of results.

  The runs share the data and one compiled program, with a leading run
  axis on the parameters, optimizer state and buffers. By default they also
  share the schedule and its plan: the chunk is ``vmap``-ed over the run
  axis, so one step computes every run's gradients, and each result equals
  the separate call with that seed (and hyper-parameters, initial
  parameters) to float rounding (batching may sum the matrix products in
  another order; integer outputs are exact). With ``sources`` each run
  follows a schedule of its own, its plan's tables padded to the sizes all
  of them fix (as ``dj.Execution(like=...)`` pads them): each run is
  computed by a call of its own of the single run's compiled chunk
  (batched, every loop count and branch the tables give would be computed
  for every run), on CPU devices several at a time, one thread per CPU
  (on one device a small model's program leaves the other cores idle);
  a run whose plan is shorter than the longest idles through the last
  steps, and each result equals the separate call bit for bit (without
  ``Execution.lanes``, runs whose plans choose different lanes get a
  program per lane count). What that saves is the host's work per call
  and, on a CPU with several cores, the time of computing the runs one
  after the other (``experiments/dai_staleness`` at five seeds, on 2
  cores: 17.6 s instead of 22.8 s). ``Record.callback`` is told the updates
  of all the runs together. One device; ``R`` times the memory. A
  ``dj.Checkpoint`` holds every run of one program (their seeds, initial
  parameters and hyper-parameters are part of its identity, and with
  ``sources`` every run's schedule); runs whose plans choose different lanes
  are checkpointed in a folder per lane count (``lanes-K``).

  That is ``dj.simulate``. ``dj.simulate_gossip`` computes every run by a
  call of its own, as ``sources`` runs are computed here (with or without
  ``sources``, which are then ``dj.cluster.GossipSchedule``), each equal bit
  for bit to its single call with the other runs' schedules in
  ``Execution.like`` (one program per number of phases the plans choose,
  without ``Execution.phases``); its callback is told each run's chunks
  apart. ``dj.simulate_pipeline`` computes its runs so too (``sources``
  are then pipeline schedules of the call's model stages; hyper-parameters
  are set in every stage's optimizer state), each equal bit for bit to its
  single call. These two runtimes checkpoint such a call's runs each on its
  own (``dj.Checkpoint``: a file per run, ``sources`` or not) and resume
  each where it was.

  Args:
    seeds: one int seed per run, or one int shared by every run.
    hyperparams: ``None``, or ``{name: [v_0, ..., v_{R-1}]}``: run ``r`` with
      the hyper-parameter ``name`` of ``tx``'s ``optax.inject_hyperparams``
      state set to ``v_r`` (e.g. ``{"learning_rate": [0.1, 0.03]}``).
    sources: ``None``, or one ``dj.cluster.Schedule`` per run, all of the
      same workers: run ``r`` follows ``sources[r]``; the call's ``source``
      is then ``None``. Every schedule has the same most contributions per
      update and minibatches per contribution (they shape what ``tx`` is
      given).
    params: ``None``, or one initial parameter pytree per run, each of the
      call's ``params``' structure, shapes and dtypes: run ``r`` starts
      from ``params[r]`` (its optimizer state is ``tx.init(params[r])``).

  All sequences have one length ``R`` >= 1.
  """

  seeds: int | Sequence[int] = 0
  hyperparams: dict[str, Sequence[Any]] | None = None
  sources: Sequence[Any] | None = None
  params: Sequence[Any] | None = None

  def __post_init__(self):
    batched = isinstance(self.seeds, (list, tuple, range, np.ndarray))
    if self.hyperparams is not None and not isinstance(self.hyperparams, dict):
      raise TypeError(
          f"Runs.hyperparams must be a dict {{name: one value per run}} or None, got "
          f"{type(self.hyperparams).__name__}.")
    values = {name: list(np.asarray(v)) if np.ndim(v) else v for name, v in (self.hyperparams or {}).items()}
    lengths = {f"hyperparams[{name!r}]": len(v) if isinstance(v, list) else None for name, v in values.items()}
    for name in ("sources", "params"):
      given = getattr(self, name)
      if given is None:
        continue
      if not isinstance(given, (list, tuple)):
        raise TypeError(f"Runs.{name} must be a list or tuple with one entry per run, or None; got "
                        f"{type(given).__name__}.")
      object.__setattr__(self, name, tuple(given))
      lengths[name] = len(given)
    if batched:
      seeds = tuple(check_seed(f"Runs.seeds[{i}]", s) for i, s in enumerate(self.seeds))
      lengths["seeds"] = len(seeds)
    if not lengths or any(n is None for n in lengths.values()) or len(set(lengths.values())) != 1 or (
        0 in lengths.values()):
      raise ValueError(
          f"Runs take one value per run in seeds (a sequence), in every hyperparams entry (a sequence) and in "
          f"sources and params when given, all of one non-zero length; got lengths "
          f"{lengths or 'none: a single int seed and no hyperparams'}.")
    if not batched:
      seeds = (check_seed("Runs.seeds", self.seeds),) * next(iter(lengths.values()))
    object.__setattr__(self, "seeds", seeds)
    object.__setattr__(self, "hyperparams", values)

  @property
  def num_runs(self) -> int:
    return len(self.seeds)


def runtime_options(runtime: str, *, seed: Any, sampling: Any, record: Any, execution: Any,
                    no_effect: tuple[str, ...] = (), server: bool = False) -> tuple[int, Runs | None, Sampling,
                                                                                    Record, Execution]:
  """A runtime's shared options checked: ``(seed of the first run, Runs or None, sampling, record, execution)``.

  ``no_effect``: the ``Execution`` fields the runtime has no use for (refused when set); ``server``: whether it
  is ``dj.simulate``, the one runtime that evaluates an optimizer state and skips non-finite contributions.
  """
  seed, runs = check_seed_or_runs(seed, runtime)
  sampling = check_option("sampling", sampling, Sampling, runtime)
  record = check_option("record", record, Record, runtime)
  execution = check_option("execution", execution, Execution, runtime)
  execution.refuse(runtime, *no_effect)
  if record.eval_state and not server:
    raise ValueError(
        f"Record.eval_state=True is defined for dj.simulate only (one optimizer state); {runtime} calls "
        f"eval_fn(params).")
  if record.skip_nonfinite and not server:
    raise ValueError(
        "Record.nonfinite='skip' is defined for dj.simulate only (an update there can leave out a contribution); "
        f"{runtime} reports non-finite values (nonfinite='report').")
  return seed, runs, sampling, record, execution


def check_runs_device(runs: Runs, mesh: Any) -> None:
  """Several runs in one call (``seed=dj.Runs(...)``) are computed on one device: refused a ``mesh``."""
  if mesh is not None:
    raise ValueError(f"several runs (seed={runs!r}) are computed on one device; got Execution.mesh.")


def runs_sources(runs: Runs, schedule: Any, execution: Execution) -> tuple[Any, ...]:
  """The schedule of each run of a call of several (``seed=dj.Runs(...)``) whose runs are computed each by a call
  of its own (``dj.simulate_gossip``, ``dj.simulate_pipeline``): ``Runs.sources`` (with ``schedule=None``), else
  ``schedule`` for every run; such a call is refused a mesh."""
  check_runs_device(runs, execution.mesh)
  if runs.sources is None:
    return (schedule,) * runs.num_runs
  if schedule is not None:
    raise ValueError(f"with seed=dj.Runs(sources=[...]) every run follows its own schedule: pass schedule=None, "
                     f"got {type(schedule).__name__}.")
  return tuple(runs.sources)


def check_seed_or_runs(seed: Any, runtime: str) -> tuple[int, Runs | None]:
  """``(seed of the first run, Runs or None)`` from a runtime's ``seed`` argument."""
  if isinstance(seed, Runs):
    return seed.seeds[0], seed
  if isinstance(seed, (list, tuple, range, np.ndarray)):
    raise TypeError(
        f"{runtime}'s seed must be an int; for several runs in one program pass seed=dj.Runs(seeds={list(seed)!r}).")
  return check_seed("seed", seed), None
