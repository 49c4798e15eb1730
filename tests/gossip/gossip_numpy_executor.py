"""The NumPy executor the gossip reproductions ran on before they moved to ``dj.simulate_gossip`` (tests only).

:func:`run_schedule` executes a ``dj.cluster.GossipSchedule`` event by event
on ``M`` replicas held as one ``[M, d]`` float64 array, with per-replica SGD
with momentum and, for SGP, the push-sum weight (gradients at
``z_i = x_i / w_i``), for the softmax regression on the 8x8 digits of
``experiments/_gossip_train.py``. Every ``eval_every`` applied gradients it
records the training loss and test error of the average model ``z_bar``, the
mean of the replicas' own losses, and the consensus distance
``mean_i ||z_i - z_bar||^2``, against applied gradients and simulated time.
Its minibatches are its own (NumPy generators seeded per replica) unless
given.

It serves as a second implementation: ``test_gossip_experiments.py`` pins it
to the sequential reference (``gossip_reference.py``) and the reproductions'
runs on ``dj.simulate_gossip`` to it; and ``experiments/bench_reproductions.py``
loads it from a checkout's ``tests/gossip/`` folder to time the reproductions
on it beside the library (:func:`run_spec` is a reproduction's ``run``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import delayjax as dj
from experiments import _gossip_train as gt

C = dj.cluster


def _softmax(logits: np.ndarray) -> np.ndarray:
  z = logits - logits.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def loss(task: gt.GossipTask, params: np.ndarray) -> np.ndarray:
  """Mean cross-entropy on the training set of parameters ``[650]`` or ``[M, 650]`` (one value per model)."""
  stacked = np.atleast_2d(params).reshape(-1, 65, 10)
  # One [n, 65] x [65, M * 10] product for all models.
  logits = (task.x @ stacked.transpose(1, 0, 2).reshape(65, -1)).reshape(task.x.shape[0], -1, 10)
  z = logits - logits.max(axis=-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  nll = -logp[np.arange(task.y.shape[0]), :, task.y].mean(axis=0)
  return nll if params.ndim == 2 else nll[0]


def error_rate(task: gt.GossipTask, params: np.ndarray) -> float:
  w = params.reshape(65, 10)
  return float(np.mean(np.argmax(task.x_test @ w, axis=1) != task.y_test))


def gradient(task: gt.GossipTask, params: np.ndarray, index: np.ndarray) -> np.ndarray:
  """The mean cross-entropy gradient on the examples ``index``, flat ``[650]``."""
  xb, yb = task.x[index], task.y[index]
  p = _softmax(xb @ params.reshape(65, 10))
  p[np.arange(yb.shape[0]), yb] -= 1.0
  return (xb.T @ p / yb.shape[0]).ravel()


def batches(task: gt.GossipTask, schedule: C.GossipSchedule, batch: int, seed: int) -> list[np.ndarray]:
  """Per replica, ``[num minibatches, batch]`` example indices drawn from its shard (seeded per replica)."""
  counts = np.zeros(schedule.num_workers, np.int64)
  reads = schedule.kind == C.READ
  np.add.at(counts, schedule.worker[reads], schedule.num_batches[reads])
  rngs = [np.random.default_rng([seed, i]) for i in range(schedule.num_workers)]
  return [shard[rng.integers(shard.shape[0], size=(int(n), batch))]
          for shard, rng, n in zip(task.shards, rngs, counts)]


def run_schedule(task: gt.GossipTask, schedule: C.GossipSchedule, *, lr: float, momentum: float = 0.0,
                 batch: int = 32, seed: int = 0, eval_every: int = 100, push_sum: bool = False,
                 x0: np.ndarray | None = None, idx: list[np.ndarray] | None = None) -> dict[str, Any]:
  """Executes ``schedule`` from the zero model (or ``x0`` ``[M, 650]``) and returns the run record.

  ``idx``: per replica, ``[num minibatches, batch]`` example indices (default: :func:`batches`).

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
  idx = batches(task, schedule, batch, seed) if idx is None else idx
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


def run_spec(config: dict[str, Any], spec: dict[str, Any], seed: int, progress: Any) -> dict[str, Any]:
  """A gossip reproduction's run (``gt.run_spec``'s record) executed by :func:`run_schedule`."""
  schedule = gt.schedule_for(config, spec, seed)
  task = gt.digits_task(len(config["speeds"]), spec.get("shards", config.get("shards", "iid")))
  record = run_schedule(task, schedule, lr=config["lr"], momentum=config.get("momentum", 0.0),
                        batch=config["batch"], seed=seed, eval_every=gt.eval_every(config, schedule),
                        push_sum=spec["paradigm"] == "sgp")
  del record["x"]
  progress(1, 1)
  return gt.finish_record(config, schedule, record)
