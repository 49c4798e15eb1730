"""DIGEST: GNN training on partitions with periodically synchronized stale representations (Chai et al. 2022).

Staleness of activations rather than of gradients. A two-layer graph
convolutional network (GCN) learns node classes on a generated graph (a
stochastic block model whose features are noisy class means), its nodes split
at random into ``P`` partitions, one worker each. Every step each worker
computes the layer outputs of its own nodes with the current parameters; where
a layer reads a neighbour in another partition (a *halo* node), it reads that
neighbour's representation from a shared store, which is refreshed every
``k`` steps (every worker pushes its own nodes' representations, and pulls its
halo's). The workers' gradients are combined into one synchronous update
(data parallel over partitions). Five ways of training are compared on the
same graph, partition and initialization:

- ``full``: full-graph GCN training (exact forward and gradient);
- ``digest-k{k}``: DIGEST with synchronization period ``k`` for each ``k`` of
  the grid (``k = 1``: the forward pass is the full graph's, exactly);
- ``partition``: partition-based training, the edges between partitions
  dropped (each worker trains on its own subgraph, nothing communicated).

Every model is evaluated by the exact full-graph forward pass. Reported: the
final test error, the final full-graph training loss, the representation
traffic of the refreshes (floats pulled by all workers) and the relative error
of the cached halo representations against the fresh ones, averaged over steps.

**Only the paper's abstract could be read here** (its arXiv abstract and the
abstract of its ICLR 2023 submission): each device uses "the stale
representations of its neighbors in other subgraphs during subgraph parallel
training", which "preserves global graph information from neighbors to avoid
information loss and reduce the communication cost", with a bounded
approximation error and "without compromising performance". What is cached (the
hidden representations of the halo at every layer that reads them), when the
store is refreshed (every ``k`` steps, all layers, by an exact layer-by-layer
push and pull at the current parameters) and that no gradient crosses a
partition (a cached representation is a constant) are this module's
construction of that sentence. The claims below are the abstract's at this
scale, and the trade-off the period implies (traffic falls as ``1/k``; the
representations, and perhaps the accuracy, age with ``k``).

    python -m experiments run digest

References:
  Chai, Bai, Zhao, Cheng, `Distributed Graph Neural Network Training with Periodic Stale Representation
  Synchronization <https://arxiv.org/abs/2206.00057>`_, arXiv 2022 (ICLR 2023 submission).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _plots
from ._framework import COUNT, FRACTION, POSITIVE, Claim, ClaimResult, Range, Reproduction, Summary, mean_rows, paired

# Config: a stochastic block model of 400 nodes in 4 classes, mean degree 8, 70% of the edges within a class;
# features: 16-dimensional class means (standard normal) plus noise of standard deviation 2.5, so that a node's own
# features say little and its neighbourhood much; 20% of the nodes labelled for training, the rest the test set.
# P = 4 random partitions (so about 3/4 of the edges cross partitions: the hard case for dropping them). GCN 16 -> 16
# -> 4 with biases, Adam lr 0.01, 200 full-batch steps. Periods 1, 4, 16 and 64 (64: 4 refreshes in 200 steps).
# Chosen before any run (usual GCN values, not tuned: Kipf and Welling's hidden 16, Adam lr 0.01, 200 steps), and
# the claims below written, before a pilot run on seeds outside the reported ones (100, 101); nothing was changed
# after it. Pilot, test error in % (seed 100; 101): full-graph 9.4; 13.8, DIGEST k = 1 12.8; 16.6, k = 4 12.5;
# 15.6, k = 16 12.5; 15.0, k = 64 11.9; 16.9, partition-based 19.4; 17.5. The gap between full-graph training and
# DIGEST at k = 1, whose forward pass is exact, is the gradient that does not cross partitions (3/4 of the edges
# here), not staleness. Reported seeds: 0-7.
# Result (8 seeds): the traffic claim held (1/4, 0.065, 0.02 of period 1's: ceil(T/k)/T); the other three were
# inconclusive. Test error of DIGEST - full graph: +1.6 points [-0.4, +3.6] at k = 1, +1.4 [-0.3, +3.2] at k = 4
# (claimed < 2); DIGEST - partition-based: -5.1 [-8.5, -1.7], -5.3, -4.1 [-8.7, +0.5] (k = 16), -4.9 [-7.4, -2.5]
# (k = 64); k = 64 - k = 1: +0.2 [-1.5, +1.8], while the cached representations' relative error grew from 0.017
# (k = 4) to 0.28 (k = 64): at this scale the accuracy did not measurably degrade with the period.
# No paper_numbers: the abstract gives only a speed-up (21.82x) on graphs and hardware this scale does not model.
# Seeds at quick scale: 16 (issue 28; was 8). The 8-seed run's per-seed spread decides what more seeds can do. The
# partition claim's undecided comparison, k = 16 - partition-based, has sd 5.5 points around a mean of -4.1: at 16
# seeds the half-width is near 2.9 (t_15 5.5 / 4), enough to clear 0 if the mean stays where it is (12 seeds: 3.5).
# The other two cannot be decided by seeds at this budget: DIGEST - full graph sits 0.36 (k = 1, sd 2.4) and 0.55
# (k = 4, sd 2.1) points under its 2-point margin, which would take about 175 and 60 seeds; k = 64 - k = 1 sits
# 0.2 points (sd 2.0) above 0, about 400 seeds. They are re-decided on the 16 seeds. 16 seeds took 28 CPU s on
# seeds 1000-1015 (a timing run, its claims not used), within twice the 8-seed run's 22.5 s.
# Result (16 seeds, 30 CPU s): DIGEST - partition-based held at every period (k = 16: -3.5 [-5.8, -1.1]); DIGEST -
# full graph +1.07 [+0.09, +2.06] (k = 1) and +0.94 [+0.04, +1.84] (k = 4) and k = 64 - k = 1 +0.14 [-0.65, +0.92]
# stay inconclusive.
# Seeds at quick scale: 32 (second raise, issue 28; was 16). The 16-seed run's spread of DIGEST - full graph: mean
# +1.07 points, sd 1.85 (k = 1) and +0.94, sd 1.69 (k = 4), 0.93 and 1.06 under the 2-point margin. The half-width
# t s / sqrt(N) at 32 seeds is 0.67 (k = 1) and 0.61 (k = 4), enough to decide the margin if the means stay under
# 1.33 and 1.39 (k = 1 alone needs 18 seeds from a mean of 1.07, at which the half-width is 0.92). k = 64 - k = 1
# (+0.14 over 0) is not what the seeds were chosen for; it is re-decided on the 32. 32 seeds took 67 CPU s (user) on
# seeds 1000-1031 (a timing run, its claims not used), within the 80 s allowed this reproduction.
# Result (32 seeds, 60 CPU s user; seeds 0-15 the same, bit for bit, as the 16-seed run's): DIGEST - full graph
# +1.33 [+0.74, +1.92] (k = 1) and +1.20 [+0.64, +1.76] (k = 4) points, under the 2-point margin: held; DIGEST -
# partition-based held at every period (k = 16: -3.0 [-4.5, -1.6]); traffic held; k = 64 - k = 1 -0.26 [-0.71,
# +0.18]: inconclusive, no sign of degradation at this scale.
SCALES = {
    "quick": dict(nodes=400, classes=4, degree=8.0, homophily=0.7, feature_dim=16, feature_noise=2.5,
                  train_fraction=0.2, parts=4, hidden=16, lr=0.01, steps=200, periods=[1, 4, 16, 64],
                  seeds=32, eval_every=10),
}
LIMITS = {"nodes": COUNT, "classes": Range(2, integer=True), "degree": POSITIVE, "homophily": FRACTION,
          "feature_dim": COUNT, "feature_noise": Range(0.0), "train_fraction": FRACTION, "parts": COUNT,
          "periods": COUNT, "steps": COUNT}


class Graph(NamedTuple):
  """A node-classification graph (host NumPy arrays)."""

  adjacency: np.ndarray  # (n, n) bool, symmetric, no self-loops
  features: np.ndarray  # (n, d) float32
  labels: np.ndarray  # (n,) int32
  train: np.ndarray  # (n,) bool: labelled for training; the others are the test set


def _count(name: str, value: Any, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
  if value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value}.")
  return int(value)


def _fraction(name: str, value: Any) -> float:
  if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool) or not 0.0 < value <= 1.0:
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}.")
  return float(value)


def sbm_graph(nodes: int, classes: int, degree: float, homophily: float, feature_dim: int, feature_noise: float,
              train_fraction: float, seed: int) -> Graph:
  """A stochastic block model with ``classes`` balanced blocks, expected mean ``degree`` and ``homophily``.

  An edge joins two nodes of one class with probability ``homophily * degree / (n / c)`` and of two classes
  with ``(1 - homophily) * degree / (n - n / c)``, so that a node has ``degree`` neighbours on average, a
  fraction ``homophily`` of them in its class. Features: a standard normal mean per class plus
  ``feature_noise`` times standard normal noise per node. A random ``train_fraction`` of the nodes is labelled.
  """
  nodes, classes, feature_dim = (_count("nodes", nodes, 2), _count("classes", classes, 2),
                                 _count("feature_dim", feature_dim))
  if classes > nodes:
    raise ValueError(f"classes must be at most nodes ({nodes}), got {classes}.")
  homophily, train_fraction = _fraction("homophily", homophily), _fraction("train_fraction", train_fraction)
  block = nodes / classes
  p_in, p_out = homophily * degree / max(block - 1, 1), (1 - homophily) * degree / (nodes - block)
  if not degree > 0 or p_in > 1 or p_out > 1:
    raise ValueError(f"degree must be positive and small enough for edge probabilities <= 1 with {nodes} nodes "
                     f"in {classes} classes, got {degree!r}.")
  if not feature_noise >= 0:
    raise ValueError(f"feature_noise must be a number >= 0, got {feature_noise!r}.")
  rng = np.random.default_rng(seed)
  labels = rng.permutation(np.arange(nodes) % classes).astype(np.int32)
  same = labels[:, None] == labels[None, :]
  upper = np.triu(rng.random((nodes, nodes)) < np.where(same, p_in, p_out), k=1)
  adjacency = upper | upper.T
  means = rng.standard_normal((classes, feature_dim))
  features = (means[labels] + feature_noise * rng.standard_normal((nodes, feature_dim))).astype(np.float32)
  train = np.zeros(nodes, bool)
  train[rng.permutation(nodes)[:max(1, round(train_fraction * nodes))]] = True
  return Graph(adjacency, features, labels, train)


def normalized_adjacency(adjacency: np.ndarray) -> np.ndarray:
  r"""GCN's propagation matrix :math:`\hat A = D^{-1/2} (A + I) D^{-1/2}` (float32), ``D`` the degrees of ``A + I``."""
  a = np.asarray(adjacency, np.float64) + np.eye(len(adjacency))
  d = 1.0 / np.sqrt(a.sum(1))
  return (d[:, None] * a * d[None, :]).astype(np.float32)


