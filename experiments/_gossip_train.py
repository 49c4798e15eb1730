"""Decentralized training for the gossip reproductions: softmax regression on digits, executed from a gossip schedule.

:func:`run_schedule` executes a ``dj.cluster.GossipSchedule`` event by event
on ``M`` replicas held as one ``[M, d]`` NumPy array (the rules of the
schedule's format; ``tests/gossip`` pins it to the sequential reference), with
per-replica SGD with momentum and, for SGP, the push-sum weight (gradients
at ``z_i = x_i / w_i``). Every ``eval_every`` applied gradients it records
the training loss and test error of the average model ``z_bar``, the mean of
the replicas' own losses, and the consensus distance
``mean_i ||z_i - z_bar||^2``, against applied gradients and simulated time.

The model is multinomial logistic regression on the 8x8 digits (64 pixels
and a bias, 10 classes): small enough that a few thousand events run in well
under a second, so the reproductions run in the test suite. With
``--set runtime=dj`` the same runs go through ``dj.simulate_gossip``, the
compiled replica runtime (float32, its own minibatch draws; slower at this
size because it compiles).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import delayjax as dj
from ._framework import mean_rows

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
  """The digits split (built once per arguments), with ``shards="iid"`` (every replica samples the whole training set) or ``"label"``
  (training examples sorted by label and cut into ``M`` contiguous shards: each replica sees one or two classes,
  the heterogeneous setting where gossip's consensus matters most)."""
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


def _softmax(logits: np.ndarray) -> np.ndarray:
  z = logits - logits.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def loss(task: GossipTask, params: np.ndarray) -> np.ndarray:
  """Mean cross-entropy on the training set of parameters ``[650]`` or ``[M, 650]`` (one value per model)."""
  stacked = np.atleast_2d(params).reshape(-1, 65, 10)
  # One [n, 65] x [65, M * 10] product for all models.
  logits = (task.x @ stacked.transpose(1, 0, 2).reshape(65, -1)).reshape(task.x.shape[0], -1, 10)
  z = logits - logits.max(axis=-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  nll = -logp[np.arange(task.y.shape[0]), :, task.y].mean(axis=0)
  return nll if params.ndim == 2 else nll[0]


def error_rate(task: GossipTask, params: np.ndarray) -> float:
  w = params.reshape(65, 10)
  return float(np.mean(np.argmax(task.x_test @ w, axis=1) != task.y_test))


def gradient(task: GossipTask, params: np.ndarray, index: np.ndarray) -> np.ndarray:
  """The mean cross-entropy gradient on the examples ``index``, flat ``[650]``."""
  xb, yb = task.x[index], task.y[index]
  p = _softmax(xb @ params.reshape(65, 10))
  p[np.arange(yb.shape[0]), yb] -= 1.0
  return (xb.T @ p / yb.shape[0]).ravel()


def batches(task: GossipTask, schedule: C.GossipSchedule, batch: int, seed: int) -> list[np.ndarray]:
  """Per replica, ``[num minibatches, batch]`` example indices drawn from its shard (seeded per replica)."""
  counts = np.zeros(schedule.num_workers, np.int64)
  reads = schedule.kind == C.READ
  np.add.at(counts, schedule.worker[reads], schedule.num_batches[reads])
  rngs = [np.random.default_rng([seed, i]) for i in range(schedule.num_workers)]
  return [shard[rng.integers(shard.shape[0], size=(int(n), batch))]
          for shard, rng, n in zip(task.shards, rngs, counts)]


def run_schedule(task: GossipTask, schedule: C.GossipSchedule, *, lr: float, momentum: float = 0.0,
                 batch: int = 32, seed: int = 0, eval_every: int = 100, push_sum: bool = False,
                 x0: np.ndarray | None = None) -> dict[str, Any]:
  """Executes ``schedule`` from the zero model (or ``x0`` ``[M, 650]``) and returns the run record.

  Returns:
    ``{"metrics": {...}, "curves": {"gradients", "time", "loss", "replica_loss", "consensus", "test_error"}}``
    plus ``"x"`` (the replicas' final ``z_i``); final metrics are the last evaluation's.
  """
  num, dim = schedule.num_workers, 65 * 10
  x = np.zeros((num, dim)) if x0 is None else np.array(x0, np.float64)
  w = np.ones(num)
  v = np.zeros_like(x)
  pending = np.zeros_like(x)
  depth = schedule.max_lag + 1
  # history[i, k % depth]: replica i's (x, w) at version k, kept for the messages that arrive late.
  hist_x = np.repeat(x[:, None, :], depth, axis=1) if depth > 1 else None
  hist_w = np.ones((num, depth))
  version = np.zeros(num, np.int64)
  idx = batches(task, schedule, batch, seed)
  used = np.zeros(num, np.int64)
  curves: dict[str, list[float]] = {k: [] for k in ("gradients", "time", "loss", "replica_loss", "consensus",
                                                     "test_error")}
  applied = 0

  def remember(i: int) -> None:
    version[i] += 1
    if hist_x is not None:
      hist_x[i, version[i] % depth] = x[i]
      hist_w[i, version[i] % depth] = w[i]

  def evaluate(t: float) -> None:
    z = x / w[:, None]
    mean = z.mean(axis=0)
    curves["gradients"].append(applied)
    curves["time"].append(t)
    curves["loss"].append(float(loss(task, mean)))
    curves["replica_loss"].append(float(loss(task, z).mean()))
    curves["consensus"].append(float(np.mean(np.sum((z - mean) ** 2, axis=1))))
    curves["test_error"].append(error_rate(task, mean))

  evaluate(0.0)
  for e in range(schedule.num_events):
    kind = schedule.kind[e]
    if kind == C.READ:
      i, nb = schedule.worker[e], schedule.num_batches[e]
      rows = idx[i][used[i]:used[i] + nb].ravel()
      used[i] += nb
      pending[i] = gradient(task, x[i] / w[i], rows)
    elif kind == C.GRAD:
      i = schedule.worker[e]
      v[i] = momentum * v[i] + pending[i]
      x[i] -= lr * v[i]
      remember(i)
      applied += 1
      if applied % eval_every == 0:
        evaluate(float(schedule.time[e]))
    else:
      k = schedule.mix[e]
      members = schedule.members[k][schedule.members[k] >= 0]
      size = members.shape[0]
      weights, receives, lag = schedule.weights[k, :size, :size], schedule.receives[k, :size], schedule.lag[k, :size]
      if schedule.mixes[k] == C.GRADS:
        pending[members[receives]] = weights[receives] @ pending[members]
        continue
      if lag.any():
        slot = (version[members] - lag) % depth
        sent_x, sent_w = hist_x[members, slot], hist_w[members, slot]
      else:
        sent_x, sent_w = x[members], w[members]
      new_x = weights[receives] @ sent_x
      new_w = weights[receives] @ sent_w
      for i, xi, wi in zip(members[receives], new_x, new_w):
        x[i] = xi
        if push_sum:
          w[i] = wi
        remember(i)
  if curves["gradients"][-1] != applied:
    evaluate(schedule.total_time)
  final = {k: curves[k][-1] for k in ("loss", "replica_loss", "consensus", "test_error")}
  final.update(gradients=applied, simulated_time=schedule.total_time,
               mean_consensus=float(np.mean(curves["consensus"][1:])) if len(curves["consensus"]) > 1 else 0.0,
               total_wait=float(schedule.wait.sum()), idle_fraction=float(schedule.idle_fraction.mean()),
               mean_lag=float(np.mean(schedule.message_lags())) if schedule.message_lags().size else 0.0)
  return {"metrics": final, "curves": curves, "x": x / w[:, None]}


def run_replica_runtime(task: GossipTask, schedule: C.GossipSchedule, paradigm: str, *, lr: float,
                        momentum: float, batch: int, seed: int, eval_every: int, shards: str,
                        method: dj.gossip.GossipMethod | None = None, layers: bool = False) -> dict[str, Any]:
  """The record of :func:`run_schedule`, computed by ``dj.simulate_gossip`` (the replica runtime).

  ``method``: the ``dj.gossip`` method to run (default: the paradigm's own averaging rule). ``layers``: the
  same model as two leaves, ``{"b": [10], "w": [64, 10]}`` (bias and weights), for rules that treat layers
  apart (LayUp); otherwise one flat ``[650]`` vector.
  """
  import jax.numpy as jnp
  import optax

  x, y = jnp.asarray(task.x, jnp.float32), jnp.asarray(task.y, jnp.int32)
  xt, yt = jnp.asarray(task.x_test, jnp.float32), jnp.asarray(task.y_test, jnp.int32)

  def matrix(params):
    # The bias row last: the features' last column is the constant 1.
    return jnp.concatenate([params["w"], params["b"][None]], axis=0) if layers else params.reshape(65, 10)

  def loss_fn(params, b):
    return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ matrix(params), b["y"]).mean()

  def eval_fn(params):
    return {"loss": loss_fn(params, {"x": x, "y": y}),
            "test_error": jnp.mean(jnp.argmax(xt @ matrix(params), -1) != yt).astype(jnp.float32)}

  if method is None:
    method = {"allreduce": dj.gossip.d_psgd, "d_psgd": dj.gossip.d_psgd, "ad_psgd": dj.gossip.ad_psgd,
              "sgp": dj.gossip.sgp, "gossipgrad": dj.gossip.gossip_grad}[paradigm]()
  tx = optax.sgd(lr, momentum=momentum or None)
  data = {"x": np.asarray(task.x, np.float32), "y": task.y.astype(np.int32)}
  sampling = (dj.Sampling(batch, scheme="shard", shards=task.shards) if shards == "label"
              else dj.Sampling(batch, scheme="iid"))
  params = ({"b": jnp.zeros(10, jnp.float32), "w": jnp.zeros((64, 10), jnp.float32)} if layers
            else jnp.zeros(650, jnp.float32))
  # Chunks of a fixed 256 steps (the runtime's longest default): the seeds of a run, whose schedules differ by a
  # few steps, then share one compiled program; the padding steps change nothing.
  result = dj.simulate_gossip(loss_fn, tx, method, params, data, schedule, seed=seed, sampling=sampling,
                              record=dj.Record(eval_fn=eval_fn, every=eval_every),
                              execution=dj.Execution(chunk_size=256))
  h = result.history
  grads = np.asarray(h.eval_gradients)
  # The consensus distance after the step at which each evaluation was taken (0 at the start: equal replicas).
  at = np.searchsorted(np.asarray(h.gradients), grads, side="left")
  consensus = np.where(grads > 0, np.asarray(h.consensus, np.float64)[np.minimum(at, len(h.gradients) - 1)], 0.0)
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


def schedule_for(config: dict[str, Any], spec: dict[str, Any], seed: int) -> C.GossipSchedule:
  """The gossip schedule of a run: ``config``'s workers (speeds, compute and comm models), the spec's paradigm
  and failures, ``config["steps"]`` gradients per replica."""
  num = len(config["speeds"])
  workers = C.workers(num, compute=config["compute"], comm=config.get("comm"), speed=config["speeds"])
  down = [C.node_down(*d) for d in spec.get("down", ())]
  fail = C.failures(spec.get("drop", 0.0), down) if spec.get("drop") or down else None
  return C.simulate_gossip(paradigm_for(spec, num), workers, config["steps"], seed=seed, failures=fail)


def run_spec(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any,
             method: Any = None) -> dict[str, Any]:
  """One run of a gossip reproduction: simulate the schedule, execute it, add the times to the target loss.

  ``config["runtime"]``: ``"numpy"`` (default: :func:`run_schedule`, fast at this size) or ``"dj"``
  (``dj.simulate_gossip``, the compiled replica runtime, float32, its own minibatch draws). ``method``, a
  function of the schedule returning a ``dj.gossip`` method (A2CiD2, DC-S3GD, LayUp: rules the NumPy executor
  does not have), runs that method on the replica runtime whatever ``config["runtime"]`` says; ``spec["layers"]``
  gives it the model as two leaves (:func:`run_replica_runtime`).
  """
  schedule = schedule_for(config, spec, seed)
  task = digits_task(len(config["speeds"]), spec.get("shards", config.get("shards", "iid")))
  every = max(1, schedule.num_gradients // config.get("evals", 20))
  if method is not None or config.get("runtime", "numpy") == "dj":
    record = run_replica_runtime(task, schedule, spec["paradigm"], lr=config["lr"],
                                 momentum=config.get("momentum", 0.0), batch=config["batch"], seed=seed,
                                 eval_every=every, shards=spec.get("shards", config.get("shards", "iid")),
                                 method=None if method is None else method(schedule),
                                 layers=spec.get("layers", False))
  else:
    record = run_schedule(task, schedule, lr=config["lr"], momentum=config.get("momentum", 0.0),
                          batch=config["batch"], seed=seed, eval_every=every, push_sum=spec["paradigm"] == "sgp")
    del record["x"]
  record["metrics"]["time_to_target"] = time_to(record, config["target_loss"])
  record["metrics"]["gradients_to_target"] = time_to(record, config["target_loss"], "gradients")
  half = int(np.argmin(np.abs(np.asarray(record["curves"]["gradients"]) - schedule.num_gradients / 2)))
  record["metrics"]["loss_half"] = record["curves"]["loss"][half]
  record["staleness_hist"] = schedule.staleness_histogram()
  progress(1, 1)
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
