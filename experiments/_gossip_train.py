"""Decentralized training for the gossip reproductions: softmax regression on digits, run by ``dj.simulate_gossip``.

The model is multinomial logistic regression on the 8x8 digits (64 pixels
and a bias, 10 classes). :func:`run_spec` simulates a spec's gossip schedule
and trains on it with ``dj.simulate_gossip`` (float32, minibatches drawn by
the library's ``minibatch_indices``), recording the training loss and test
error of the average model ``z_bar``, the mean of the replicas' own losses,
and the consensus distance ``mean_i ||z_i - z_bar||^2`` against applied
gradients and simulated time.

At this size a run is mostly compilation, so the runs of a reproduction
share compiled programs: with ``specs`` (the reproduction's own), each run
passes the schedules of the other specs that run the same method, for the
same seed, as ``like``, and every run uses the same chunk and phases, so a
reproduction compiles one program per method (a form of mixing that fits
every topology; see ``dj.Execution``'s ``like``) instead of one per
topology or paradigm. With :func:`batch_key` and :func:`run_specs` as its
``batch`` and ``run_batch``, a reproduction computes each seed's runs
together: those of one method and shard layout in one call
(``seed=dj.Runs(sources=...)``, :func:`call_key`), side by side, and the
calls of separate programs side by side too.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

import delayjax as dj
from ._framework import ClaimResult, Summary, mean_rows, paired, remembered
from ._training import grouped_side_by_side

C = dj.cluster


class GossipTask(NamedTuple):
  """Digits for ``M`` replicas: training features with a bias column, labels, each replica's shard, the test set."""

  x: np.ndarray        # float64 [n, 65]
  y: np.ndarray        # int64 [n]
  shards: list[np.ndarray]   # example indices each replica samples from
  x_test: np.ndarray
  y_test: np.ndarray


_TASKS: dict[tuple[int, str], GossipTask] = {}


def digits_task(num_workers: int, shards: str = "iid") -> GossipTask:
  """The digits split (built once per arguments), with ``shards="iid"`` (every replica samples the whole training
  set) or ``"label"`` (training examples sorted by label and cut into ``M`` contiguous shards: each replica sees one
  or two classes, the heterogeneous setting where gossip's consensus matters most)."""
  from .data import digits

  if (num_workers, shards) in _TASKS:
    return _TASKS[num_workers, shards]
  split = digits()
  add_bias = lambda a: np.concatenate([a.astype(np.float64), np.ones((a.shape[0], 1))], axis=1)  # noqa: E731
  x, y = add_bias(split.x_train), split.y_train.astype(np.int64)
  if shards == "iid":
    parts = [np.arange(y.shape[0])] * num_workers
  elif shards == "label":
    parts = np.array_split(np.argsort(y, kind="stable"), num_workers)
  else:
    raise ValueError(f"shards must be 'iid' or 'label', got {shards!r}.")
  task = GossipTask(x, y, list(parts), add_bias(split.x_test), split.y_test.astype(np.int64))
  _TASKS[num_workers, shards] = task
  return task


def run_replica_runtime(task: GossipTask, schedule: C.GossipSchedule, paradigm: str, *, lr: float,
                        momentum: float, batch: int, seed: int, eval_every: int, shards: str,
                        method: dj.gossip.GossipMethod | None = None, layers: bool = False,
                        like: tuple[C.GossipSchedule, ...] = (), phases: int | None = None) -> dict[str, Any]:
  """Trains on ``schedule`` with ``dj.simulate_gossip`` from the zero model and returns the run record.

  ``method``: the ``dj.gossip`` method to run (default: the paradigm's own averaging rule, :data:`METHODS`).
  ``layers``: the same model as two leaves, ``{"b": [10], "w": [64, 10]}`` (bias and weights), for rules that
  treat layers apart (LayUp); otherwise one flat ``[650]`` vector. ``like`` and ``phases``: passed on (the
  schedules whose runs are to share this run's compiled program, and the phases per step).

  Returns:
    ``{"metrics": {...}, "curves": {"gradients", "time", "loss", "replica_loss", "consensus", "test_error"}}``;
    final metrics are the last evaluation's.
  """
  return run_replica_runtimes(task, [schedule], paradigm, lr=lr, momentum=momentum, batch=batch, seeds=[seed],
                              eval_every=eval_every, shards=shards, method=method, layers=layers, like=like,
                              phases=phases)[0]


