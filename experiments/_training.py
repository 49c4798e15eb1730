"""Shared pieces of the reproductions: a classification task, a run of ``dj.simulate``, calls side by side, curve
helpers.

A reproduction says *what* to train under which schedule and optimizer;
:func:`simulate_record` trains it with the exact wave-parallel runtime and
turns the history into the JSON record the framework stores: final metrics,
curves against updates and simulated time, the staleness histogram.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from delayjax.runtime._engine import _host_cpus
from ._framework import Progress, remembered


class Task(NamedTuple):
  """A supervised problem: data for ``dj.simulate``, its loss, an evaluation and an initializer."""

  data: dict[str, np.ndarray]  # {"x": inputs, "y": int labels}, leading axis = examples
  loss_fn: Callable[[Any, dict[str, jax.Array]], jax.Array]
  eval_fn: Callable[[Any], dict[str, jax.Array]]  # params -> {"test_error": ..., "train_loss": ...}
  init: Callable[[int], Any]  # seed -> params


def classification_task(split: Any, apply: Callable[[Any, jax.Array], jax.Array],
                        init: Callable[[jax.Array], Any], eval_batch: int | None = None) -> Task:
  """A classification task from a ``Split`` (``x_train``, ``y_train``, ``x_test``, ``y_test``).

  ``eval_fn`` reports the test error and the training loss on the whole
  training set (in batches of ``eval_batch`` when given, for large data sets).
  """
  x_test, y_test = jnp.asarray(split.x_test), jnp.asarray(split.y_test)
  x_train, y_train = jnp.asarray(split.x_train), jnp.asarray(split.y_train)

  def loss_fn(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch["x"]), batch["y"]).mean()

  def batched(fn, x, y):
    """``fn``'s mean over every example of ``(x, y)``: whole batches of ``eval_batch``, then the rest as one
    more batch, each batch's mean weighed by its examples."""
    if eval_batch is None or x.shape[0] <= eval_batch:
      return fn(x, y)
    n = (x.shape[0] // eval_batch) * eval_batch
    xs = x[:n].reshape((-1, eval_batch) + x.shape[1:])
    ys = y[:n].reshape(-1, eval_batch)
    means = jax.lax.map(lambda b: fn(*b), (xs, ys))
    if n == x.shape[0]:
      return jnp.mean(means)
    return (jnp.sum(means) * eval_batch + fn(x[n:], y[n:]) * (x.shape[0] - n)) / x.shape[0]

  def eval_fn(params):
    error = batched(lambda x, y: jnp.mean(jnp.argmax(apply(params, x), -1) != y), x_test, y_test)
    train_loss = batched(lambda x, y: loss_fn(params, {"x": x, "y": y}), x_train, y_train)
    return {"test_error": error.astype(jnp.float32), "train_loss": train_loss.astype(jnp.float32)}

  data = {"x": np.asarray(split.x_train), "y": np.asarray(split.y_train)}
  return Task(data, loss_fn, eval_fn, lambda seed: init(jax.random.PRNGKey(seed)))


def simulate_record(task: Task, tx: optax.GradientTransformation, source: Any, *, seed: int,
                    batch_size: int, eval_every: int, progress: Progress, num_updates: int | None = None,
                    scheme: str = "iid", shards: Any = None, worker: dj.workers.Worker | None = None,
                    final_state: Callable[[Any], None] | None = None, chunk_size: int | None = None,
                    lanes: int | None = None, like: Any = None) -> dict[str, Any]:
  """Trains ``task`` with ``tx`` under ``source`` (a Schedule or delay model) and returns the run record.

  Record: ``metrics`` (the final value of each of ``eval_fn``'s metrics, ``updates``,
  ``simulated_time``, ``mean_staleness``, ``max_staleness``, ``total_wait``),
  ``curves`` (``update``, ``time`` and each metric at every evaluation) and
  ``staleness_hist``. A run whose parameters stopped being
  finite keeps its NaN metrics (the table counts it as diverged).
  ``batch_size``, ``scheme`` and ``shards`` are the run's ``dj.Sampling``.
  ``worker`` is ``dj.simulate``'s worker plug-in: with
  ``dj.workers.LocalSteps(H, optimizer)`` the workers run local SGD and push
  pseudo-gradients (``batch_size`` is then the batch of one local step).
  ``final_state``, if given, receives the optimizer state after the last
  update (for statistics a transformation accumulates in its state).
  ``chunk_size`` is ``dj.simulate``'s (steps per compiled chunk; the results
  do not depend on it): :func:`shared_chunk_size` gives runs of different
  lengths one program. ``lanes`` is ``dj.simulate``'s too (gradients per
  step; the results depend on it only through rounding, see ``dj.Execution``):
  a fixed value gives seeds whose schedules would each choose their own one
  program. ``like``: ``dj.Execution``'s, the other schedules of a sweep, so
  that one program serves them all (with a fixed ``lanes``).
  """
  # The framework's RunProgress names a per-run folder (and how often to write it): an interrupted run resumes
  # from its last checkpoint.
  checkpoint_dir = getattr(progress, "checkpoint_dir", None)
  result = dj.simulate(task.loss_fn, tx, task.init(seed), task.data, source, num_updates=num_updates, seed=seed,
                       sampling=dj.Sampling(batch_size, scheme=scheme, shards=shards), worker=worker,
                       record=dj.Record(eval_fn=task.eval_fn, every=eval_every, callback=_reporting(progress),
                                        nonfinite="report"),
                       checkpoint=None if checkpoint_dir is None else dj.Checkpoint(
                           checkpoint_dir, min_interval=getattr(progress, "checkpoint_every", 0.0)),
                       execution=dj.Execution(chunk_size=chunk_size, lanes=lanes, like=like))
  if final_state is not None:
    final_state(result.opt_state)
  return result_record(result, source)


def simulate_records(task: Task, tx: optax.GradientTransformation, sources: list[dj.cluster.Schedule], *,
                     seeds: list[int], batch_size: int, eval_every: int, progress: Progress,
                     lanes: int | None = None, like: Any = None,
                     chunk_size: int | None = None) -> list[dict[str, Any]]:
  """:func:`simulate_record` of run ``r`` = ``(sources[r], seeds[r])`` for every ``r``, computed by one
  ``dj.simulate`` call (``seed=dj.Runs(seeds, sources=..., params=...)``, each run from ``task.init`` of its
  seed). Each record equals the separate call's bit for bit (the runs share one compiled program, each
  computed by a call of its own, on a CPU several at a time); the batch saves the host's work per call. No
  checkpoint: an interrupted batch is computed again. ``chunk_size``: ``dj.Execution``'s (the records do not
  depend on it)."""
  # Each seed's parameters drawn once for the call (an eager draw dispatches a dozen programs: dai_staleness drew
  # 168 times, 2.8 s of its threads at five seeds), as NumPy copies, which the runtimes place by a host copy (a
  # device array by a copy program per leaf).
  drawn = {seed: jax.tree.map(np.array, task.init(seed)) for seed in dict.fromkeys(seeds)}
  results = dj.simulate(task.loss_fn, tx, drawn[seeds[0]], task.data, None,
                        seed=dj.Runs(seeds=list(seeds), sources=list(sources),
                                     params=[drawn[seed] for seed in seeds]),
                        sampling=dj.Sampling(batch_size),
                        record=dj.Record(eval_fn=task.eval_fn, every=eval_every, callback=_reporting(progress),
                                         nonfinite="report"),
                        execution=dj.Execution(lanes=lanes, like=like, chunk_size=chunk_size))
  return [result_record(result, source) for result, source in zip(results, sources, strict=True)]


def side_by_side(calls: list[Callable[[], Any]]) -> list[Any]:
  """``[call() for call in calls]``, as many calls at a time (threads) as this process has CPUs.

  For the ``dj.simulate`` calls of separate programs (a reproduction's optimizers): a short run of a small model
  is mostly its program's tracing, compiling and the host's work around it, during which a CPU idles; a call
  beside it fills that CPU. Each result is the one its call gives alone (a compiled program computes the same
  numbers in any thread). The calls run under the caller's dtype promotion and 64-bit setting (JAX's config
  contexts hold in their own thread only). The first exception raised is raised here, once every call has ended.
  """
  promotion = jax.config.jax_numpy_dtype_promotion
  promotion, x64 = getattr(promotion, "value", promotion), bool(jax.config.jax_enable_x64)

  def in_callers_config(call: Callable[[], Any]) -> Any:
    with jax.numpy_dtype_promotion(promotion), jax.enable_x64(x64):
      return call()

  cpus = _host_cpus()
  if cpus < 2 or len(calls) < 2:
    return [call() for call in calls]
  # A pool of its own: the calls hand their runs to the runtimes' pool and wait for them there.
  with concurrent.futures.ThreadPoolExecutor(min(cpus, len(calls)), thread_name_prefix="side-by-side") as pool:
    futures = [pool.submit(in_callers_config, call) for call in calls]
    concurrent.futures.wait(futures)
  return [future.result() for future in futures]


def grouped_side_by_side(members: list[Any], key: Callable[[Any], Any],
                         compute: Callable[[list[Any], Progress], list[Any]], progress: Progress) -> list[Any]:
  """``compute(group, part)``'s results for the groups of ``members`` of equal ``key(member)`` (a batch's runs
  of one program), the groups side by side (:func:`side_by_side`), each told its own ``part`` of ``progress``
  (:func:`shared_progress`); returned in ``members``' order (``compute`` returns one result per member of its
  group, in the group's order)."""
  groups: dict[Any, list[int]] = {}
  for index, member in enumerate(members):
    groups.setdefault(key(member), []).append(index)
  parts = shared_progress(progress, len(groups))
  done = side_by_side([functools.partial(compute, [members[i] for i in indices], part)
                       for indices, part in zip(groups.values(), parts, strict=True)])
  results: dict[int, Any] = {}
  for indices, group_results in zip(groups.values(), done, strict=True):
    results.update(zip(indices, group_results, strict=True))
  return [results[index] for index in range(len(members))]


def shared_progress(progress: Progress, parts: int) -> list[Progress]:
  """One progress callback per part of a batch, each called with its own ``(done, total)``: ``progress`` is told
  the parts' sums (of the parts heard from so far), from whichever thread calls."""
  done, total = [0] * parts, [0] * parts
  lock = threading.Lock()

  def part(index: int) -> Progress:
    def report(part_done: int, part_total: int) -> None:
      with lock:
        done[index], total[index] = part_done, part_total
        progress(sum(done), sum(total))

    return report

  return [part(index) for index in range(parts)]


def _reporting(progress: Progress) -> Callable[[dict[str, Any]], None]:
  """A ``dj.Record`` callback that tells ``progress`` the updates done."""
  def callback(info: dict[str, Any]) -> None:
    progress(info["updates_done"], info["num_updates"])

  return callback


def result_record(result: dj.SimulationResult, source: Any) -> dict[str, Any]:
  """The run record (see :func:`simulate_record`) of a ``dj.simulate`` result under ``source``."""
  h = result.history
  metrics = {k: np.asarray(v, np.float64) for k, v in h.eval_metrics.items()}
  schedule = source if isinstance(source, dj.cluster.Schedule) else None
  tau = np.asarray(h.staleness)
  record = {
      "metrics": {
          **{name: float(values[-1]) for name, values in metrics.items()},
          "updates": int(h.update.shape[0]),
          "simulated_time": float(h.time[-1]),
          "mean_staleness": schedule.mean_staleness() if schedule is not None else float(tau.mean()),
          "max_staleness": int(tau.max()),
          "total_wait": float(np.sum(schedule.wait)) if schedule is not None else 0.0,
      },
      "curves": {"update": h.eval_update, "time": h.eval_time, **metrics},
      "staleness_hist": (schedule.staleness_histogram() if schedule is not None
                         else np.bincount(tau)),
      "diverged": not (all(np.all(np.isfinite(v[-1:])) for v in metrics.values())
                       and all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(result.params))),
  }
  return record


