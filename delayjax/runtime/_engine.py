"""The engine every runtime runs on: chunks of compiled steps, driven from the host.

A runtime (the server runtime ``dj.simulate``; a replica or a pipeline
runtime) plans its run on the host as a sequence of *steps* of one static
shape, each described by a row of NumPy *tables*, and writes one function,
``step``, that advances its device state (the *carry*) by one step. The engine
does the rest, the same way for every runtime:

1. places the initial carry and the run's constants (the data) on the
   devices: one device, or laid out on a ``mesh`` by ``PartitionSpec``,
   across processes too;
2. compiles ``chunk_size`` steps into one ``lax.scan`` (inside
   ``jax.shard_map`` over the mesh, the carry donated), once; on one CPU
   device a small model's program with XLA's quicker-compiling options
   (:func:`compile_options`, by ``step_entries``);
3. loops over the chunks: the chunk's host tables are placed and the scan is
   dispatched once; its outputs become host *records* (rows of history);
4. after every chunk, writes a checkpoint (an Orbax checkpoint of the
   carry, each process writing its own shards, with the chunks done, the
   run's fingerprint and a checksum; the chunk's records appended to the
   history file), or, with a minimum interval between writes, after the
   first chunk that ends that long after the run's start or its last write
   (the records of the chunks in between appended together), and calls the
   user's callback;
5. resumes from a checkpoint of the same fingerprint, bit-identically, the
   carry read straight into its layout; its history must hold every record
   of ``records_like`` (a run that keeps fewer, e.g. no per-update rows,
   leaves the others unread; one that keeps more is refused: the rows it
   needs were never written).

The interface is :class:`Program`, a ``NamedTuple`` a runtime fills in:

``carry``, ``carry_specs``
  the initial device state as a tuple of host arrays (pytrees), and one
  ``PartitionSpec`` per element (a prefix of it) saying how it is laid out
  over the mesh's axis (``workers``, or the one the runtime checked with
  :func:`check_mesh`, e.g. ``stages``): ``P()`` replicated, ``P("workers")``
  split on its leading axis. A replica runtime keeps its M replicas on a
  leading worker axis with ``P("workers")``; the pipeline runtime one stage
  per device with ``P("stages")``.
``constants``, ``constant_specs``
  what every step reads and nothing writes (the data, per-worker tables),
  placed once.
``step(carry, tables, constants) -> (carry, outputs)``
  one step, traced once. ``tables`` is one row (the step's slice) of the
  chunk's tables. Under a mesh it runs per device inside ``shard_map``
  (``jax.lax.axis_index("workers")``, collectives over ``"workers"`` such as
  ``all_gather`` or ``ppermute``); ``outputs`` (stacked over the chunk's
  steps by the scan) are laid out by ``output_specs``.
``table_specs``, ``output_specs``
  the layouts of one chunk's tables (leading axis: the chunk's steps) and of
  the step outputs.
``num_chunks``, ``tables(chunk)``
  how many chunks, and chunk ``c``'s host tables (a pytree of NumPy arrays,
  leading axis ``chunk_size``; a last chunk is padded to that size with steps
  that do nothing, so the program compiles once).
``collect(chunk, tables, outputs) -> dict[str, pytree]``
  the chunk's device outputs (and its host tables) turned into host rows:
  each named record a pytree of NumPy arrays with a leading row axis.
  The engine appends them in chunk order and returns them concatenated.
``records_like``
  one empty row-pytree per record name (leading axis 0): the names, the
  structure and the dtypes, used to restore a checkpoint and for a run of no
  rows.
``initial(carry) -> dict[str, pytree]`` or ``None``
  rows recorded before the first chunk from the placed carry (e.g. the
  evaluation at version 0); not called on resume.
``evaluate(chunk, tables, carry) -> dict[str, pytree]`` or ``None``
  more of chunk ``chunk``'s rows, computed from the carry it leaves by
  programs of the runtime's own (e.g. an evaluation of the models the chunk
  kept in its carry at the steps its host ``tables`` flag), in the thread
  that computed the chunk, before the carry goes on to the next chunk;
  merged with ``collect``'s rows. Not for a program of several runs.
``progress(chunk) -> dict``
  what the user's callback is told after chunk ``chunk``.
``fingerprint``
  the run's identity: ``{component: digest}`` (or one string), each
  component a digest of one thing that changes the run's numbers
  (``_checkpoint.digest`` and ``tree_digest`` make them). Resuming from a
  checkpoint of another fingerprint is refused, naming the components that
  differ, unless ``run``'s ``checkpoint.changes`` names them (a knowingly
  changed run).
``check(carry) -> bool scalar`` or ``None``
  a health check of the carry (e.g. "the parameters and optimizer state are
  finite"), computed inside the chunk's program after its last step (one
  reduction per chunk, not per step) and recorded, one row per chunk, as
  the record ``"check"``.
``runs``, ``constant_run_axes``, ``table_run_axes``
  ``None``, or the number ``R`` of runs computed as one program: every
  leaf of the carry then has a leading run axis, ``constant_run_axes``
  (a prefix of ``constants``, ``0`` or ``None`` per part, as ``vmap``'s
  ``in_axes``) says which constants do, ``table_run_axes`` (``None``: the
  runs share the tables; ``0``: each has its own, stacked before the
  chunk's step axis) which tables do. Runs that share the tables are one
  program, ``vmap``-ed over the run axis. Runs with tables of their own are
  computed one after the other, each by the single run's compiled chunk
  (see :class:`_Separately`); ``initial`` then gets the list of the runs'
  carries. Either way the outputs and the ``"check"`` record gain a run
  axis (the outputs' first, the record's second). One device only; runs with
  tables of their own are checkpointed as one carry with a leading run axis
  (the program's ``carry``), stacked on the host, and placed run by run on
  resume.
``step_entries``
  about how many entries a step updates elementwise (the parameters: all
  replicas', all stages'), or ``None``: the size of the model, which
  chooses the program's compile options (:func:`compile_options`).
``cache_key``
  a hashable identity of the compiled program, or ``None`` (compile afresh).
  Programs with equal keys (and meshes) share one jitted chunk function, so
  a sweep's second run neither traces nor compiles: the key must cover
  everything ``step`` and ``check`` read that is not an argument (the
  traced programs of the user's functions, the static sizes of the plan,
  the options), and every per-run value that does not change the program
  (a seed, the initial state, the data) must come in through ``carry``,
  ``constants`` or the tables. JAX's own cache of that function then
  handles argument shapes: a run whose carry or tables differ in shape only
  retraces it.

:func:`run` executes a ``Program`` and returns the final carry (on the
devices) and the records; :func:`run_together` executes several single-run
programs (a sweep's runs) side by side, each as :func:`run` would. A runtime
then assembles its own result (history, statistics) from them;
:mod:`delayjax.runtime._history` holds the pieces of that common to all
runtimes (evaluation points, the non-finite report), and
:mod:`delayjax.runtime._checkpoint` the checkpoint format.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import re
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from delayjax._memory import available_memory
from delayjax.runtime import _checkpoint
from delayjax.runtime._lock import locked
from delayjax.runtime._options import Checkpoint
from delayjax.transforms._hooks import worker_capacity

AXIS = "workers"


class Program(NamedTuple):
  """What a runtime gives the engine (see the module docstring for each field)."""

  carry: tuple[Any, ...]
  carry_specs: tuple[Any, ...]
  constants: Any
  constant_specs: Any
  step: Callable[[Any, Any, Any], tuple[Any, Any]]
  table_specs: Any
  output_specs: Any
  num_chunks: int
  tables: Callable[[int], Any]
  collect: Callable[[int, Any, Any], dict[str, Any]]
  records_like: dict[str, Any]
  progress: Callable[[int], dict[str, Any]]
  fingerprint: str | dict[str, str]
  initial: Callable[[Any], dict[str, Any]] | None = None
  check: Callable[[Any], Any] | None = None
  evaluate: Callable[[int, Any, Any], dict[str, Any]] | None = None
  cache_key: Any = None
  runs: int | None = None
  constant_run_axes: Any = None
  table_run_axes: Any = None
  rows_view: Callable[[dict[str, Any]], dict[str, Any]] | None = None
  step_entries: int | None = None


# Jitted functions of recent programs, by key (Program.cache_key and the mesh), most recent last.
# Bounded: each holds its compiled executables (and what its closures reference) until evicted.
CACHE_SIZE = 8
_cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_cache_counts = {"hits": 0, "misses": 0}


def cached(key: Any, build: Callable[[], Any]) -> Any:
  """``build()``, or what it returned for an equal ``key`` among the last ``CACHE_SIZE`` (``None``: no cache)."""
  if key is None:
    return build()
  if key in _cache:
    _cache_counts["hits"] += 1
    _cache.move_to_end(key)
    return _cache[key]
  _cache_counts["misses"] += 1
  value = _cache[key] = build()
  while len(_cache) > CACHE_SIZE:
    _cache.popitem(last=False)
  return value


def cache_info() -> dict[str, int]:
  """The compile cache's ``hits`` and ``misses`` so far, and its current ``size``."""
  return {**_cache_counts, "size": len(_cache)}