def random_partition(nodes: int, parts: int, seed: int) -> np.ndarray:
  """``owner[v]``: the partition of node ``v``, balanced (sizes differ by at most one) and at random (int32)."""
  nodes, parts = _count("nodes", nodes), _count("parts", parts)
  if parts > nodes:
    raise ValueError(f"parts must be at most nodes ({nodes}), got {parts}.")
  return (np.random.default_rng(seed).permutation(nodes) % parts).astype(np.int32)


def _owner_masks(owner: np.ndarray, parts: int) -> np.ndarray:
  owner = np.asarray(owner)
  if owner.ndim != 1 or owner.size == 0 or owner.min() < 0 or owner.max() >= parts:
    raise ValueError(f"owner must be a 1-d array of partitions in [0, {parts}), got shape {owner.shape} "
                     f"and values in [{owner.min() if owner.size else None}, {owner.max() if owner.size else None}].")
  return owner[None, :] == np.arange(parts)[:, None]


def halo_masks(adjacency: np.ndarray, owner: np.ndarray, parts: int) -> np.ndarray:
  """``(parts, n)`` bool: node ``v`` is in partition ``p``'s halo when another partition owns it and it has a
  neighbour in ``p`` (the representations ``p`` pulls from the store at every refresh)."""
  own = _owner_masks(owner, parts)
  touches = (own.astype(np.int64) @ np.asarray(adjacency, np.int64)) > 0
  return touches & ~own