def run_replica_runtimes(task: GossipTask, schedules: list[C.GossipSchedule], paradigm: str, *, lr: float,
                         momentum: float, batch: int, seeds: list[int], eval_every: int, shards: str,
                         method: dj.gossip.GossipMethod | None = None, layers: bool = False,
                         like: tuple[C.GossipSchedule, ...] = (), phases: int | None = None) -> list[dict[str, Any]]:
  """:func:`run_replica_runtime` of several runs, run ``r`` on ``schedules[r]`` with ``seeds[r]``, in one
  ``dj.simulate_gossip`` call (``seed=dj.Runs(sources=...)``): each record equals, bit for bit, the single
  run's with ``like`` and the other runs' schedules as its ``like``."""
  import jax.numpy as jnp
  import optax

  # NumPy arrays, not JAX ones: converting on a device would compile a program per conversion.
  x, y = task.x.astype(np.float32), task.y.astype(np.int32)
  xt, yt = task.x_test.astype(np.float32), task.y_test.astype(np.int32)

  def matrix(params):
    # The bias row last: the features' last column is the constant 1.
    return jnp.concatenate([params["w"], params["b"][None]], axis=0) if layers else params.reshape(65, 10)

  def loss_fn(params, b):
    return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ matrix(params), b["y"]).mean()

  def eval_fn(params):
    return {"loss": loss_fn(params, {"x": x, "y": y}),
            "test_error": jnp.mean(jnp.argmax(xt @ matrix(params), -1) != yt).astype(jnp.float32)}

  if method is None:
    method = METHODS[paradigm]()
  tx = optax.sgd(lr, momentum=momentum or None)
  data = {"x": x, "y": y}
  sampling = (dj.Sampling(batch, scheme="shard", shards=task.shards) if shards == "label"
              else dj.Sampling(batch, scheme="iid"))
  params = ({"b": np.zeros(10, np.float32), "w": np.zeros((64, 10), np.float32)} if layers
            else np.zeros(650, np.float32))
  # Chunks of a fixed 256 steps (the runtime's longest default): the seeds of a run, whose schedules differ by a
  # few steps, then share one compiled program; the padding steps change nothing.
  options = dict(sampling=sampling, record=dj.Record(eval_fn=eval_fn, every=eval_every),
                 execution=dj.Execution(chunk_size=256, phases=phases, like=like))
  if len(schedules) == 1:
    results = [dj.simulate_gossip(loss_fn, tx, method, params, data, schedules[0], seed=seeds[0], **options)]
  else:
    results = dj.simulate_gossip(loss_fn, tx, method, params, data, None,
                                 seed=dj.Runs(seeds=list(seeds), sources=list(schedules)), **options)
  return [_record(schedule, result, eval_every) for schedule, result in zip(schedules, results, strict=True)]


def _record(schedule: C.GossipSchedule, result: Any, eval_every: int) -> dict[str, Any]:
  """A run's record from its ``dj.simulate_gossip`` result."""
  h = result.history
  grads = np.asarray(h.eval_gradients)
  # The consensus distance after the steps at which the evaluations were taken (dj.Record: the steps in which
  # another eval_every gradients were applied, and the last; 0 at the start: equal replicas). Not the first step
  # with as many gradients: mixes in later steps (after a run's last gradient, say) move the replicas.
  done = np.asarray(h.gradients)
  evaluated = done // eval_every > np.r_[0, done[:-1]] // eval_every
  evaluated[-1] = True
  consensus = np.r_[0.0, np.asarray(h.consensus, np.float64)[evaluated]]
  assert consensus.shape == grads.shape
  curves = {"gradients": grads.tolist(), "time": np.asarray(h.eval_time).tolist(),
            "loss": np.asarray(h.eval_metrics["loss"], np.float64).tolist(),
            "replica_loss": np.asarray(h.replica_metrics["loss"], np.float64).mean(axis=1).tolist(),
            "consensus": consensus.tolist(),
            "test_error": np.asarray(h.eval_metrics["test_error"], np.float64).tolist()}
  final = {k: curves[k][-1] for k in ("loss", "replica_loss", "consensus", "test_error")}
  final.update(gradients=int(grads[-1]), simulated_time=schedule.total_time,
               mean_consensus=float(np.mean(curves["consensus"][1:])) if len(grads) > 1 else 0.0,
               total_wait=float(schedule.wait.sum()), idle_fraction=float(schedule.idle_fraction.mean()),
               mean_lag=float(np.mean(schedule.message_lags())) if schedule.message_lags().size else 0.0)
  return {"metrics": final, "curves": curves}