def clear_cache() -> None:
  """Forgets every cached jitted function (the next run of each program traces and compiles again)."""
  _cache.clear()


def program_cache_key(tag: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> tuple[Any, ...] | None:
  """A compile-cache key for ``fn`` on ``args`` (see ``_engine.cached``): ``tag`` and the digest of the program it
  traces to, or ``None`` when it calls back into Python (such programs cannot be told apart, so they compile
  afresh)."""
  key = program_key(fn, *args)
  return None if key is False else (*tag, key)


def program_key(fn: Callable[..., Any], *args: Any) -> str | bool:
  """A digest of the program ``fn`` traces to on ``args``: its jaxpr's text (without memory addresses) and
  the values of the arrays it closes over; ``False`` if it calls back into Python (two callbacks of
  different functions print alike)."""
  return program_key_and_shape(fn, *args)[0]


def program_key_and_shape(fn: Callable[..., Any], *args: Any) -> tuple[str | bool, Any]:
  """:func:`program_key` and ``jax.eval_shape(fn, *args)``, from one trace."""
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  text = str(closed.jaxpr)
  if "callback" in text:
    return False, shape
  consts = [jax.random.key_data(c) if jnp.issubdtype(jnp.result_type(c), jax.dtypes.prng_key) else c
            for c in closed.consts]
  return _checkpoint.digest(re.sub(r" at 0x[0-9a-fA-F]+", "", text), *[np.asarray(c) for c in consts]), shape


def program_digest(fn: Callable[..., Any], *args: Any) -> str:
  """A digest of the program ``fn`` traces to on ``args`` (its jaxpr's text, with no memory addresses)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return _checkpoint.digest(re.sub(r" at 0x[0-9a-fA-F]+", "", text))


def identity(*, schedule: str, options: dict[str, Any], params: Any, data: Any,
             programs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]],
             trees: dict[str, Any] | None = None) -> dict[str, str]:
  """A run's identity (``Program.fingerprint``), the same components for every runtime.

  ``schedule``: a digest of the host schedule; ``options``: every option that
  changes the numbers; ``params`` and ``data``: digested with their values;
  ``programs``: ``{name: (fn, example_args)}``, every function that changes the
  numbers (``tx``, ``loss_fn``, ``eval_fn``, the gossip method, the stage
  functions, a worker's local optimizer), each digested by the program it
  traces to on the example arguments (hyper-parameters are literals in it);
  ``trees``: more structures to match (e.g. the optimizer state's), by name.
  Resuming a checkpoint whose identity differs names the components.
  """
  out = {
      "schedule": schedule,
      "options": _checkpoint.digest(sorted(options.items())),
      "params (structure, shapes, dtypes)": _checkpoint.tree_digest(params, values=False),
      "initial params": _checkpoint.tree_digest(params, values=True),
      "data": _checkpoint.tree_digest(data, values=True),
  }
  for name, tree in (trees or {}).items():
    out[f"{name} (structure, shapes, dtypes)"] = _checkpoint.tree_digest(tree, values=False)
  for name, (fn, args) in programs.items():
    out[name] = program_digest(fn, *args)
  return out


def check_extra_args(tx: Any, params: Any, opt_state: Any, runtime: str, passed: dict[str, Any]) -> None:
  """Refuses, before anything compiles, a ``tx`` that needs an extra argument ``runtime`` does not pass.

  ``tx.update`` is traced once (``jax.eval_shape``: nothing computed) with
  the extra arguments ``passed``; a delayjax transformation missing one
  says which, and the refusal names the runtime instead of telling a
  hand-written loop to pass it.
  """
  try:
    jax.eval_shape(lambda s, p: tx.update(p, s, p, **passed), opt_state, params)
  except TypeError as e:
    if "value" not in passed and _missing_value(e):
      raise ValueError(
          f"tx needs the extra argument value= (e.g. optax.contrib.reduce_on_plateau), which {runtime} does not "
          f"pass; dj.simulate passes each update's loss as value.") from None
    raise
  except ValueError as e:
    needed = re.search(r"needs the extra argument (\w+)=", str(e))
    if needed is None:
      raise
    raise ValueError(
        f"tx needs the extra argument {needed.group(1)}, which {runtime} does not pass (it passes "
        f"{sorted(passed) or 'none'}); run it with a runtime that provides it (dj.simulate passes staleness, "
        f"stale_params and worker) or leave that transformation out.") from None


def _missing_value(error: TypeError) -> bool:
  return bool(re.search(r"missing 1 required keyword-only argument: 'value'", str(error)))


def takes_value(tx: Any, params: Any, opt_state: Any, passed: dict[str, Any]) -> bool:
  """Whether ``tx.update`` requires the extra argument ``value`` (the loss: ``optax.contrib.reduce_on_plateau``,
  ``optax.scale_by_backtracking_linesearch``'s kin), traced once with the extra arguments ``passed``."""
  try:
    # The extra arguments are traced too (they may be shapes only).
    jax.eval_shape(lambda s, p, extra: tx.update(p, s, p, **extra), opt_state, params, passed)
  except TypeError as e:
    if _missing_value(e):
      return True
    raise
  return False


def check_mesh(mesh: Any, axis: str = AXIS) -> int:
  """The number of devices on ``mesh``'s ``axis`` (1 without a mesh), or a clear error.

  A runtime spreads its carry over one named axis: ``workers`` for the server and replica runtimes,
  ``stages`` for the pipeline runtime. The specs of a :class:`Program` may name that axis; the engine
  places and compiles them the same way whatever its name.
  """
  if mesh is None:
    return 1
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh must have an axis named {axis!r}; got axes {mesh.axis_names}.")
  others = [n for n in mesh.axis_names if n != axis and mesh.shape[n] != 1]
  if others:
    raise ValueError(
        f"mesh may only spread the {axis!r} axis; got other axes of size > 1: "
        f"{ {n: mesh.shape[n] for n in others} }.")
  return int(mesh.shape[axis])


class CheckpointArguments(NamedTuple):
  """A runtime's ``checkpoint`` option as the engine reads it (:func:`checkpoint_arguments`)."""

  directory: str | None = None  # where to write (``None``: no checkpoints)
  resume: bool = True  # whether to continue from a checkpoint found there
  changes: tuple[str, ...] = ()  # fingerprint components allowed to differ on resume
  min_interval: float = 0.0  # seconds of wall time at least between two writes (``0``: after every chunk)


def checkpoint_arguments(checkpoint: Any) -> CheckpointArguments:
  """A runtime's ``checkpoint`` option (a ``dj.Checkpoint`` or ``None``) read once, for the engine; the
  directory is created and checked to be writable before anything compiles."""
  if checkpoint is None:
    return CheckpointArguments()
  if not isinstance(checkpoint, Checkpoint):
    raise TypeError(
        f"checkpoint must be a dj.Checkpoint (e.g. checkpoint=dj.Checkpoint('runs/a')) or None, got "
        f"{type(checkpoint).__name__} {checkpoint!r}.")
  directory = _checkpoint.check_directory("Checkpoint.directory", checkpoint.directory)
  return CheckpointArguments(directory, checkpoint.resume, checkpoint.changes, checkpoint.min_interval)


def tree_bytes(tree: Any) -> int:
  """The bytes of ``tree``'s leaves (arrays, scalars or ``jax.ShapeDtypeStruct``), read from their shapes and
  dtypes (nothing copied)."""
  return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).itemsize
             for x in jax.tree.leaves(tree))


def memory_terms(parts: dict[str, tuple[Any, bool]], data: Any, num_devices: int) -> dict[str, int]:
  """Bytes per device of what a run keeps on its devices, by term: ``parts[name] = (tree, split)``, a tree
  of arrays or ``jax.ShapeDtypeStruct`` (nothing need be allocated) and whether it is split over the mesh's
  devices (a leading axis laid out on it) rather than held whole by each; ``data`` is held by each."""
  out = {name: tree_bytes(tree) // (num_devices if split else 1) for name, (tree, split) in parts.items()}
  out["data"] = tree_bytes(data)
  return out


def shapes(tree: Any, lead: tuple[int, ...] = ()) -> Any:
  """``tree``'s leaves as ``jax.ShapeDtypeStruct``, with the axes ``lead`` in front (nothing allocated)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      lead + np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x)), tree)


def memory_limit(max_memory: int | None, mesh: Any) -> tuple[int, str] | None:
  """The bytes a run may keep per device and where that limit comes from: ``Execution.max_memory``, else
  the device's reported limit, else on a CPU the machine's available memory shared by the run's devices
  (``None`` when none of these is known)."""
  if max_memory is not None:
    return max_memory, "Execution.max_memory"
  # One of this process's devices (another process's cannot be asked).
  device = jax.local_devices()[0] if mesh is None else next(
      d for d in mesh.devices.flat if d.process_index == jax.process_index())
  try:
    stats = device.memory_stats()
  except (AttributeError, jax.errors.JaxRuntimeError):
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"the memory of {device.device_kind}"
  available = available_memory() if device.platform == "cpu" else None
  if available is None:
    return None
  # CPU devices share the host's memory.
  sharing = 1 if mesh is None else sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return available // sharing, (f"the memory this machine has available, {size_text(available)}"
                                + (f", shared by {sharing} CPU devices" if sharing > 1 else ""))


def check_memory(runtime: str, memory: dict[str, int], limit: tuple[int, str] | None,
                 hints: dict[str, str]) -> None:
  """Refuses a run whose kept state (:func:`memory_terms`) exceeds ``limit`` (:func:`memory_limit`), naming
  its largest term and what shrinks it (``hints[term]``)."""
  if limit is None:
    return
  limit, source = limit
  total = sum(memory.values())
  if total <= limit:
    return
  name, size = max(memory.items(), key=lambda kv: kv[1])
  hint = hints.get(name) or "a smaller data set (it is kept on every device)"
  raise ValueError(
      f"{runtime} would keep {size_text(total)} per device (before temporaries), more than {size_text(limit)} "
      f"({source}); the largest term is the {name}, {size_text(size)}: to shrink it, use {hint}.")


def size_text(num_bytes: int) -> str:
  """``num_bytes`` in GiB, MiB or KiB, for messages."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.1f} {unit}"
  return f"{num_bytes} bytes"


def check_worker_capacity(opt_state: Any, num_workers: int, source: str) -> None:
  """Refuses, before anything compiles, a state whose per-worker tables have fewer rows than the workers.

  Inside ``jit`` a worker index past a table could not raise (it makes the
  update NaN, see ``dj.worker_capacity``); the runtime knows the worker count
  up front, so it says so clearly instead.
  """
  capacity = worker_capacity(opt_state)
  if capacity is not None and capacity < num_workers:
    raise ValueError(
        f"tx keeps per-worker tables of {capacity} rows (the num_workers of dj.dana, dj.dana_slim or "
        f"dj.delay_compensation), but {source} has {num_workers} workers; pass num_workers={num_workers} "
        f"(or more).")


def host(x: Any) -> np.ndarray:
  """A replicated (possibly multi-process) array as NumPy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def placer(mesh: Any) -> Callable[[Any, P], Any]:
  """Puts copies of values on the devices: one device, or laid out on ``mesh`` by spec (any process count).

  Every value is a copy of its own: the carry is donated to the chunk
  function and the caller's arrays must survive, and a CPU transfer may
  share the host's memory, which its owner could still change. On one
  device a NumPy value is transferred with ``jax.device_put`` from a host
  copy, which dispatches no program (a ``jnp.array(x, copy=True)`` per leaf
  compiled a copy program per leaf shape and dispatched one per run and
  leaf: about 1,000 dispatches for ``experiments/dai_staleness`` at one
  seed); a device array is copied by ``jnp.array``. The tables are placed
  by :func:`table_placer`.
  """
  if mesh is None:
    return lambda x, spec: (jax.device_put(np.array(x)) if isinstance(x, (np.ndarray, np.generic))
                            else jnp.array(x, copy=True))

  def put(x, spec):
    value = host(x)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return put


def table_placer(mesh: Any) -> Callable[[Any, P], Any]:
  """Puts a chunk's tables where its program reads them: laid out on ``mesh`` by spec as :func:`placer` does, or
  on one device, handed to the program as host copies of their own.

  Tables are placed every chunk, and a program given NumPy arrays transfers them in one call of its own:
  per chunk of 26 small tables, 0.2 ms against 1.3 ms for a ``jax.device_put`` of each (measured on 2 CPU
  cores), which is most of the host's work per chunk in a short run. Each is a copy of its own, so that no
  owner of the original can change what a transfer on the CPU might share; a leaf that is not a NumPy array is
  placed as :func:`placer` places it.
  """
  put = placer(mesh)
  if mesh is None:
    return lambda x, spec: np.array(x) if isinstance(x, np.ndarray) else put(x, spec)
  return put


def place(put: Callable[[Any, P], Any], specs: Any, tree: Any) -> Any:
  """Every leaf of ``tree`` placed by ``put`` with its spec (``specs`` a prefix of ``tree``)."""
  return jax.tree.map(lambda spec, sub: jax.tree.map(lambda x: put(x, spec), sub), specs, tree,
                      is_leaf=lambda x: isinstance(x, P))


def shardings(mesh: Any, specs: Any, tree: Any) -> Any:
  """The sharding of every leaf of ``tree`` once placed by :func:`placer` with its spec."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: one, tree)
  return jax.tree.map(lambda spec, sub: jax.tree.map(lambda x: NamedSharding(mesh, spec), sub), specs, tree,
                      is_leaf=lambda x: isinstance(x, P))


# A program whose step updates at most this many entries (Program.step_entries: a small model's parameters) is
# compiled with XLA's quicker-compiling options on a CPU (see compile_options).
SMALL_MODEL_ENTRIES = 20_000
_SMALL_MODEL_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
# LLVM's optimization level for a small model's programs where nothing has set one, and the lowest jaxlib whose
# sharded programs round at that level as their one-device twins (see compile_options).
_SMALL_MODEL_LEVEL = 1
_SMALL_MODEL_LEVEL_SINCE = (0, 10)
_small_model_supported: bool | None = None
# Whether start_compiler_probe has started the probe, and the lock the probe holds.
_probe_started = False
_probe_lock = threading.Lock()


def compile_options(entries: int | None) -> dict[str, Any] | None:
  """XLA's options for a program whose step updates ``entries`` entries elementwise (a model's parameters;
  ``None``: not known, the defaults).

  On a CPU, XLA's default kernel emitters (MLIR's fusion emitters) compile each kernel about 30% slower than
  its older elemental emitters, and their elementwise kernels run faster, the more so the more entries they
  update: on ``experiments/dai_staleness``'s Adam programs, 0.86 s of compile and 97 us a step against 0.60 s
  and 121 us for the 3-layer MLP (13,130 parameters), 34 us against 42 us for the 1-layer one (4,810). The
  two are even at about 1.4e8 parameter-steps (10,800 steps of the first), so a small model, whose runs are
  mostly compile (a simulator's sweeps of short runs), gets the elemental emitters: at most
  :data:`SMALL_MODEL_ENTRIES` entries, where a run of up to about 7,000 steps gains. It also gets LLVM's
  optimization level 1 instead of 3 (``xla_backend_optimization_level``), unless JAX
  (``jax_disable_most_optimizations``, ``jax_optimization_level``) or ``XLA_FLAGS`` set a level, on a jaxlib
  whose sharded programs then round as their one-device twins (0.10.2 does; on 0.8.0 and 0.9.0 an entry of
  ``tests/gossip``'s runs on one device and on a mesh differed by an ulp, so before 0.10 level 3 stays): with the same
  3-layer Adam program, 1.42 s of compile for its first four runs against 1.58 s, and twenty more runs in 1.27 s
  against 1.32 s; ``experiments/gossip_adpsgd``'s program, 0.42 s of compile against 0.51 s and 6% more time a
  step; ``dai_staleness`` at one seed 6.6 s against 7.4 s. The choice depends on the model alone, not on how long a
  run is or how many runs a call holds, so that a run's numbers do not change with them: the emitters and the
  levels may round differently (357 of ``run all``'s 3,269 records changed in their last digits when the
  emitters came; every record of ``dai_staleness``, whose stale runs amplify a rounding, with the level), and
  a program is always compiled the same way. Accelerators and an XLA without these options keep the defaults;
  a program laid out on a mesh (:func:`chunk_function`) gets the level alone (compiled with the elemental
  emitters, a sharded program can round otherwise than its one-device twin; at another level, it does).

  A small model's program is also generated in :data:`_SMALL_MODEL_MODULES` LLVM modules rather than XLA's
  default 32 (``xla_cpu_parallel_codegen_split_count``, unless ``XLA_FLAGS`` sets it), compiled side by side:
  each module pays LLVM's setup, and on 2 cores ``experiments/gossip_adpsgd``'s program took 0.26 s of wall and
  0.45 s of CPU in 32 modules against 0.23 s and 0.38 s in 2 (0.24 s in 4). How kernels are grouped into modules
  can change a kernel's rounding (in 8 modules, and with jaxlib 0.8.0 in 2, the float64 HSAG and SAGA runs
  that ``tests/transforms/test_hsag.py`` compares bit for bit differed in one entry's last bit), so the count is
  fixed, not the machine's CPU count (a run's numbers do not depend on the machine), and set from jaxlib 0.10
  on, where in 2 modules every record of ``run all`` is that of 32 bit for bit and the test suite passes.
  """
  if entries is None or entries > SMALL_MODEL_ENTRIES or jax.devices()[0].platform != "cpu":
    return None
  if not _small_model_options_supported():
    return None
  options = {**_SMALL_MODEL_OPTIONS, **_codegen_split()}
  if _level_set_elsewhere() or _jaxlib_version() < _SMALL_MODEL_LEVEL_SINCE:
    return options
  return {**options, "xla_backend_optimization_level": _SMALL_MODEL_LEVEL}


# The LLVM modules a small model's program is generated in, and the lowest jaxlib where they round as XLA's
# default count does (see compile_options).
_SMALL_MODEL_MODULES = 2
_SMALL_MODEL_MODULES_SINCE = (0, 10)


def _codegen_split() -> dict[str, int]:
  """A small model's program generated in :data:`_SMALL_MODEL_MODULES` LLVM modules (see
  :func:`compile_options`), with jaxlib 0.10 or later and where ``XLA_FLAGS`` does not set the count."""
  if (_jaxlib_version() < _SMALL_MODEL_MODULES_SINCE
      or "xla_cpu_parallel_codegen_split_count" in os.environ.get("XLA_FLAGS", "")):
    return {}
  return {"xla_cpu_parallel_codegen_split_count": _SMALL_MODEL_MODULES}


def start_compiler_probe() -> None:
  """Starts finding out, in the background, whether this XLA takes the small-model options
  (:func:`compile_options`), on a CPU device where it is not known yet: called by a runtime once a run's arguments
  are checked (the gossip runtime's), so that the probe's compile (the process's first, which pays XLA's setup)
  runs beside the run's planning rather than before its first program is compiled."""
  global _probe_started
  with _probe_lock:
    if _small_model_supported is not None or _probe_started or jax.devices()[0].platform != "cpu":
      return
    _probe_started = True
  _in_background(_small_model_options_supported)


def _small_model_options_supported() -> bool:
  """Whether this XLA compiles a program with the small-model options: found out once per process, here or by
  :func:`start_compiler_probe`'s thread (a caller meanwhile waits for its answer)."""
  global _small_model_supported
  with _probe_lock:
    if _small_model_supported is None:
      try:
        jax.jit(lambda x: x + 1, compiler_options={**_SMALL_MODEL_OPTIONS, **_codegen_split(),
                                                   "xla_backend_optimization_level": _SMALL_MODEL_LEVEL}
                ).lower(np.float32(0)).compile()
        _small_model_supported = True
      except Exception:  # noqa: BLE001 (an XLA without the option refuses it; any refusal means: defaults)
        _small_model_supported = False
    return _small_model_supported


def _jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's version, as numbers (``(0, 10, 2)``)."""
  import jaxlib.version

  return tuple(int(part) for part in re.findall(r"\d+", jaxlib.version.__version__)[:3])


def _level_set_elsewhere() -> bool:
  """Whether JAX (``jax_disable_most_optimizations``, ``jax_optimization_level``) or ``XLA_FLAGS`` set how much
  the compiler optimizes (a program's own options would override theirs)."""
  return (bool(jax.config.values.get("jax_disable_most_optimizations"))
          or jax.config.values.get("jax_optimization_level") not in (None, "UNKNOWN")
          or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""))


def entries(tree: Any) -> int:
  """The entries of ``tree``'s leaves, all together (a program's ``step_entries``)."""
  return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def _chunk_options(step_entries: int | None, mesh: Any) -> dict[str, Any] | None:
  """The compile options of a chunk program of ``step_entries`` (:func:`compile_options`) on ``mesh``: on a mesh,
  the optimization level alone (the one-device program's, so that the two round alike)."""
  options = compile_options(step_entries)
  if mesh is None or options is None:
    return options
  return {k: v for k, v in options.items() if k == "xla_backend_optimization_level"} or None


def jit_like_chunk(fn: Callable[..., Any], step_entries: int | None, mesh: Any) -> Callable[..., Any]:
  """``jax.jit(fn)`` compiled with the options of the chunk program of ``step_entries`` on ``mesh``
  (:func:`compile_options`): a run's evaluation before its first chunk rounds as the chunk's own evaluations
  do."""
  return jax.jit(fn, compiler_options=_chunk_options(step_entries, mesh))


def chunk_function(program: Program, mesh: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """``chunk(carry, constants, tables) -> (carry, outputs)``: a ``lax.scan`` of ``program.step`` over the
  chunk's steps, jitted with the carry donated (inside ``shard_map`` with a ``mesh``) and the
  :func:`compile_options` of its ``step_entries`` (on one device); the one already made for an equal
  ``program.cache_key``, mesh and options, if any."""
  if program.runs is not None and program.evaluate is not None:
    raise ValueError("a program of several runs cannot evaluate its carry after a chunk (Program.evaluate).")
  if program.table_run_axes is not None:
    if mesh is not None:
      raise ValueError("several runs in one program need a single device; got a mesh.")
    single = program._replace(runs=None, constant_run_axes=None, table_run_axes=None)
    return _Separately(chunk_function(single, None), program)
  options = _chunk_options(program.step_entries, mesh)
  return cached(None if program.cache_key is None else (
      "chunk", program.cache_key, mesh, program.runs, str(program.constant_run_axes), str(options)),
      lambda: _chunk_function(program, mesh, options))


def _chunk_function(program: Program, mesh: Any, options: dict[str, Any] | None) -> Callable[[Any, Any, Any],
                                                                                             tuple[Any, Any]]:
  step = program.step

  check = program.check

  def chunk(carry, constants, tables):
    carry, outputs = jax.lax.scan(lambda c, t: step(c, t, constants), carry, tables)
    return (carry, outputs) if check is None else (carry, (outputs, check(carry)))

  if program.runs is not None:
    if mesh is not None:
      raise ValueError("several runs in one program need a single device; got a mesh.")
    chunk = jax.vmap(chunk, in_axes=(0, program.constant_run_axes, None))
  if mesh is not None:
    chunk = jax.shard_map(
        chunk, mesh=mesh,
        in_specs=(program.carry_specs, program.constant_specs, program.table_specs),
        out_specs=(program.carry_specs, program.output_specs if check is None else (program.output_specs, P())),
        # A replicated carry is replicated by construction (every device applies the same gathered
        # values), but public all_gather is typed device-varying, so the replication check would reject it.
        check_vma=False)
  return jax.jit(chunk, donate_argnums=0, compiler_options=options)


class _Separately:
  """The chunk of runs whose tables are their own: each run's part computed by the single run's compiled chunk,
  each run by a call of its own.

  In one program, ``vmap`` would batch their tables too: every index the tables give (a loop's count, a
  ``cond``'s predicate, a buffer row) would differ between runs, and the batched loops and ``cond``s compute
  every pass and branch for every run (about 4x the separate runs' time, measured on
  ``experiments/dai_staleness``). A ``lax.map`` over the runs gives each its own pass, but its slicing of every
  input and stacking of every output made the program about 15% longer to compile (measured on the same
  reproduction). Here every run is computed by the single run's program, compiled once and shared with a
  separate call of an equal run, so each result equals the separate run's by construction; on CPU devices,
  several runs at a time (:func:`_concurrent_runs`). The carry is the list of the runs' carries, each placed
  on its own; the constants and the tables are cut into each run's part on the host; the outputs are stacked
  on a leading run axis, as ``vmap`` stacks them.
  """

  def __init__(self, chunk: Callable[..., Any], program: Program):
    self.chunk, self.runs, self.table_specs = chunk, program.runs, program.table_specs
    self.constant_axes, self.table_axes = program.constant_run_axes, program.table_run_axes
    self.transfer = table_placer(None)
    self.executable: Any = None
    self.ready: Callable[[], Any] | None = None

  def compile_ahead(self, carries: list[Any], constants: list[Any], tables: Any) -> None:
    """Starts compiling the single run's chunk for the runs' placed ``carries`` and ``constants`` and a chunk's
    host ``tables``, in the background (:func:`_in_background`): the first call takes it from there."""
    self.ready = _in_background(self.chunk.lower(carries[0], constants[0], self.tables(tables, 0)).compile)

  def carries(self, put: Callable[[Any, P], Any], program: Program) -> list[Any]:
    """Each run's part of ``program.carry`` (every leaf has a leading run axis), placed."""
    return [place(put, program.carry_specs, jax.tree.map(lambda x, r=r: np.asarray(x)[r], program.carry))
            for r in range(self.runs)]

  def constants(self, put: Callable[[Any, P], Any], program: Program) -> list[Any]:
    """Each run's constants (its row of those with a run axis, the shared ones whole), placed."""
    return [place(put, program.constant_specs, _run_part(self.constant_axes, program.constants, r))
            for r in range(self.runs)]

  def tables(self, tables: Any, r: int) -> Any:
    """Run ``r``'s rows of a chunk's host tables, placed (cut on the host: no device program per leaf)."""
    return place(self.transfer, self.table_specs, _run_part(self.table_axes, tables, r))

  def __call__(self, carries: list[Any], constants: list[Any], tables: Any) -> tuple[list[Any], Any]:
    """Every run's chunk, from the chunk's host tables; on CPU devices, several runs at a time (see
    :func:`_concurrent_runs`)."""
    # Placed and compiled in this thread: a jax.config context (enable_x64, ...) holds for its own thread
    # only. The pool's threads only compute, with the compiled program.
    own = [self.tables(tables, r) for r in range(self.runs)]
    if self.executable is None:
      self.executable = (self.chunk.lower(carries[0], constants[0], own[0]).compile() if self.ready is None
                         else self.ready())

    done = _concurrent_runs(lambda r: self.executable(carries[r], constants[r], own[r]), range(self.runs))
    return [carry for carry, _ in done], jax.tree.map(lambda *xs: np.stack([host(x) for x in xs]),
                                                      *[out for _, out in done])

  @staticmethod
  def stacked(carries: list[Any]) -> Any:
    """The runs' final carries as one carry with a leading run axis (stacked on the host: a ``jnp.stack``
    would compile a program per leaf's shape)."""
    return jax.device_put(jax.tree.map(lambda *xs: np.stack([host(x) for x in xs]), *carries))


def _host_cpus() -> int:
  """The CPUs this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on every platform
    return os.cpu_count() or 1


# The runs' threads, started on first use. A child forked from this process inherits the pool without its
# threads (work submitted there would never run), and perhaps the lock held: it starts its own.
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
  # A child forked while a thread held a lock starts with it free (that thread is not in the child).
  global _pool, _pool_lock, _probe_lock
  _pool, _pool_lock, _probe_lock = None, threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_pool)


def _runs_pool() -> concurrent.futures.ThreadPoolExecutor:
  """This process's pool of threads for :func:`_concurrent_runs`, one per CPU."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(_host_cpus(), thread_name_prefix="delayjax-runs")
    return _pool


def _concurrent_runs(fn: Callable[[int], Any], runs: Sequence[int]) -> list[Any]:
  """``[fn(r) for r in runs]``, computed by as many threads as this process has CPUs where the default device
  is a CPU.

  A CPU device computes a program in the thread that calls it (an asynchronous dispatch of the next one
  waits for it), and a small model's program leaves the other cores idle: separate runs called from
  separate threads are computed side by side (on 2 cores, ``experiments/dai_staleness`` at five seeds took
  17.6 s instead of 22.8 s). Each run's numbers are those of its own call either way. An accelerator
  already queues the calls asynchronously; there they are made in order, from this thread.
  """
  if len(runs) < 2 or not _side_by_side():
    return [fn(r) for r in runs]
  return _start_runs(fn, runs)()


def _start_runs(fn: Callable[[int], Any], runs: Sequence[int]) -> Callable[[], list[Any]]:
  """Starts ``[fn(r) for r in runs]`` as :func:`_concurrent_runs` computes it, even one run, in the runs' pool
  where it computes beside this thread (so that this thread can make the next chunk's tables meanwhile);
  returns the function that waits for the results. On an accelerator, or with one CPU, the calls are made now, in
  order, from this thread (an accelerator queues them and computes them while this thread goes on)."""
  if not _side_by_side():
    results = [fn(r) for r in runs]
    return lambda: results
  # Each thread waits for its own run, so that a run is computed while the others are.
  futures = [_runs_pool().submit(lambda r=r: jax.block_until_ready(fn(r))) for r in runs]
  return lambda: [future.result() for future in futures]


def _side_by_side() -> bool:
  """Whether work handed to the runs' pool computes beside this thread: the default device is a CPU and this
  process has other CPUs (see :func:`_concurrent_runs`)."""
  return _host_cpus() >= 2 and jax.devices()[0].platform == "cpu"


def _in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
  """``fn()`` started in the runs' pool where it computes beside this thread (:func:`_side_by_side`; else called
  now); returns the function that waits for its result."""
  if not _side_by_side():
    value = fn()
    return lambda: value
  return _runs_pool().submit(fn).result


def _run_part(axes: Any, tree: Any, r: int) -> Any:
  """Run ``r``'s part of ``tree``: row ``r`` of every leaf of a part whose axis (``axes``, a prefix of ``tree``)
  is ``0``, the part itself where it is ``None``."""
  return jax.tree.map(lambda axis, part: part if axis is None else jax.tree.map(lambda x: x[r], part), axes, tree,
                      is_leaf=lambda x: x is None)


def run(program: Program, *, mesh: Any = None, checkpoint: CheckpointArguments = CheckpointArguments(),
        checkpoint_name: str = "checkpoint",
        callback: Callable[[dict[str, Any]], None] | None = None) -> tuple[Any, dict[str, Any]]:
  """Runs ``program`` chunk by chunk; returns the final carry (on the devices) and the records.

  Args:
    program: the runtime's :class:`Program`.
    mesh: a mesh whose one spread axis the program's specs name (see :func:`check_mesh`), or ``None`` for one
      device.
    checkpoint: where to write a checkpoint after every chunk, or fewer (``directory=None``: never), whether
      to resume from one found there, and which fingerprint components may differ on resume. ``min_interval``
      is the seconds of wall time (read from :data:`clock`) at least between two writes: a chunk's end writes
      only once that long has passed since the run started or since its last write (``0``: after every
      chunk). A mesh in a multi-process run needs ``0``: every process must write at the same chunk.
    checkpoint_name: the checkpoint's name inside ``checkpoint.directory`` (see ``_checkpoint.Checkpoint``).
    callback: called on the host after every chunk with ``program.progress(chunk)`` and, as ``"rows"``,
      the chunk's records (``program.collect``'s rows).

  Returns:
    ``(carry, records)``: ``records[name]`` the rows of every chunk concatenated (``records_like``'s
    structure).
  """
  inspect = _inspectors[-1] if _inspectors else None
  if checkpoint.directory is None:
    return _run(program, mesh, checkpoint, checkpoint_name, callback, inspect)
  if checkpoint.min_interval > 0 and mesh is not None and jax.process_count() > 1:
    # Every process must write its shards at the same chunk (a save is a collective), and their clocks may
    # disagree on when the interval has passed.
    raise ValueError(
        f"Checkpoint.min_interval must be 0 with a mesh in a multi-process run ({jax.process_count()} "
        f"processes), got {checkpoint.min_interval}: every process writes its shards at the same chunk, and "
        f"their clocks could disagree on which; use min_interval=0 (a write after every chunk).")
  with locked(os.fspath(checkpoint.directory), checkpoint_name):
    return _run(program, mesh, checkpoint, checkpoint_name, callback, inspect)


# The wall clock that spaces checkpoint writes (a module attribute, so that tests can drive it).
clock: Callable[[], float] = time.monotonic


_inspectors: list[Callable[..., None]] = []


@contextlib.contextmanager
def inspecting(fn: Callable[..., None]) -> Iterator[None]:
  """For benchmarks: within the block, every run calls ``fn(chunk_fn, args)`` once, before its first
  dispatch, with its jitted chunk function and arguments (e.g. to read XLA's memory analysis before the call
  donates the carry)."""
  _inspectors.append(fn)
  try:
    yield
  finally:
    _inspectors.remove(fn)


def _run(program, mesh, checkpoint, checkpoint_name, callback, inspect):
  chunk_fn = chunk_function(program, mesh)
  carry = program.carry
  like = _records_like(program)
  records: dict[str, list[Any]] = {name: [] for name in like}
  first_chunk = 0
  separately = isinstance(chunk_fn, _Separately)
  saver = (None if checkpoint.directory is None else
           _checkpoint.Checkpoint(checkpoint.directory, checkpoint_name, program.fingerprint, checkpoint.changes,
                                  records=tuple(like)))
  put = placer(mesh)
  if saver is not None and checkpoint.resume and saver.exists():
    carry, records, first_chunk = _resumed(saver, program, mesh, put, like,
                                           chunk_fn if separately else None)
  elif separately:
    carry = chunk_fn.carries(put, program)
  else:
    carry = place(put, program.carry_specs, carry)
  constants = (chunk_fn.constants(put, program) if separately else
               place(put, program.constant_specs, program.constants))
  put_tables = table_placer(mesh)
  unsaved: list[dict[str, Any]] = []  # rows not yet in the checkpoint's history
  last_write = clock()  # the run's start, then its last write

  def chunk_tables(chunk: int) -> tuple[Any, Any]:
    """Chunk ``chunk``'s host tables and the tables its call takes (runs with tables of their own place each
    run's rows themselves)."""
    tables = program.tables(chunk)
    return tables, tables if separately else place(put_tables, program.table_specs, tables)

  first = compiled = None  # chunk 0's tables when made before the initial evaluation, and its compile's wait
  if program.initial is not None and first_chunk == 0:
    if mesh is None and program.num_chunks > 0:
      # The first chunk's program compiles in the background while the initial evaluation computes (compiling
      # its own program); the chunk's call then finds it in JAX's caches.
      first = chunk_tables(0)
      if separately:
        chunk_fn.compile_ahead(carry, constants, first[0])
      else:
        compiled = _in_background(chunk_fn.lower(carry, constants, first[1]).compile)
    unsaved.append(program.initial(carry))

  for chunk in range(first_chunk, program.num_chunks):
    tables, device_tables = first if chunk == 0 and first is not None else chunk_tables(chunk)
    if compiled is not None:
      compiled()
      compiled = None
    if inspect is not None:
      # Runs with tables of their own: the first run's jitted chunk and its arguments.
      inspect(*((chunk_fn.chunk, (carry[0], constants[0], chunk_fn.tables(tables, 0))) if separately else
                (chunk_fn, (carry, constants, device_tables))))
      inspect = None
    carry, outputs = chunk_fn(carry, constants, device_tables)
    rows = _chunk_rows(program, chunk, tables, outputs, _evaluated(program, chunk, tables, carry))
    unsaved.append(rows)
    if saver is not None and _write_due(checkpoint, last_write):
      _append(records, unsaved)
      # Runs with tables of their own are saved as one carry with a leading run axis (the program's).
      saver.save(chunk_fn.stacked(carry) if separately else carry, unsaved, chunk + 1)
      unsaved = []
      last_write = clock()
    if callback is not None:
      callback(_callback_info(program, chunk, rows))
  _append(records, unsaved)
  return chunk_fn.stacked(carry) if separately else carry, _joined(records, like)


def _resumed(saver: _checkpoint.Checkpoint, program: Program, mesh: Any, put: Callable[[Any, P], Any],
             like: dict[str, Any], separately: _Separately | None = None) -> tuple[Any, dict[str, list[Any]], int]:
  """A run's carry, records and next chunk from its checkpoint (``saver``), the carry placed as a fresh one (for
  runs with tables of their own, ``separately``'s, each run's part placed on its own)."""
  # Restored straight into its layout: with a mesh each process reads only its own shards.
  carry, restored, first_chunk = saver.restore(program.carry, shardings(mesh, program.carry_specs, program.carry),
                                               like)
  if separately is not None:
    carry = separately.carries(put, program._replace(carry=jax.tree.map(np.asarray, carry)))
  elif mesh is None:
    # Restored arrays are committed to their device and fresh ones are not, which JAX's compile cache
    # tells apart: placed like a fresh carry, a resumed run reuses the program a fresh run compiled.
    carry = place(put, program.carry_specs, jax.tree.map(np.asarray, carry))
  return carry, {name: [rows] for name, rows in restored.items()}, first_chunk


def _write_due(checkpoint: CheckpointArguments, last_write: float) -> bool:
  """Whether a chunk's end writes the checkpoint: ``checkpoint.min_interval`` seconds have passed since the
  run's start or its last write (``0``: after every chunk)."""
  return checkpoint.min_interval == 0 or clock() - last_write >= checkpoint.min_interval


def run_runs(runtime: str, count: int, prepare: Callable[[int], Any], make_program: Callable[[Any], Program], *,
             max_memory: int | None, hints: dict[str, str], callback: Callable[[dict[str, Any]], None] | None,
             checkpoint_name: str) -> tuple[list[Any], list[tuple[Any, dict[str, Any]]]]:
  """The ``count`` runs of one call of several (``seed=dj.Runs(...)``) computed each by a call of its own; returns
  the prepared runs and each one's ``(carry, records)``.

  ``prepare(r)`` checks and plans run ``r`` (a runtime's prepared run, with its ``memory`` terms and its
  ``checkpoint`` arguments) and ``make_program`` makes its :class:`Program`. Run 0 is prepared and its program
  made first, and its chunk's compile starts (:func:`compile_ahead`) while the other runs are prepared: a
  sweep of small runs spends most of its time compiling that one program, which they share (in
  ``experiments/gossip_adpsgd`` at one seed, four runs of 16 replicas, the compile began 0.09 s sooner and the
  runs took 0.76 s instead of 0.90 s on 2 cores). The runs' memory is then checked together (each run's terms
  summed, the data held once; ``hints`` by term) before the other programs are made and anything is placed on
  a device. Run 0's program is made that early only where ``count`` runs of its size fit, so that a call of
  alike runs that the check refuses compiles nothing. Then :func:`run_together` (run ``r`` checkpointed under
  ``f"{checkpoint_name}-run{r}"``, the callback told its index as ``"run"``).
  """
  limit = memory_limit(max_memory, None)
  first = prepare(0)
  alike = sum(size * (1 if name == "data" else count) for name, size in first.memory.items())
  first_program = make_program(first) if count > 1 and (limit is None or alike <= limit[0]) else None
  ahead = None if first_program is None else compile_ahead(first_program)
  prepared = [first] + [prepare(r) for r in range(1, count)]
  memories = [run.memory for run in prepared]
  total = {name: sum(memory[name] for memory in memories) for name in memories[0] if name != "data"}
  check_memory(runtime, {**total, "data": memories[0]["data"]}, limit,
               {name: f"fewer runs in one call ({count} now) or {hint}" for name, hint in hints.items()})
  told = None if callback is None else lambda r, info: callback({**info, "run": r})
  programs = [first_program or make_program(first)] + [make_program(run) for run in prepared[1:]]
  return prepared, run_together(programs, callback=told, checkpoint=first.checkpoint,
                                checkpoint_names=[f"{checkpoint_name}-run{r}" for r in range(count)], ahead=ahead)


class Ahead(NamedTuple):
  """A program's chunk compile started before :func:`run_together` computes it (:func:`compile_ahead`)."""

  program: Program
  chunk_fn: Callable[..., Any]  # the program's chunk function (chunk_function), the one run_together calls
  tables: Any  # its first chunk's host tables
  signature: Any  # the compile's arguments, as run_together tells its compiles apart (_signature)
  compiled: Callable[[], Any]  # waits for the executable


def compile_ahead(program: Program) -> Ahead | None:
  """Starts compiling ``program``'s chunk for one device in the background (:func:`_in_background`), from the
  shapes and dtypes its carry and constants will have once placed (:func:`placer`) and its first chunk's tables:
  :func:`run_together`, given the result, takes that executable for every run whose chunk compiles alike, and
  the tables for the program's first chunk. Nothing is placed on a device. ``None`` (compiled in
  :func:`run_together` instead) where a leaf of the carry or constants is neither a NumPy value nor an array on
  the default device, whose placed type is not known here, and for a program of several runs (which
  :func:`run_together` refuses)."""
  if program.runs is not None:
    return None
  device = jax.devices()[0]

  def placed_like(x):
    if isinstance(x, (np.ndarray, np.generic)):
      return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype))
    if isinstance(x, jax.Array) and x.sharding.device_set == {device}:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    raise TypeError

  try:
    carry, constants = jax.tree.map(placed_like, program.carry), jax.tree.map(placed_like, program.constants)
  except TypeError:
    return None
  chunk_fn = chunk_function(program, None)
  tables = program.tables(0)
  args = (carry, constants, place(table_placer(None), program.table_specs, tables))
  return Ahead(program, chunk_fn, tables, _signature(chunk_fn, args), _in_background(chunk_fn.lower(*args).compile))


def _signature(chunk_fn: Callable[..., Any], args: Any) -> Any:
  """What tells two compiles of chunk functions apart: the function, and its arguments' structure, shapes,
  dtypes and weak types (placed arrays, host tables or their ``jax.ShapeDtypeStruct``)."""
  leaves, structure = jax.tree.flatten(args)
  return (id(chunk_fn), structure, tuple((np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x),
                                          bool(getattr(x, "weak_type", False))) for x in leaves))