def cut_adjacency(adjacency: np.ndarray, owner: np.ndarray) -> np.ndarray:
  """The adjacency without the edges between partitions (partition-based training's subgraphs)."""
  owner = np.asarray(owner)
  return np.asarray(adjacency) & (owner[:, None] == owner[None, :])


def init_gcn(key: jax.Array, sizes: tuple[int, ...]) -> list[tuple[jax.Array, jax.Array]]:
  """GCN weights ``[(W_l, b_l)]`` for layer sizes ``(d_in, h_1, ..., classes)``: Glorot-uniform, zero biases."""
  if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
    raise ValueError(f"sizes must be at least two positive integers (input, ..., classes), got {sizes!r}.")
  keys = jax.random.split(key, len(sizes) - 1)
  return [(jax.nn.initializers.glorot_uniform()(k, (a, b), jnp.float32), jnp.zeros((b,), jnp.float32))
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _layers(params, a_hat, x, read):
  """The GCN forward pass; ``read(l, h)`` gives the representations layer ``l >= 1`` reads (fresh or cached)."""
  h, hidden = x, []
  for l, (w, b) in enumerate(params):
    if l:
      hidden.append(h)
      h = read(l - 1, h)
    z = a_hat @ (h @ w) + b
    h = jax.nn.relu(z) if l < len(params) - 1 else z
  return h, hidden


def _full_forward(params, a_hat, x):
  """Logits and the hidden representations (inputs of layers 1..L-1) of the exact full-graph pass."""
  return _layers(params, a_hat, x, lambda l, h: h)


def _cross_entropy(logits, onehot, weights):
  return -jnp.sum(weights * jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1))


