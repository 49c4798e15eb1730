"""NumPy re-implementations of the gossip methods' rules, and random event sequences to run them on.

Each rule is written from its paper or reference code (see the methods'
docstrings), independently of ``delayjax.gossip``: float64 arithmetic, a
linear-regression loss with its gradient in closed form, SGD with momentum
written out (``m <- beta m + g``, ``x <- x - lr m``), events applied one at a
time in the schedule's order. Only the minibatch indices come from the
library (``minibatch_indices`` defines them).
"""

from __future__ import annotations

import numpy as np

from delayjax.cluster._gossip import GRAD, GRADS, MIX, PARAMS, READ, GossipSchedule
from delayjax.runtime._sampling import minibatch_indices


def regression(num_examples: int = 40, dim: int = 3, seed: int = 0):
  """Data, a JAX loss and float32 initial parameters ``{"w": [dim], "b": []}``."""
  import jax.numpy as jnp

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_examples, dim)).astype(np.float32)
  y = (x @ np.arange(1, dim + 1, dtype=np.float32) - 0.5).astype(np.float32)

  def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

  params = {"b": np.float32(0.3), "w": np.full((dim,), 0.1, np.float32)}
  return {"x": x, "y": y}, loss_fn, params


def flat(params) -> np.ndarray:
  """``[w..., b]`` as float64 (the reference's parameter vector)."""
  return np.concatenate([np.asarray(params["w"], np.float64).ravel(), [float(params["b"])]])


def grad(theta: np.ndarray, data, idx) -> np.ndarray:
  x, y = np.asarray(data["x"], np.float64)[idx], np.asarray(data["y"], np.float64)[idx]
  r = x @ theta[:-1] + theta[-1] - y
  return np.concatenate([2.0 * x.T @ r / len(idx), [2.0 * r.mean()]])


def random_schedule(num_workers: int, num_events: int, *, seed: int = 0, group: int = 2, lag: int = 0,
                    mixes: int = PARAMS, push_sum: bool = False, max_batches: int = 1) -> GossipSchedule:
  """Random asynchronous events: reads and gradients of random replicas, mixes of random groups.

  Mix weights are random and row-stochastic (column-stochastic with
  ``push_sum``: each member splits its mass among the group); with ``lag``,
  each sent value is up to ``lag`` versions old (never before version 0).
  """
  rng = np.random.default_rng(seed)
  pending = np.zeros(num_workers, bool)
  version = np.zeros(num_workers, np.int64)
  rows = []
  t = 0.0
  for _ in range(num_events):
    t += float(rng.exponential(0.5))
    if rng.random() < 0.55 or (mixes == GRADS and pending.sum() < 2):
      r = int(rng.integers(num_workers))
      kind = GRAD if pending[r] else READ
      nb = int(rng.integers(1, max_batches + 1))
      if kind == GRAD:
        nb = next(x["num_batches"] for x in reversed(rows) if x.get("worker") == r)
        version[r] += 1
      pending[r] = not pending[r]
      rows.append({"time": t, "kind": kind, "worker": r, "num_batches": nb})
      continue
    pool = np.flatnonzero(pending) if mixes == GRADS else np.arange(num_workers)
    size = min(group, len(pool))
    if size < 1 or num_workers < 2:
      continue
    members = rng.choice(pool, size=size, replace=False)
    w = rng.uniform(0.2, 1.0, (size, size))
    w = w / w.sum(axis=0, keepdims=True) if push_sum else w / w.sum(axis=1, keepdims=True)
    lags = np.zeros(size, np.int64)
    if lag and mixes == PARAMS:
      lags = np.minimum(rng.integers(0, lag + 1, size), version[members])
    receives = np.ones(size, bool)
    rows.append({"time": t, "kind": MIX, "members": members, "weights": w, "lag": lags, "receives": receives,
                 "mixes": mixes})
    if mixes == PARAMS:
      version[members] += 1
  return _schedule(num_workers, rows, group)


def _schedule(num_workers: int, rows, group: int) -> GossipSchedule:
  mixes_rows = [r for r in rows if r["kind"] == MIX]
  n = len(mixes_rows)
  members = -np.ones((n, group), np.int64)
  weights = np.zeros((n, group, group))
  lag = np.zeros((n, group), np.int64)
  receives = np.zeros((n, group), bool)
  kind = np.array([r["kind"] for r in rows], np.int8)
  worker = np.array([r.get("worker", -1) for r in rows], np.int64)
  batches = np.array([r.get("num_batches", 0) for r in rows], np.int64)
  mix = np.where(kind == MIX, np.cumsum(kind == MIX) - 1, -1)
  mixes = np.array([r["mixes"] for r in mixes_rows], np.int8)
  for k, r in enumerate(mixes_rows):
    size = len(r["members"])
    members[k, :size] = r["members"]
    weights[k, :size, :size] = r["weights"]
    lag[k, :size] = r["lag"]
    receives[k, :size] = r["receives"]
  return GossipSchedule(num_workers=num_workers, time=[r["time"] for r in rows], kind=kind, worker=worker,
                        num_batches=batches, mix=mix, members=members, weights=weights, lag=lag, receives=receives,
                        mixes=mixes)