def run_together(programs: list[Program], callback: Callable[[int, dict[str, Any]], None] | None = None,
                 checkpoint: CheckpointArguments = CheckpointArguments(),
                 checkpoint_names: Sequence[str] = (), ahead: Ahead | None = None) -> list[tuple[Any, dict[str, Any]]]:
  """Runs several single-run programs on one device, their chunks side by side; returns each one's ``(carry,
  records)`` as :func:`run` would.

  Chunk ``c`` of every program that has one is computed by that program's compiled chunk, each by a call of
  its own, on a CPU several at a time (:func:`_concurrent_runs`; a small model's program leaves the other
  cores idle); the host's work is done in this thread: the next chunk's tables while a chunk computes, its rows
  after it.
  Programs of equal ``cache_key`` share one compiled chunk, and every program is computed exactly as
  :func:`run` computes it alone: each result equals the separate run's bit for bit. ``callback(r, info)`` is
  called after each of program ``r``'s chunks with what :func:`run` gives its callback.

  With ``checkpoint.directory``, program ``r`` is checkpointed as :func:`run` checkpoints it alone, under
  ``checkpoint_names[r]`` (its own fingerprint, records and chunk count): after a round of chunks, every run at
  once, at most every ``checkpoint.min_interval`` seconds. A call that finds them (``checkpoint.resume``)
  continues each run from its own, the runs at whatever chunk each had reached, bit for bit.

  ``ahead``: one program's compile already under way (:func:`compile_ahead`).
  """
  for program in programs:
    if program.runs is not None:
      raise ValueError("run_together takes programs of one run each; got a program of several runs.")
  count = len(programs)
  if checkpoint.directory is not None and len(checkpoint_names) != count:
    raise ValueError(f"run_together checkpoints each of its {count} programs under a name of its own; got "
                     f"{len(checkpoint_names)} names.")
  put, put_tables = placer(None), table_placer(None)
  chunk_fns = [ahead.chunk_fn if ahead is not None and program is ahead.program else chunk_function(program, None)
               for program in programs]
  # Programs given the same constants (the data) share one placed copy.
  shared: dict[int, Any] = {}
  for program in programs:
    if id(program.constants) not in shared:
      shared[id(program.constants)] = place(put, program.constant_specs, program.constants)
  constants = [shared[id(program.constants)] for program in programs]
  likes = [_records_like(program) for program in programs]
  records: list[dict[str, list[Any]]] = [{name: [] for name in like} for like in likes]
  done_chunks = [0] * count  # chunks each run has computed, the resumed ones included
  savers: list[_checkpoint.Checkpoint | None] = [None] * count
  carries: list[Any] = [None] * count
  for r, program in enumerate(programs):
    if checkpoint.directory is not None:
      savers[r] = _checkpoint.Checkpoint(checkpoint.directory, checkpoint_names[r], program.fingerprint,
                                         checkpoint.changes, records=tuple(likes[r]))
    if savers[r] is not None and checkpoint.resume and savers[r].exists():
      carries[r], records[r], done_chunks[r] = _resumed(savers[r], program, None, put, likes[r])
    else:
      carries[r] = place(put, program.carry_specs, program.carry)
  pending = [r for r, program in enumerate(programs) if done_chunks[r] < program.num_chunks]
  # The chunks' programs are traced and lowered in this thread (a jax.config context such as enable_x64 holds in
  # its own thread only) and compiled, each distinct one once, by the pool's threads while this thread makes the
  # other runs' first tables and computes the initial evaluations (compiling their own program). Ahead-of-time
  # compiles share JAX's caches with the jitted calls of a run alone, so an equal program compiles once either way.
  tables, placed = {}, {}  # each pending run's next chunk's tables: host rows and placed
  compiling: dict[Any, Any] = {}
  signatures = {}
  inspect = _inspectors[-1] if _inspectors else None
  if ahead is not None:
    compiling[ahead.signature] = ahead.compiled
  for r in pending:
    tables[r] = (ahead.tables if ahead is not None and programs[r] is ahead.program and done_chunks[r] == 0
                 else programs[r].tables(done_chunks[r]))
    placed[r] = place(put_tables, programs[r].table_specs, tables[r])
    if inspect is not None:
      inspect(chunk_fns[r], (carries[r], constants[r], placed[r]))
      inspect = None
    args = (carries[r], constants[r], placed[r])
    signature = _signature(chunk_fns[r], args)
    if signature not in compiling:
      compiling[signature] = _in_background(chunk_fns[r].lower(*args).compile)
    signatures[r] = signature
  unsaved: list[list[dict[str, Any]]] = [[] for _ in programs]  # rows not yet in each run's checkpoint
  for r, program in enumerate(programs):
    if program.initial is not None and done_chunks[r] == 0:
      unsaved[r].append(program.initial(carries[r]))
  executables = {r: compiling[signatures[r]]() for r in pending}
  last_write = clock()
  first = min((done_chunks[r] for r in pending), default=0)
  for chunk in range(first, max((program.num_chunks for program in programs), default=0)):
    active = [r for r in pending if done_chunks[r] <= chunk < programs[r].num_chunks]
    now = {r: (tables[r], placed[r]) for r in active}
    # A run's chunk and its evaluations, in the thread that computes it.
    wait = _start_runs(lambda r: _with_evaluations(programs[r], chunk, now[r][0], executables[r](
        carries[r], constants[r], now[r][1])), active)
    # The next chunk's tables are made while this one computes.
    for r in active:
      if chunk + 1 < programs[r].num_chunks:
        tables[r] = programs[r].tables(chunk + 1)
        placed[r] = place(put_tables, programs[r].table_specs, tables[r])
    done = wait()
    for r, (carry, outputs, evaluated) in zip(active, done, strict=True):
      carries[r] = carry
      done_chunks[r] = chunk + 1
      rows = _chunk_rows(programs[r], chunk, now[r][0], outputs, evaluated)
      unsaved[r].append(rows)
      if callback is not None:
        callback(r, _callback_info(programs[r], chunk, rows))
    if checkpoint.directory is not None and _write_due(checkpoint, last_write):
      for r, saver in enumerate(savers):
        if unsaved[r]:
          _append(records[r], unsaved[r])
          saver.save(carries[r], unsaved[r], done_chunks[r])
          unsaved[r] = []
      last_write = clock()
  for r in range(count):
    _append(records[r], unsaved[r])
  return [(carry, _joined(kept, like)) for carry, kept, like in zip(carries, records, likes, strict=True)]