def time_to(record: dict[str, Any], target: float, x: str = "time") -> float | None:
  """The first ``x`` (simulated seconds or gradients) at which the average model's loss is ``<= target``."""
  from ._training import first_reach

  reach = first_reach(record["curves"][x], record["curves"]["loss"], target)
  return reach if np.isfinite(reach) else None


# ---- what the gossip reproductions share ---------------------------------------------------------------------


def topology_for(name: str, num: int) -> dj.topology.Topology:
  """``ring``, ``torus`` (the squarest rows x cols), ``exponential`` or ``complete`` over ``num`` nodes."""
  if name == "torus":
    rows = max(r for r in range(2, int(num ** 0.5) + 1) if num % r == 0)
    return dj.topology.torus(rows, num // rows)
  return {"ring": dj.topology.ring, "exponential": dj.topology.exponential,
          "complete": dj.topology.complete}[name](num)


def paradigm_for(spec: dict[str, Any], num: int) -> C.GossipParadigm:
  """The paradigm a run spec names: ``{"paradigm": "d_psgd", "topology": "ring"}`` and so on (``ad_psgd`` takes
  an ``"average"``)."""
  name = spec["paradigm"]
  topology = topology_for(spec["topology"], num) if spec.get("topology") else None
  if name == "allreduce":
    return C.allreduce()
  if name == "d_psgd":
    return C.d_psgd(topology)
  if name == "ad_psgd":
    # spec["average"]: where each averaging lands ("completion", the library's default, or "read").
    return C.ad_psgd(topology, **({"average": spec["average"]} if "average" in spec else {}))
  if name == "sgp":
    return C.sgp(spec.get("overlap", 0))
  if name == "gossipgrad":
    return C.gossipgrad()
  raise ValueError(f"unknown paradigm {name!r}.")


# Each paradigm's rule in dj.gossip; the first three are one rule (D-PSGD's averaging) on different schedules, so
# their runs share one program.
METHODS = {"allreduce": dj.gossip.d_psgd, "d_psgd": dj.gossip.d_psgd, "ad_psgd": dj.gossip.ad_psgd,
           "sgp": dj.gossip.sgp, "gossipgrad": dj.gossip.gossip_grad}
_PROGRAMS = {"allreduce": "averaging", "d_psgd": "averaging", "ad_psgd": "averaging", "sgp": "push-sum",
             "gossipgrad": "gradient averaging"}
# The event phases per step of the runs that share a program (with a lane for every replica). With one phase, a
# synchronous round (D-PSGD, all-reduce) is one step that ends after the round's gradients, so the evaluations
# see the iterates; with two it would end after the next round's mix, and the consensus distance evaluated there
# would be the mixed one (0.036 against 0.093 for gossip_adpsgd's D-PSGD ring). SGP's one-peer pushes pack best
# into four.
PHASES = {"averaging": 1, "push-sum": 4, "gradient averaging": 1}
_SCHEDULES: dict[str, C.GossipSchedule] = {}


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> C.GossipSchedule:
  """The gossip schedule of a run: ``config``'s workers (speeds, compute and comm models), the spec's paradigm
  and failures, ``config["steps"]`` gradients per replica (simulated once per process: a spec's schedule is
  also the ``like`` of the other specs' runs)."""
  def make() -> C.GossipSchedule:
    num = len(config["speeds"])
    workers = C.workers(num, compute=config["compute"], comm=config.get("comm"), speed=config["speeds"])
    down = [C.node_down(*d) for d in spec.get("down", ())]
    fail = C.failures(spec.get("drop", 0.0), down) if spec.get("drop") or down else None
    return C.simulate_gossip(paradigm_for(spec, num), workers, config["steps"], seed=seed, failures=fail)

  return remembered(_SCHEDULES, json.dumps([config, spec, seed], sort_keys=True, default=str), make, kept=64)


def eval_every(config: dict[str, Any], schedule: C.GossipSchedule) -> int:
  """Applied gradients between two evaluations: about ``config["evals"]`` (default 20) over the run."""
  return max(1, schedule.num_gradients // config.get("evals", 20))


def run_spec(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any, method: Any = None,
             specs: Any = None) -> dict[str, Any]:
  """One run of a gossip reproduction: simulate the schedule, train on it with ``dj.simulate_gossip``
  (:func:`run_replica_runtime`), add the times to the target loss.

  ``specs``: the reproduction's ``specs`` function; the schedules of the other specs whose paradigm runs the
  same rule (:data:`METHODS`), for this seed, are the run's ``like``, so that they share one compiled program,
  with the phases per step :data:`PHASES` gives the rule.
  ``method``: a function of the schedule returning the ``dj.gossip`` method to run instead of the paradigm's
  own rule (A2CiD2, DC-S3GD, LayUp); ``spec["layers"]`` gives it the model as two leaves.
  """
  return run_specs(config, [(spec, seed)], progress, method=method, specs=specs)[0]


def call_key(config: dict[str, Any], spec: dict[str, Any], seed: int) -> tuple[Any, int, str, int]:
  """The runs of one seed computed by one ``dj.simulate_gossip`` call (:func:`run_specs`): those whose paradigms
  run one rule (:func:`_rule`), on one layout of the shards, evaluated every as many gradients; they are
  computed side by side within the call."""
  return (_rule(spec["paradigm"]), seed, _shards(config, spec), eval_every(config, schedule_for(config, spec, seed)))


def _rule(paradigm: str) -> dj.gossip.GossipMethod:
  """The ``dj.gossip`` method of ``paradigm`` (:data:`METHODS`) without its name: what it computes. AD-PSGD's
  is D-PSGD's rule under another name (``dj.gossip.ad_psgd``: what makes it AD-PSGD is its schedule), so
  all-reduce, D-PSGD and AD-PSGD runs are one call, computed by the first one's method; a run's numbers are
  those of its own call either way, bit for bit."""
  return METHODS[paradigm]()._replace(name="")


def _shards(config: dict[str, Any], spec: dict[str, Any]) -> str:
  """A run's layout of the shards: its spec's, else the config's, else ``"iid"``."""
  return spec.get("shards", config.get("shards", "iid"))


def batch_key(config: dict[str, Any], spec: dict[str, Any], seed: int) -> int:
  """A gossip reproduction's ``batch`` (with :func:`run_specs` as its ``run_batch``): the pending runs of one
  seed, computed by one ``dj.simulate_gossip`` call per :func:`call_key`."""
  return seed


def run_specs(config: dict[str, Any], members: list[tuple[dict[str, Any], int]], progress: Any, method: Any = None,
              specs: Any = None) -> list[dict[str, Any]]:
  """The records of ``members``, runs of one seed (:func:`batch_key`), each equal to its own :func:`run_spec`'s
  bit for bit: one ``dj.simulate_gossip`` call per :func:`call_key`, the calls of one compiled program
  (:data:`_PROGRAMS`) one after the other, and those of separate programs side by side
  (``_training.side_by_side``: while one program compiles, another computes). A run's ``like`` is the
  schedules of every other spec of its program and seed, those of the other members included."""
  if len({seed for _, seed in members}) > 1:
    raise ValueError(f"runs computed together share a seed (batch_key); got {[(s['key'], n) for s, n in members]}.")
  if len(members) > 1 and method is not None:
    raise ValueError(f"runs with a method of each schedule are computed one at a time; got "
                     f"{[spec['key'] for spec, _ in members]}.")
  # Each shards layout's task made here, once, not by two threads at once.
  for spec, _ in members:
    digits_task(len(config["speeds"]), _shards(config, spec))

  def program_records(group: list[tuple[dict[str, Any], int]], part: Any) -> list[dict[str, Any]]:
    # One program's calls (gt.call_key), in turn.
    calls: dict[tuple[Any, int, str, int], list[int]] = {}
    for index, (spec, seed) in enumerate(group):
      calls.setdefault(call_key(config, spec, seed), []).append(index)
    records: dict[int, dict[str, Any]] = {}
    for indices in calls.values():
      records.update(zip(indices, _call_records(config, [group[i] for i in indices], method, specs), strict=True))
      part(len(records), len(group))
    return [records[index] for index in range(len(group))]

  return grouped_side_by_side(members, lambda member: _PROGRAMS[member[0]["paradigm"]], program_records, progress)


def _call_records(config: dict[str, Any], members: list[tuple[dict[str, Any], int]], method: Any,
                  specs: Any) -> list[dict[str, Any]]:
  """The records of ``members``, runs of one :func:`call_key`, by one ``dj.simulate_gossip`` call."""
  first, seed = members[0]
  schedules = [schedule_for(config, spec, s) for spec, s in members]
  shards = _shards(config, first)
  task = digits_task(len(config["speeds"]), shards)
  like: tuple[C.GossipSchedule, ...] = ()
  group_phases = None
  if specs is not None:
    program = _PROGRAMS[first["paradigm"]]
    group_phases = PHASES[program]
    if method is None:
      # The members' own schedules are each other's like (dj.Runs adds them); the rest of the program's are
      # every member's.
      keys = {spec["key"] for spec, _ in members}
      like = tuple(schedule_for(config, other, seed) for other in specs(config)
                   if other["key"] not in keys and _PROGRAMS[other["paradigm"]] == program)
  records = run_replica_runtimes(task, schedules, first["paradigm"], lr=config["lr"],
                                 momentum=config.get("momentum", 0.0), batch=config["batch"],
                                 seeds=[s for _, s in members], eval_every=eval_every(config, schedules[0]),
                                 shards=shards, method=None if method is None else method(schedules[0]),
                                 layers=first.get("layers", False), like=like, phases=group_phases)
  return [finish_record(config, schedule, record) for schedule, record in zip(schedules, records, strict=True)]


def finish_record(config: dict[str, Any], schedule: C.GossipSchedule, record: dict[str, Any]) -> dict[str, Any]:
  """A run's record with what every gossip reproduction reports beside its curves: the simulated time and the
  gradients to ``config["target_loss"]``, the loss at half the run, the staleness histogram."""
  record["metrics"]["time_to_target"] = time_to(record, config["target_loss"])
  record["metrics"]["gradients_to_target"] = time_to(record, config["target_loss"], "gradients")
  half = int(np.argmin(np.abs(np.asarray(record["curves"]["gradients"]) - schedule.num_gradients / 2)))
  record["metrics"]["loss_half"] = record["curves"]["loss"][half]
  record["staleness_hist"] = schedule.staleness_histogram()
  return record


def summarize_by(*fields: str) -> Any:
  """A reproduction's ``summarize``: one row per spec key with the spec's ``fields`` and the means over seeds."""

  def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    del config
    return mean_rows(records, fields=fields)

  return summarize


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  """A reproduction's ``plots``: loss of the average model and consensus distance against gradients and
  simulated time.

  The consensus plot (log scale) leaves out all-reduce, whose replicas are equal, and the start, where all
  replicas are equal too.
  """
  from . import _plots

  del config, rows
  gossip = [{**r, "curves": {k: v[1:] for k, v in r["curves"].items()}} for r in records
            if r["spec"]["paradigm"] != "allreduce"]
  paths = [_plots.curves(records, out, "loss", y="loss", ylabel="training loss (average model)",
                         xs=("gradients", "time"))]
  if gossip:
    paths.append(_plots.curves(gossip, out, "consensus", y="consensus", ylabel="consensus distance", log_y=True,
                               xs=("gradients", "time")))
  return paths


def matches_accuracy(key: str, name: str, base: str, base_name: str) -> Any:
  """The claim that run ``key`` (shown as ``name``) matches ``base``'s accuracy after the same gradients: test error
  within 2 points and training loss within 5% of ``base``'s, both paired over seeds."""
  def check(summary: Summary) -> ClaimResult:
    g, a = summary[key], summary[base]
    return ClaimResult.decide(
        [paired(summary, key, base, "test_error_pct", claim="within", margin=2.0),
         paired(summary, key, base, "loss", claim="within", margin=0.05 * a["loss"])],
        f"after {int(g['gradients'])} gradients: test error {name} {g['test_error_pct']:.2f}%, {base_name} "
        f"{a['test_error_pct']:.2f}% (band +-2 points); training loss {g['loss']:.4f} and {a['loss']:.4f} (band "
        f"+-{0.05 * a['loss']:.4f})")
  return check