def _error(logits, onehot, weights):
  return jnp.sum(jnp.where(jnp.argmax(logits, -1) != jnp.argmax(onehot, -1), weights, 0.0))


def _partitioned_loss(params, cache, a_hat, x, onehot, weights, own):
  """The sum over partitions of each one's loss on its own labelled nodes, its halo read from the cache.

  Partition ``p`` computes every layer with the current parameters; a layer's input is ``p``'s own fresh
  representation on ``p``'s nodes and the cached one elsewhere (only the halo's rows reach ``p``'s nodes). The
  cache is a constant: no gradient reaches another partition.
  """
  def one(mine):
    read = lambda l, h: jnp.where(mine[:, None], h, jax.lax.stop_gradient(cache[l]))  # noqa: E731
    logits, _ = _layers(params, a_hat, x, read)
    return _cross_entropy(logits, onehot, jnp.where(mine, weights, 0.0))
  return jnp.sum(jax.vmap(one)(own))


@functools.partial(jax.jit, static_argnames=("steps", "optimizer"))
def _train(params, lr, period, a_train, a_eval, x, onehot, weights, test_weights, own, halo, *, steps, optimizer):
  tx = optax.adam(lr) if optimizer == "adam" else optax.sgd(lr)

  def step(carry, t):
    params, opt_state, cache = carry
    refresh = t % period == 0
    # A refresh: every worker pushes its nodes' representations and pulls its halo's, layer after layer, at the
    # current parameters; that is the exact full-graph pass of the training graph.
    _, fresh = _full_forward(params, a_train, x)
    cache = [jnp.where(refresh, f, c) for f, c in zip(fresh, cache)]
    loss, grads = jax.value_and_grad(_partitioned_loss)(params, cache, a_train, x, onehot, weights, own)
    updates, opt_state = tx.update(grads, opt_state, params)
    # How stale the halo's representations are at this step: relative error against the fresh ones.
    on_halo = jnp.any(halo, axis=0)[:, None]
    gap = sum(jnp.sum(jnp.where(on_halo, f - c, 0.0) ** 2) for f, c in zip(fresh, cache))
    size = sum(jnp.sum(jnp.where(on_halo, f, 0.0) ** 2) for f in fresh)
    logits, _ = _full_forward(params, a_eval, x)
    metrics = dict(loss=loss, refresh=refresh, cache_error=jnp.sqrt(gap / jnp.maximum(size, 1e-30)),
                   train_loss=_cross_entropy(logits, onehot, weights),
                   test_error=_error(logits, onehot, test_weights))
    return (optax.apply_updates(params, updates), opt_state, cache), metrics

  _, fresh = _full_forward(params, a_train, x)
  carry = (params, tx.init(params), [jnp.zeros_like(f) for f in fresh])
  (params, _, cache), metrics = jax.lax.scan(step, carry, jnp.arange(steps, dtype=jnp.int32))
  logits, _ = _full_forward(params, a_eval, x)
  final = dict(train_loss=_cross_entropy(logits, onehot, weights),
               test_error=_error(logits, onehot, test_weights))
  return params, cache, metrics, final