def shared_chunk_size(num_updates: int, most: int = 256) -> int:
  """A chunk length that runs of about ``num_updates`` updates share: the power of two at or above it, at most
  ``most``.

  Runs cut to a simulated-time budget differ in length from seed to seed, and
  ``dj.simulate``'s own chunk length follows each run's steps closely (208 or
  224 steps), so each seed would compile its own program; a large model's
  compilation costs far more than the masked steps a shared length adds.
  """
  return min(int(most), 1 << max(int(num_updates) - 1, 0).bit_length())


_SCHEDULES: dict[str, Any] = {}


def schedule_once(make: Callable[[], Any], *key: Any) -> Any:
  """``make()``, a cluster run, simulated once per process for equal ``key`` (a reproduction's name and what its
  schedule depends on; compared by repr, so that lists from ``--set`` are keys too): a run's schedule is also the
  ``like`` of its spec's other seeds (:func:`seeds_like`)."""
  return remembered(_SCHEDULES, repr(key), make, kept=4096)


def seeds_like(config: dict[str, Any], seed: int, schedule_of: Callable[[int], Any]) -> list[Any]:
  """The schedules of a spec's seeds, ``schedule_of(s)`` for every configured seed and ``seed``, whose most
  contributions per update and most minibatches per contribution are ``seed``'s (a shared program must not change
  them): a run's ``dj.Execution(like=...)``, so that the seeds of the spec share one compiled program.

  A plan's sizes are rounded up to powers of two so that seeds share them, but seeds straddle the rounding's
  steps (a gradient buffer of 4 blocks for one seed and 5 for the next: 4 and 8 after rounding), and each side
  compiled its own program: 12 chunk programs for dc_asgd's 9 specs at 3 seeds. Sized for all of them, they
  compile one per spec and lane count. ``like`` only pads, so each record equals the run without it bit for bit.
  ``schedule_of`` should be cached (:func:`schedule_once`): each run asks for every seed's.
  """
  def most(schedule: Any) -> tuple[int, int]:
    batches = 1 if schedule.num_batches is None else int(np.max(schedule.num_batches, initial=1))
    return int(np.max(schedule.contributes.sum(axis=1), initial=0)), batches

  own = most(schedule_of(seed))
  return [other for other in (schedule_of(s) for s in sorted(set(range(int(config["seeds"]))) | {int(seed)}))
          if most(other) == own]