def run_reference(method: str, schedule: GossipSchedule, params, data, *, lr: float, beta: float,
                  batch_size: int, seed: int = 0, lam: float = 0.0, eta: float = 0.0, beta_tilde: float = 0.0,
                  time_unit: float = 1.0, agg: float = 1.0) -> dict[str, np.ndarray]:
  """Every replica's final state under ``method``'s rule (float64 ``[M, d + 1]`` arrays)."""
  m = schedule.num_workers
  n = np.asarray(data["x"]).shape[0]
  x = np.tile(flat(params), (m, 1))
  dim = x.shape[1] - 1
  # LayUp's layers in backpropagation order: the leaves {"b", "w"} in reverse, i.e. w (x[:dim]) then b.
  layers = [slice(0, dim), slice(dim, dim + 1)]
  cursor = np.zeros(m, np.int64)
  ag = x.copy()  # accelerated SGD's aggregate
  mom = np.zeros_like(x)
  w = np.ones(m)
  tilde = x.copy()  # A2CiD2's twin
  avg = x.copy()  # DC-S3GD: last all-reduced model
  last_time = np.zeros(m)
  pending = [None] * m
  draws = np.zeros(m, np.int64)
  history = [[(x[i].copy(), w[i])] for i in range(m)]  # messages by local version

  def flow(i, t):
    if method != "a2cid2":
      return
    c = 0.5 * (1.0 - np.exp(-2.0 * eta * (t - last_time[i]) / time_unit))
    xi, ti = x[i].copy(), tilde[i].copy()
    x[i], tilde[i] = (1 - c) * xi + c * ti, c * xi + (1 - c) * ti
    last_time[i] = t

  for e in range(schedule.num_events):
    kind, t = schedule.kind[e], schedule.time[e]
    if kind == READ:
      i = int(schedule.worker[e])
      at = x[i] / w[i] if method == "sgp" else x[i].copy()
      if method == "accelerated":
        at = (1 - 1 / agg) * ag[i] + (1 / agg) * x[i]
      nb = int(schedule.num_batches[e])
      gs = []
      for j in range(nb):
        idx = np.asarray(minibatch_indices(seed, 0, i, int(draws[i]) + j, num_examples=n,
                                           batch_size=batch_size))
        gs.append(grad(at, data, idx))
      pending[i] = np.mean(gs, axis=0)
      draws[i] += nb
    elif kind == GRAD:
      i = int(schedule.worker[e])
      g = pending[i]
      flow(i, t)
      if method == "dc_s3gd":
        g = g + lam * g * g * (avg[i] - x[i])
        mom[i] = beta * mom[i] + g
        x[i] = avg[i] - lr * mom[i]
      else:
        mom[i] = beta * mom[i] + g
        x[i] = x[i] - lr * mom[i]
        if method == "a2cid2":
          tilde[i] = tilde[i] - lr * mom[i]
        if method == "accelerated":
          ag[i] = (1 - 1 / agg) * ag[i] + (1 / agg) * x[i]
      history[i].append((x[i].copy(), w[i]))
    else:
      q = schedule.mix[e]
      row = schedule.members[q]
      group = row[row >= 0]
      k = len(group)
      W = schedule.weights[q][:k, :k]
      recv = schedule.receives[q][:k]
      if schedule.mixes[q] == GRADS:
        sent = [pending[b].copy() for b in group]
        for a in range(k):
          if recv[a]:
            pending[group[a]] = sum(W[a, b] * sent[b] for b in range(k))
        continue
      for b in group:
        flow(b, t)
      if method == "dc_s3gd":
        # The all-reduce averages the local models into each receiver's known average; x stays.
        sent = [x[b].copy() for b in group]
        for a in range(k):
          if recv[a]:
            avg[group[a]] = sum(W[a, b] * sent[b] for b in range(k))
        for a in range(k):
          if recv[a]:
            history[group[a]].append((x[group[a]].copy(), w[group[a]]))
        continue
      if method == "layup":
        # Each member pushes the layer its cursor points to; a receiver averages every pushed layer with its
        # own copy, renormalized over the members that pushed it. No late messages.
        assert not schedule.lag[q][:k].any()
        sent = [(x[b].copy(), layers[cursor[b]]) for b in group]
        for a in range(k):
          if not recv[a]:
            continue
          i = group[a]
          for layer in layers:
            pushers = [b for b in range(k) if b != a and sent[b][1] == layer]
            if pushers:
              num = W[a, a] * x[i][layer] + sum(W[a, b] * sent[b][0][layer] for b in pushers)
              x[i][layer] = num / (W[a, a] + sum(W[a, b] for b in pushers))
          cursor[i] = (cursor[i] + 1) % len(layers)
        continue
      if method == "accelerated":
        assert not schedule.lag[q][:k].any()
        sent = [(x[b].copy(), ag[b].copy()) for b in group]
        for a in range(k):
          if recv[a]:
            x[group[a]] = sum(W[a, b] * sent[b][0] for b in range(k))
            ag[group[a]] = sum(W[a, b] * sent[b][1] for b in range(k))
        continue
      lags = schedule.lag[q][:k]
      sent = []
      for b in range(k):
        if lags[b] == 0:
          sent.append((x[group[b]].copy(), w[group[b]]))
        else:
          sent.append(history[group[b]][len(history[group[b]]) - 1 - lags[b]])
      for a in range(k):
        if not recv[a]:
          continue
        i = group[a]
        mixed = sum(W[a, b] * sent[b][0] for b in range(k))
        if method == "a2cid2":
          # Pairwise: x~_i += beta~ (x_j - x_i); groups: the weighted mean difference.
          tilde[i] = tilde[i] + beta_tilde * sum(W[a, b] * (sent[b][0] - x[i]) for b in range(k) if b != a) / (
              1.0 - W[a, a])
        new_w = sum(W[a, b] * sent[b][1] for b in range(k))
        x[i] = mixed
        if method == "sgp":
          w[i] = new_w
      for a in range(k):
        if recv[a]:
          history[group[a]].append((x[group[a]].copy(), w[group[a]]))
  return {"x": x, "w": w, "tilde": tilde, "average": avg, "momentum": mom, "cursor": cursor, "aggregate": ag}