def train_gcn(graph: Graph, owner: np.ndarray, params: list[tuple[jax.Array, jax.Array]], *, period: int,
              steps: int, lr: float, mode: str = "digest", optimizer: str = "adam") -> dict[str, Any]:
  r"""Trains a GCN on partitions with a halo cache refreshed every ``period`` steps (DIGEST).

  With ``P`` partitions :math:`V_p`, halo representations cached at the last refresh :math:`r(t) = k \lfloor
  t / k \rfloor` and :math:`\tilde H^{(l)}_p = H^{(l)}_p(w_t)` on :math:`V_p`, :math:`H^{(l)}(w_{r(t)})`
  elsewhere (a constant), partition ``p`` computes

  .. math::  H^{(l+1)}_p = \sigma\big(\hat A\, \tilde H^{(l)}_p W_l + b_l\big), \qquad
             f_p(w_t) = \frac{1}{|T|} \sum_{v \in V_p \cap T} \mathrm{CE}\big(H^{(L)}_p[v], y_v\big)

  and the step applies :math:`\sum_p \nabla f_p(w_t)` (each partition's gradient, weighted by its share of the
  labelled nodes ``T``). At a refresh the cache is :math:`H^{(l)}(w_t)`, every layer's exact full-graph value.

  Args:
    graph: the graph (:func:`sbm_graph`).
    owner: ``(n,)`` the partition of each node (:func:`random_partition`).
    params: initial GCN weights (:func:`init_gcn`).
    period: ``k``, steps between two refreshes of the cache (1: every step).
    steps: training steps.
    lr: the learning rate.
    mode: ``"digest"`` (above), ``"full"`` (full-graph training: one worker owns every node, so the forward
      pass and the gradient are exact) or ``"partition"`` (the edges between partitions dropped: each worker
      trains on its own subgraph and pulls nothing).
    optimizer: ``"adam"`` or ``"sgd"``.

  Returns:
    ``{"params", "cache", "curves": {"loss", "train_loss", "test_error", "cache_error", "refresh"} per step (the
    full-graph metrics before the step's update), "train_loss", "test_error" (after the last step),
    "refreshes", "traffic"}``: ``traffic``, the floats pulled by all workers over the run (each refresh pulls
    every halo node's representation at every hidden layer).
  """
  if mode not in ("digest", "full", "partition"):
    raise ValueError(f"mode must be 'digest', 'full' or 'partition', got {mode!r}.")
  if optimizer not in ("adam", "sgd"):
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
  period, steps = _count("period", period), _count("steps", steps)
  if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 and math.isfinite(lr)):
    raise ValueError(f"lr must be a positive finite number, got {lr!r}.")
  n = len(graph.labels)
  owner = np.asarray(owner)
  if owner.shape != (n,):
    raise ValueError(f"owner must have one partition per node, shape ({n},), got shape {owner.shape}.")
  parts = int(owner.max()) + 1 if owner.size and owner.min() >= 0 else 0
  own = _owner_masks(owner, max(parts, 1))
  adjacency = graph.adjacency
  if mode == "partition":
    adjacency = cut_adjacency(adjacency, owner)
  halo = halo_masks(adjacency, owner, parts)
  if mode == "full":
    # One worker owns everything (the others nothing): the same program computes the full-graph gradient. Its
    # traffic is counted as a propagation-based method's, the partition's halo at every step (period 1).
    own = np.broadcast_to(np.arange(len(own))[:, None] == 0, own.shape)
  classes = int(graph.labels.max()) + 1
  onehot = np.eye(classes, dtype=np.float32)[graph.labels]
  weights = (graph.train / max(1, graph.train.sum())).astype(np.float32)
  test = ~graph.train
  test_weights = (test / max(1, test.sum())).astype(np.float32)
  params, cache, curves, final = _train(
      params, jnp.float32(lr), jnp.int32(period), normalized_adjacency(adjacency),
      normalized_adjacency(graph.adjacency), graph.features, onehot, weights, test_weights, own, halo,
      steps=steps, optimizer=optimizer)
  curves = {k: np.asarray(v) for k, v in curves.items()}
  refreshes = int(curves["refresh"].sum())
  hidden = sum(int(w.shape[1]) for w, _ in params[:-1])
  return dict(params=params, cache=cache, curves=curves, train_loss=float(final["train_loss"]),
              test_error=float(final["test_error"]), refreshes=refreshes,
              traffic=refreshes * int(halo.sum()) * hidden)