def within_time(schedule: dj.cluster.Schedule, budget: float) -> dj.cluster.Schedule:
  """The updates of ``schedule`` applied within ``budget`` simulated seconds (at least one)."""
  return schedule[:max(1, int(np.searchsorted(schedule.time, budget, side="right")))]


def time_horizon(schedule: dj.cluster.Schedule, budget: float) -> float:
  """How long a run of ``within_time(schedule, budget)`` shows whether it reached a target: ``budget`` if
  ``schedule`` runs past it (from the last update within the budget to its end the model does not change, so the
  target is not reached within it either), else ``schedule``'s last update (nothing is known after it).
  :func:`with_time_to_target`'s ``horizon``."""
  return float(min(budget, schedule.time[-1]))


def with_time_to_target(record: dict[str, Any], target_accuracy: float,
                        horizon: float | None = None) -> dict[str, Any]:
  """Adds ``time_to_target``: the simulated seconds until the test accuracy first reached the target
  (``None``, which the tables show as NaN, if it never did), and ``time_to_target_bound``: the same, or, if it
  never reached it, ``horizon`` (:func:`time_horizon`; the run's last evaluation if ``None``): a lower bound of
  the time it would have taken, which the claims compare, conservative for either side.

  Runs cut at one time budget need the budget as their horizon: their last updates fall at different times
  before it (a synchronous round may end seconds earlier than an asynchronous update), so two runs that both
  missed the target would be scored as different, the one whose last update came earlier favoured. With the
  budget, a seed on which neither reached the target is a tie."""
  reach = first_reach(record["curves"]["time"], record["curves"]["test_error"], 1.0 - target_accuracy)
  miss = float(record["curves"]["time"][-1]) if horizon is None else float(horizon)
  record["metrics"]["time_to_target"] = reach if np.isfinite(reach) else None
  record["metrics"]["time_to_target_bound"] = reach if np.isfinite(reach) else miss
  return record