def _records_like(program: Program) -> dict[str, Any]:
  """One empty row-pytree per record a run of ``program`` keeps: its ``records_like`` and, with a health check,
  ``"check"`` (one flag per chunk, per run for several runs)."""
  like = dict(program.records_like)
  if program.check is not None:
    like["check"] = np.zeros((0,) if program.runs is None else (0, program.runs), bool)
  return like


def _evaluated(program: Program, chunk: int, tables: Any, carry: Any) -> dict[str, Any]:
  """``program.evaluate``'s rows of chunk ``chunk`` from the carry it left (none without it)."""
  return {} if program.evaluate is None else program.evaluate(chunk, tables, carry)


def _with_evaluations(program: Program, chunk: int, tables: Any, result: tuple[Any, Any]) -> tuple[Any, Any, Any]:
  """A chunk's ``(carry, outputs)`` and its :func:`_evaluated` rows."""
  carry, outputs = result
  return carry, outputs, _evaluated(program, chunk, tables, carry)


def _chunk_rows(program: Program, chunk: int, tables: Any, outputs: Any,
                evaluated: dict[str, Any]) -> dict[str, Any]:
  """Chunk ``chunk``'s records from its host ``tables``, device ``outputs`` and ``evaluated`` rows: the health
  check's flag, if the program has one, ``program.collect``'s rows and the evaluated ones."""
  rows = {}
  if program.check is not None:
    outputs, healthy = outputs
    rows["check"] = np.asarray(host(healthy))[None]
  rows.update(program.collect(chunk, tables, outputs))
  rows.update(evaluated)
  return rows


def _callback_info(program: Program, chunk: int, rows: dict[str, Any]) -> dict[str, Any]:
  """What the user's callback is told after chunk ``chunk``: its progress and, as ``"rows"``, the chunk's own
  history rows (loss, metrics, ...) as the history keeps them."""
  chunk_rows = {k: v for k, v in rows.items() if k != "check"}
  return {**program.progress(chunk),
          "rows": chunk_rows if program.rows_view is None else program.rows_view(chunk_rows)}


def _append(records: dict[str, list[Any]], rows: list[dict[str, Any]]) -> None:
  for chunk_rows in rows:
    for name, value in chunk_rows.items():
      records[name].append(value)


def _joined(records: dict[str, list[Any]], like: dict[str, Any]) -> dict[str, Any]:
  """Each record's rows concatenated along their leading axis (``like[name]`` when there are none)."""
  return {name: jax.tree.map(lambda *xs: np.concatenate(xs), *rows) if rows else like[name]
          for name, rows in records.items()}