def specs(config: dict[str, Any]) -> list[dict[str, Any]]:
  return ([{"key": "full", "mode": "full", "period": 1}]
          + [{"key": f"digest-k{k}", "mode": "digest", "period": k} for k in config["periods"]]
          + [{"key": "partition", "mode": "partition", "period": 1}])


def problem(config: dict[str, Any], seed: int) -> tuple[Graph, np.ndarray]:
  """The seed's graph and partition (the same for every spec of the seed: the comparisons are paired)."""
  graph = sbm_graph(config["nodes"], config["classes"], config["degree"], config["homophily"],
                    config["feature_dim"], config["feature_noise"], config["train_fraction"], seed)
  return graph, random_partition(config["nodes"], config["parts"], seed + 1_000_003)


def run(config: dict[str, Any], spec: dict[str, Any], seed: int, progress) -> dict[str, Any]:
  graph, owner = problem(config, seed)
  params = init_gcn(jax.random.key(seed), (config["feature_dim"], config["hidden"], config["classes"]))
  out = train_gcn(graph, owner, params, period=spec["period"], steps=config["steps"], lr=config["lr"],
                  mode=spec["mode"])
  progress(config["steps"], config["steps"])
  c = out["curves"]
  at = np.arange(0, config["steps"], config["eval_every"])
  cut = float(np.sum(cut_adjacency(graph.adjacency, owner)) / max(1, np.sum(graph.adjacency)))
  diverged = not (math.isfinite(out["train_loss"]) and np.all(np.isfinite(c["loss"])))
  return {"metrics": {"test_error": out["test_error"], "test_error_pct": 100 * out["test_error"],
                      "train_loss": out["train_loss"], "traffic": out["traffic"], "refreshes": out["refreshes"],
                      "cache_error": float(np.mean(c["cache_error"])), "cut_fraction": 1.0 - cut},
          "curves": {"update": [int(t) for t in at] + [config["steps"]],
                     "test_error": [float(c["test_error"][t]) for t in at] + [out["test_error"]],
                     "train_loss": [float(c["train_loss"][t]) for t in at] + [out["train_loss"]]},
          "diverged": diverged}