def first_reach(x: Any, y: Any, target: float) -> float:
  """The first ``x`` at which ``y <= target`` (``inf`` if never): e.g. updates to reach a target error."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  hit = np.nonzero(y <= target)[0]
  return float(x[hit[0]]) if hit.size else float("inf")


def digits_split() -> Any:
  from .data import digits

  return digits()


_TASKS: dict[tuple[Any, ...], Task] = {}


def task_for(config: dict[str, Any]) -> Task:
  """The task a config names (``data``: digits, mnist or cifar10; ``model``: mlp or resnet20), built once.

  ``mlp`` takes flattened inputs and ``hidden`` (an int or a list of widths;
  ``[]`` is softmax regression); paper-scale data comes from
  ``config["data_dir"]`` (see ``_datasets``). ``label_noise`` (a fraction,
  default 0) replaces that share of the training labels, chosen once with a
  fixed seed, by uniformly random classes: a loss floor that no model can
  pass, as in the noisy problems of the error-runtime analyses. Test labels
  stay clean.
  """
  hidden = config.get("hidden", 128)
  hidden = tuple(hidden) if isinstance(hidden, (list, tuple)) else (int(hidden),)
  noise = float(config.get("label_noise", 0.0))
  key = (config["data"], config["model"], hidden, config.get("data_dir"), noise)
  if key not in _TASKS:
    from . import _datasets
    from .data import Split
    from .delayed_digits import init_mlp, mlp

    if config["data"] == "digits":
      split = digits_split()
    elif config["data"] == "mnist":
      split = _datasets.mnist(config.get("data_dir"))
    elif config["data"] == "cifar10":
      split = _datasets.cifar10(config.get("data_dir"))
    else:
      raise ValueError(f"data must be digits, mnist or cifar10, got {config['data']!r}.")
    if noise:
      rng = np.random.default_rng(20180401)
      flip = rng.random(split.y_train.shape[0]) < noise
      y = np.where(flip, rng.integers(0, 10, split.y_train.shape[0]), split.y_train).astype(split.y_train.dtype)
      split = Split(split.x_train, y, split.x_test, split.y_test)
    if config["model"] == "mlp":
      split = Split(*(a.reshape(a.shape[0], -1) if a.ndim > 2 else a for a in split))
      sizes = (split.x_train.shape[1],) + hidden + (10,)
      # Digits' 1,438 training examples are evaluated in one batch: in batches of 1,000, every chunk program
      # held two forward passes (1,000 rows and the 438 left), which cost dai_staleness 0.56 s of its 8.5 s of
      # runs at one seed (its eight programs' compiles).
      task = classification_task(split, mlp, lambda k: init_mlp(k, sizes),
                                 eval_batch=None if config["data"] == "digits" else 1000)
    elif config["model"] == "resnet20":
      from ._models import resnet20

      init, apply = resnet20()
      task = classification_task(split, apply, init, eval_batch=500)
    else:
      raise ValueError(f"model must be mlp or resnet20, got {config['model']!r}.")
    _TASKS[key] = task
  return _TASKS[key]


def learning_rate(config: dict[str, Any], num_updates: int) -> Any:
  """``config["lr"]``, divided by 10 at the fractions ``config["lr_decay_at"]`` of the run (if any)."""
  boundaries = config.get("lr_decay_at") or []
  if not boundaries:
    return config["lr"]
  return optax.piecewise_constant_schedule(
      config["lr"], {max(1, int(f * num_updates)): 0.1 for f in boundaries})