def summarize(config: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = mean_rows(records, fields=("mode", "period"))
  base = next((r for r in rows if r["mode"] == "digest" and r["period"] == 1), None)
  for r in rows:
    r["traffic_vs_k1"] = r["traffic"] / base["traffic"] if base and base["traffic"] else math.nan
  return rows


def _digest_keys(summary: Summary) -> list[str]:
  """The DIGEST rows, shortest period first."""
  return sorted((k for k, r in summary.items() if r["mode"] == "digest"), key=lambda k: summary[k]["period"])


def _near_full(summary: Summary, periods: tuple[int, ...] = (1, 4), margin: float = 2.0) -> ClaimResult:
  keys = [k for k in _digest_keys(summary) if summary[k]["period"] in periods]
  return ClaimResult.decide([paired(summary, k, "full", "test_error_pct", margin=margin,
                                    what=f"test error {k} - full (points; claimed < {margin:g})") for k in keys])


def _beats_partition(summary: Summary) -> ClaimResult:
  return ClaimResult.decide([paired(summary, k, "partition", "test_error_pct",
                                    what=f"test error {k} - partition (points)") for k in _digest_keys(summary)])


def _traffic(summary: Summary) -> ClaimResult:
  # Counted from each run's own refreshes: the traffic of period k against period 1's, per seed, against
  # ceil(T/k)/T (= 1/k when k divides T). Deterministic for a graph: decided exactly, seed by seed.
  keys = _digest_keys(summary)
  base = next(k for k in keys if summary[k]["period"] == 1)
  ones = summary[base]["per_seed"]
  held, figures = True, []
  for k in keys[1:]:
    period = summary[k]["period"]
    ratios = [summary[k]["per_seed"]["traffic"][s] / ones["traffic"][s] for s in ones["traffic"]
              if ones["traffic"][s]]
    expected = [math.ceil(ones["refreshes"][s] / period) / ones["refreshes"][s] for s in ones["traffic"]
                if ones["traffic"][s]]
    held &= bool(ratios) and all(abs(r - e) < 1e-12 for r, e in zip(ratios, expected))
    figures.append(f"traffic {k} / digest-k1: {np.mean(ratios):.4g} (ceil(T/k)/T = {np.mean(expected):.4g}, "
                   f"1/k = {1 / period:.4g})" if ratios else
                   f"{k}: no traffic to compare")
  return ClaimResult(held if len(keys) > 1 else None, "; ".join(figures) or "not evaluated: one period only")


def _degrades(summary: Summary) -> ClaimResult:
  keys = _digest_keys(summary)
  return ClaimResult.decide(paired(summary, keys[-1], keys[0], "test_error_pct", claim="greater",
                                   what=f"test error {keys[-1]} - {keys[0]} (points)") if len(keys) > 1 else [])


CLAIMS = [
    Claim("digest-near-full", "DIGEST with a short period (1 and 4 steps) ends within 2 points of full-graph "
          "training's test accuracy", _near_full),
    Claim("digest-beats-partition", "at every period of the grid, DIGEST ends with lower test error than "
          "partition-based training that drops the edges between partitions", _beats_partition),
    Claim("digest-traffic", "the representation traffic of period k is that of period 1 divided by k (ceil(T/k) "
          "refreshes of T steps)", _traffic),
    Claim("digest-degrades", "accuracy degrades as the period grows: the longest period ends with more test error "
          "than period 1", _degrades),
]


def plots(config: dict[str, Any], records: list[dict[str, Any]], rows: list[dict[str, Any]], out: str) -> list[str]:
  label = lambda spec: spec["key"]  # noqa: E731
  colors = _plots.palette([s["key"] for s in specs(config)])
  return [_plots.curves(records, out, "error_vs_step", label=label, xs=("update",), colors=colors),
          _plots.curves(records, out, "loss_vs_step", y="train_loss", ylabel="training loss (full graph)",
                        log_y=True, label=label, xs=("update",), colors=colors)]


REPRODUCTION = Reproduction(
    name="digest",
    paper="Chai, Bai, Zhao, Cheng: Distributed Graph Neural Network Training with Periodic Stale Representation "
          "Synchronization (DIGEST), arXiv 2022",
    description="A 2-layer GCN on a 4-way randomly partitioned block-model graph: full-graph training, DIGEST's "
                "halo cache refreshed every k = 1, 4, 16, 64 steps, and dropping the cut edges.",
    scales=SCALES, specs=specs, run=run, summarize=summarize, claims=CLAIMS, plots=plots,
    columns=("key", "test_error_pct", "train_loss", "traffic", "traffic_vs_k1", "cache_error", "refreshes"),
    smoke=dict(steps=20, eval_every=5, seeds=1, periods=[1, 4]),
    limits=LIMITS,
)


def main(argv: list[str] | None = None) -> int:
  """Runs this reproduction with the CLI's options (``python -m experiments.NAME --help``)."""
  from .__main__ import run_one

  return run_one(REPRODUCTION.name, argv)


if __name__ == "__main__":
  raise SystemExit(main())
