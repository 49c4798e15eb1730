"""Topologies of decentralized training: who may talk to whom, with what mixing weights, how fast it mixes.

A :class:`Topology` is a graph over ``M`` nodes (replicas) held as a boolean
adjacency matrix (``adjacency[i, j]``: node ``i`` sends to node ``j``; symmetric
for undirected graphs; no self-loops). Build one with ``ring``, ``torus``,
``complete``, ``hypercube``, ``exponential``, ``random_regular`` or
``from_adjacency``; every builder checks that the graph is (strongly)
connected.

``mixing_matrix`` turns a topology into gossip weights ``W`` (one gossip step
is ``x_i <- sum_j W[i, j] x_j``):

- ``"metropolis"`` (Metropolis-Hastings, undirected graphs):
  ``W[i, j] = 1 / (1 + max(deg_i, deg_j))`` on edges, the rest of each row on
  the diagonal. Symmetric and doubly stochastic on any undirected graph.
- ``"uniform"``: every node splits its mass equally between itself and its
  out-neighbours, ``W[j, i] = 1 / (1 + outdeg_i)`` for ``j`` in ``N_out(i) + {i}``:
  column stochastic (the push-sum convention); on a regular undirected graph
  it is symmetric and doubly stochastic, ``1 / (1 + d)`` on edges and the diagonal.

``spectral_gap(W)`` is ``1 - |lambda_2(W)|``, one minus the second largest
eigenvalue modulus: the larger, the faster gossip averages (the consensus
distance contracts by about ``(1 - gap)^2`` per step for symmetric ``W``).

Example::

  >>> import delayjax as dj
  >>> ring = dj.topology.ring(8)
  >>> w = dj.topology.mixing_matrix(ring)
  >>> w[0, :3].round(3).tolist()
  [0.333, 0.333, 0.0]
  >>> round(dj.topology.spectral_gap(w), 4), round(dj.topology.complete(8).spectral_gap(), 4)
  (0.1953, 1.0)
  >>> dj.topology.one_peer_exponential(8, 4)[:, 0].tolist()
  [1, 7, 2, 6]

Time-varying one-peer sequences return, for each step, the peer of every node:

- ``one_peer_exponential(M, num_steps)``: SGP's directed one-peer exponential
  graph, node ``i`` sends to ``i + 1, i - 1, i + 2, i - 2, i + 4, ...`` (mod ``M``),
  one per step (``forward_only``: ``i + 1, i + 2, i + 4, ...``).
- ``gossipgrad_partners(M, num_steps)``: GossipGraD's rotating partner,
  ``(r + 2^(t mod p)) mod M`` in a node order reshuffled every
  ``p = ceil(log2 M)`` steps.
- ``bipartite_peers(M, num_steps)``: AD-PSGD's bipartite matching, odd
  (active) nodes pick an even (passive) peer from a rotating list.

References:
  Lian, Zhang, Zhang, Hsieh, Zhang, Liu, `Can Decentralized Algorithms
  Outperform Centralized Algorithms? A Case Study for Decentralized Parallel
  Stochastic Gradient Descent <https://arxiv.org/abs/1705.09056>`_, NeurIPS 2017.
  Xiao and Boyd, `Fast linear iterations for distributed averaging
  <https://doi.org/10.1016/j.sysconle.2004.02.022>`_, Systems & Control Letters 2004
  (Metropolis-Hastings weights).
  Assran, Loizou, Ballas, Rabbat, `Stochastic Gradient Push for Distributed
  Deep Learning <https://arxiv.org/abs/1811.10792>`_, ICML 2019 (one-peer
  exponential graph; code ``facebookresearch/stochastic_gradient_push``,
  ``gossip/graph_manager.py``).
  Daily, Vishnu, Siegel, Warfel, Amatya, `GossipGraD: Scalable Deep Learning
  using Gossip Communication based Asynchronous Gradient Descent
  <https://arxiv.org/abs/1803.05880>`_, 2018 (code ``pytorch/torchdistx``,
  ``src/python/torchdistx/gossip_grad.py``).
  Lian, Zhang, Zhang, Liu, `Asynchronous Decentralized Parallel Stochastic
  Gradient Descent <https://arxiv.org/abs/1710.06952>`_, ICML 2018 (code
  ``facebookresearch/stochastic_gradient_push``, ``gossip/ad_psgd.py``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np

from delayjax._checks import check_bool, check_choice, check_int, check_number_array, check_seed

__all__ = [
    "Topology", "ring", "torus", "complete", "hypercube", "exponential", "random_regular", "from_adjacency",
    "mixing_matrix", "check_mixing", "spectral_gap", "one_peer_exponential", "gossipgrad_partners",
    "bipartite_peers",
]

MIXING_RULES = ("metropolis", "uniform")


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
  """A (strongly) connected graph over ``M`` nodes.

  Attributes:
    adjacency: bool ``[M, M]``, ``adjacency[i, j]``: node ``i`` sends to node ``j``;
      no self-loops; symmetric unless ``directed``.
    name: a short description, e.g. ``"ring(8)"``.
  """

  adjacency: np.ndarray
  name: str = ""

  def __post_init__(self):
    a = np.array(self.adjacency, dtype=bool)
    a.setflags(write=False)
    object.__setattr__(self, "adjacency", a)

  @property
  def num_nodes(self) -> int:
    return int(self.adjacency.shape[0])

  @property
  def directed(self) -> bool:
    return not np.array_equal(self.adjacency, self.adjacency.T)

  @property
  def degree(self) -> np.ndarray:
    """int64 ``[M]``: each node's out-degree (its degree for undirected graphs)."""
    return self.adjacency.sum(axis=1).astype(np.int64)

  def neighbors(self, node: int) -> np.ndarray:
    """int64: the nodes ``node`` sends to, ascending."""
    node = check_int("node", node, minimum=0)
    if node >= self.num_nodes:
      raise ValueError(f"node must be in 0..{self.num_nodes - 1}, got {node}.")
    return np.flatnonzero(self.adjacency[node]).astype(np.int64)

  def edges(self) -> np.ndarray:
    """int64 ``[num_edges, 2]``: the ``(i, j)`` pairs with ``i < j`` (undirected) or every arc (directed)."""
    a = self.adjacency if self.directed else np.triu(self.adjacency)
    return np.argwhere(a).astype(np.int64)

  def mixing_matrix(self, rule: str = "metropolis") -> np.ndarray:
    """``mixing_matrix(self, rule)``."""
    return mixing_matrix(self, rule)

  def spectral_gap(self, rule: str = "metropolis") -> float:
    """The spectral gap of this topology's mixing matrix under ``rule``."""
    return spectral_gap(mixing_matrix(self, rule))

  def __repr__(self) -> str:
    return f"Topology({self.name or 'graph'}, num_nodes={self.num_nodes}, edges={len(self.edges())})"


def _strongly_connected(a: np.ndarray) -> bool:
  """Whether every node reaches every other following arcs (breadth-first from node 0, forwards and backwards)."""
  num = a.shape[0]
  for graph in (a, a.T):
    seen = np.zeros(num, bool)
    seen[0] = True
    frontier = seen.copy()
    while frontier.any():
      frontier = graph[frontier].any(axis=0) & ~seen
      seen |= frontier
    if not seen.all():
      return False
  return True


def from_adjacency(adjacency: Any, name: str = "") -> Topology:
  """A topology from a boolean (or 0/1) adjacency matrix ``[M, M]``; ``adjacency[i, j]``: ``i`` sends to ``j``.

  Raises:
    ValueError: if the matrix is not square, has self-loops or entries other
      than 0/1, or the graph is not (strongly) connected.
  """
  a = np.asarray(adjacency)
  if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
    raise ValueError(f"adjacency must be a square [M, M] matrix with M >= 1, got shape {a.shape}.")
  if a.dtype != bool:
    if a.dtype.kind not in "iuf" or not np.all((a == 0) | (a == 1)):
      raise ValueError("adjacency must hold booleans or 0/1 entries.")
    a = a.astype(bool)
  if np.any(np.diag(a)):
    raise ValueError(f"adjacency must have no self-loops; node(s) {np.flatnonzero(np.diag(a)).tolist()} "
                     "link to themselves.")
  if not _strongly_connected(a):
    kind = "strongly connected" if not np.array_equal(a, a.T) else "connected"
    raise ValueError(f"the graph must be {kind}: gossip over a disconnected graph never reaches consensus.")
  return Topology(a, name or f"graph({a.shape[0]})")


def _from_offsets(num: int, offsets: list[int], name: str, symmetric: bool = True) -> Topology:
  a = np.zeros((num, num), bool)
  i = np.arange(num)
  for k in offsets:
    a[i, (i + k) % num] = True
    if symmetric:
      a[(i + k) % num, i] = True
  np.fill_diagonal(a, False)
  return from_adjacency(a, name)


def ring(num_nodes: int) -> Topology:
  """The undirected ring (cycle): node ``i`` talks to ``i - 1`` and ``i + 1`` (mod ``M``); ``M >= 2``."""
  num = check_int("num_nodes", num_nodes, minimum=2)
  return _from_offsets(num, [1], f"ring({num})")


def torus(rows: int, cols: int) -> Topology:
  """The 2-D torus (wrap-around grid) of ``rows x cols`` nodes; node ``r * cols + c``; each side ``>= 2``."""
  rows = check_int("rows", rows, minimum=2)
  cols = check_int("cols", cols, minimum=2)
  num = rows * cols
  a = np.zeros((num, num), bool)
  r, c = np.divmod(np.arange(num), cols)
  for dr, dc in ((1, 0), (0, 1)):
    j = ((r + dr) % rows) * cols + (c + dc) % cols
    a[np.arange(num), j] = True
    a[j, np.arange(num)] = True
  np.fill_diagonal(a, False)
  return from_adjacency(a, f"torus({rows}, {cols})")


def complete(num_nodes: int) -> Topology:
  """Every pair of nodes is linked; ``M >= 2``."""
  num = check_int("num_nodes", num_nodes, minimum=2)
  return from_adjacency(~np.eye(num, dtype=bool), f"complete({num})")


def hypercube(num_nodes: int) -> Topology:
  """The ``log2 M``-dimensional hypercube: nodes differing in one bit are linked; ``M`` a power of 2, ``>= 2``."""
  num = check_int("num_nodes", num_nodes, minimum=2)
  if num & (num - 1):
    raise ValueError(f"num_nodes must be a power of 2 for a hypercube, got {num}.")
  i = np.arange(num)
  a = np.zeros((num, num), bool)
  for bit in range(num.bit_length() - 1):
    a[i, i ^ (1 << bit)] = True
  return from_adjacency(a, f"hypercube({num})")


def _exponential_offsets(num: int) -> list[int]:
  return [1 << k for k in range(max(1, (num - 1).bit_length())) if (1 << k) < num]


def exponential(num_nodes: int, directed: bool = False) -> Topology:
  """The exponential graph: node ``i`` sends to ``(i + 2^k) mod M`` for every ``2^k < M``; ``M >= 2``.

  With ``directed=False`` links go both ways (``i +- 2^k``). The directed
  version is SGP's static exponential graph (Assran et al. 2019).
  """
  num = check_int("num_nodes", num_nodes, minimum=2)
  directed = check_bool("directed", directed)
  kind = "directed " if directed else ""
  return _from_offsets(num, _exponential_offsets(num), f"{kind}exponential({num})", symmetric=not directed)


def random_regular(num_nodes: int, degree: int, seed: int = 0, max_tries: int = 1000) -> Topology:
  """A uniformly drawn connected ``degree``-regular undirected graph (pairing model with rejection).

  Args:
    num_nodes: ``M >= 2``.
    degree: ``1 <= d < M`` with ``M * d`` even (else no such graph exists).
    seed: the same seed gives the same graph.
    max_tries: pairings drawn before giving up.
  """
  num = check_int("num_nodes", num_nodes, minimum=2)
  d = check_int("degree", degree, minimum=1)
  check_seed("seed", seed)
  if d >= num:
    raise ValueError(f"degree must be < num_nodes ({num}), got {d}.")
  if (num * d) % 2:
    raise ValueError(f"num_nodes * degree must be even for a regular graph, got {num} * {d}.")
  if d == 1 and num > 2:
    raise ValueError(f"a 1-regular graph on {num} > 2 nodes is a matching, never connected; use degree >= 2.")
  rng = np.random.default_rng(seed)
  stubs = np.repeat(np.arange(num), d)
  for _ in range(max_tries):
    pairs = rng.permutation(stubs).reshape(-1, 2)
    i, j = pairs[:, 0], pairs[:, 1]
    if np.any(i == j):
      continue
    a = np.zeros((num, num), np.int64)
    np.add.at(a, (i, j), 1)
    np.add.at(a, (j, i), 1)
    if a.max() > 1 or not _strongly_connected(a.astype(bool)):
      continue
    return Topology(a.astype(bool), f"random_regular({num}, {d}, seed={seed})")
  raise ValueError(f"no connected simple {d}-regular graph on {num} nodes found in {max_tries} draws.")


def mixing_matrix(topology: Topology, rule: str = "metropolis") -> np.ndarray:
  """The gossip weights ``W`` float64 ``[M, M]`` of ``topology``: one step is ``x_i <- sum_j W[i, j] x_j``.

  Args:
    topology: a :class:`Topology`.
    rule: ``"metropolis"`` (Metropolis-Hastings, undirected only, doubly
      stochastic) or ``"uniform"`` (equal split, column stochastic; doubly
      stochastic on regular undirected graphs). See the module docstring.

  Returns:
    ``W``; ``W @ 1 = 1`` (rows) for ``"metropolis"``, ``1^T W = 1^T`` (columns) always.
  """
  if not isinstance(topology, Topology):
    raise TypeError(f"topology must be a Topology (dj.topology.ring(8), ...), got {topology!r}.")
  check_choice("rule", rule, MIXING_RULES)
  a = topology.adjacency.astype(np.float64)
  deg = a.sum(axis=1)
  if rule == "metropolis":
    if topology.directed:
      raise ValueError(f"rule 'metropolis' needs an undirected topology, got the directed {topology.name}; "
                       "use rule='uniform' (column stochastic, for push-sum).")
    w = a / (1.0 + np.maximum(deg[:, None], deg[None, :]))
  else:
    # Column i holds node i's mass split between itself and its out-neighbours.
    w = a.T / (1.0 + deg[None, :])
  np.fill_diagonal(w, 0.0)
  if rule == "metropolis":
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
  else:
    np.fill_diagonal(w, 1.0 / (1.0 + deg))
  return w


def _weights_array(name: str, weights: Any, alternative: str) -> np.ndarray:
  """``weights`` as a float64 array, or a TypeError naming ``name`` when it does not hold numbers."""
  return check_number_array(f"{name} must be a mixing matrix (a square array of numbers){alternative}", weights,
                            kinds="iuf")


def check_mixing(weights: Any, *, doubly: bool = True, name: str = "weights", atol: float = 1e-12) -> np.ndarray:
  """Returns ``weights`` as float64 ``[M, M]`` if it is a valid gossip matrix, else raises naming ``name``.

  Valid: square, finite, non-negative, rows summing to 1 (row stochastic);
  with ``doubly`` columns summing to 1 too.
  """
  doubly = check_bool("doubly", doubly)
  w = _weights_array(name, weights, "")
  if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
    raise ValueError(f"{name} must be a square [M, M] matrix, got shape {w.shape}.")
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"{name} must be finite and non-negative.")
  rows = w.sum(axis=1)
  if not np.allclose(rows, 1.0, rtol=0.0, atol=atol):
    raise ValueError(f"{name} must be row stochastic (rows sum to 1); row sums are {rows.round(6).tolist()}.")
  if doubly:
    cols = w.sum(axis=0)
    if not np.allclose(cols, 1.0, rtol=0.0, atol=atol):
      raise ValueError(f"{name} must be doubly stochastic (columns sum to 1 too); column sums are "
                       f"{cols.round(6).tolist()}.")
  return w


def spectral_gap(weights: Any) -> float:
  """``1 - |lambda_2(W)|``: one minus the second largest eigenvalue modulus of a stochastic ``W``.

  ``W`` must be row or column stochastic (it then has eigenvalue 1). For
  ``M = 1`` the gap is 1. A :class:`Topology` gives the gap of its Metropolis
  weights (``topology.spectral_gap()``).
  """
  if isinstance(weights, Topology):
    return weights.spectral_gap()
  w = _weights_array("weights", weights, " or a Topology")
  if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1 or not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be a finite non-negative square matrix, got shape {w.shape}.")
  if not (np.allclose(w.sum(axis=1), 1.0, atol=1e-12) or np.allclose(w.sum(axis=0), 1.0, atol=1e-12)):
    raise ValueError("weights must be row or column stochastic to have a spectral gap.")
  if w.shape[0] == 1:
    return 1.0
  if np.array_equal(w, w.T):
    eig = np.abs(np.linalg.eigvalsh(w))
  else:
    eig = np.abs(np.linalg.eigvals(w))
  return float(1.0 - np.sort(eig)[-2])


def _phone_book_offsets(num: int, distances: list[int]) -> list[int]:
  """Offsets ``+d, -d`` for each distance in order, duplicates (mod ``num``) removed, as SGP's phone book."""
  offsets: list[int] = []
  for d in distances:
    for o in (d % num, -d % num):
      if o and o not in offsets:
        offsets.append(o)
  return offsets


def _log2_floor(value: int) -> int:
  return max(value, 1).bit_length() - 1


def one_peer_exponential(num_nodes: int, num_steps: int, forward_only: bool = False) -> np.ndarray:
  """SGP's time-varying directed one-peer exponential graph: int64 ``[T, M]``, the peer node ``i`` sends to at ``t``.

  Every node cycles through the same list of offsets, one per step: node
  ``i`` sends to ``(i + offset[t mod len]) mod M``. Since all nodes use the
  same offset, every node also receives from exactly one node. With
  ``K = floor(log2(M - 1))``:

  - default: ``+1, -1, +2, -2, +4, -4, ..., +-2^K`` (duplicates mod ``M``
    removed), ``DynamicDirectedExponentialGraph`` in
    ``facebookresearch/stochastic_gradient_push`` ``gossip/graph_manager.py``,
    the graph of its SGP experiment scripts (``job_scripts/submit_SGP_*.sh``,
    ``--graph_type 0``);
  - ``forward_only=True``: ``+1, +2, +4, ..., +2^K``,
    ``NPeerDynamicDirectedExponentialGraph`` with one peer, the default of
    its ``gossip_sgd.py`` and of ``gossip/distributed.py``.

  Both walk the list from its first entry, as the reference's gossiper (it
  rotates to the next peer after each mix).
  """
  num = check_int("num_nodes", num_nodes, minimum=2)
  steps = check_int("num_steps", num_steps, minimum=0)
  forward_only = check_bool("forward_only", forward_only)
  distances = [1 << i for i in range(_log2_floor(num - 1) + 1)]
  offsets = np.asarray(distances if forward_only else _phone_book_offsets(num, distances), np.int64)
  shift = offsets[np.arange(steps) % offsets.shape[0]]
  return (np.arange(num)[None, :] + shift[:, None]) % num


def gossipgrad_partners(num_nodes: int, num_steps: int, seed: int | None = None) -> np.ndarray:
  """GossipGraD's rotating partners: int64 ``[T, M]``, the node each node sends its gradient to at step ``t``.

  With ``p = max(1, ceil(log2 M))``, the nodes are put in a fresh random order
  ``pi`` at every step ``t`` with ``t mod p = 0``; at step ``t`` the node at
  position ``r`` of ``pi`` sends to the node at position ``(r + 2^(t mod p)) mod M``
  and receives from the one at ``(r - 2^(t mod p)) mod M`` (the
  ``DISSEMINATION`` topology of ``pytorch/torchdistx``
  ``src/python/torchdistx/gossip_grad.py``). With ``seed=None`` the orders are
  the reference's: ``M`` successive in-place ``random.shuffle`` of
  ``[0, .., M - 1]`` by Python's ``random`` seeded with ``100 M``, cycled;
  with an integer ``seed``, fresh NumPy permutations.
  """
  num = check_int("num_nodes", num_nodes, minimum=2)
  steps = check_int("num_steps", num_steps, minimum=0)
  period = max(1, math.ceil(math.log2(num)))
  if seed is None:
    shuffler = random.Random(num * 100)
    order_list = list(range(num))
    orders = []
    for _ in range(num):
      shuffler.shuffle(order_list)
      orders.append(np.asarray(order_list, np.int64))
  else:
    rng = np.random.default_rng(check_seed("seed", seed))
  out = np.empty((steps, num), np.int64)
  order = np.arange(num)
  for t in range(steps):
    if t % period == 0:
      order = orders[(t // period) % num] if seed is None else rng.permutation(num)
    shift = 1 << (t % period)
    out[t, order] = order[(np.arange(num) + shift) % num]
  return out


def bipartite_peers(num_nodes: int, num_steps: int) -> np.ndarray:
  """AD-PSGD's bipartite peers: int64 ``[T, M]``, the peer of each active node at its ``t``-th averaging, ``-1`` for passive ones.

  Odd nodes are active, even nodes passive (a pair averaging always joins one
  of each, so two actives never wait on each other: no deadlock). Active node
  ``r`` cycles through the even nodes ``r + 1, r - 1, r + 3, r - 3, r + 5,
  r - 5, r + 9, r - 9, ..., r +- (1 + 2^K)`` (mod ``M``, ``K = floor(log2(M - 1))``,
  duplicates removed; all odd distances, so all peers are even), one per averaging, as
  ``facebookresearch/stochastic_gradient_push`` ``gossip/graph_manager.py``'s
  ``DynamicBipartiteExponentialGraph`` with one peer per node. ``M`` must be even.
  """
  num = check_int("num_nodes", num_nodes, minimum=2)
  steps = check_int("num_steps", num_steps, minimum=0)
  if num % 2:
    raise ValueError(f"num_nodes must be even for a bipartite (active/passive) matching, got {num}.")
  out = np.full((steps, num), -1, np.int64)
  for r in range(1, num, 2):
    peers = _bipartite_peer_list(num, r)
    out[:, r] = np.asarray(peers, np.int64)[np.arange(steps) % len(peers)]
  return out


def _bipartite_peer_list(num: int, rank: int) -> list[int]:
  distances = [1] + [1 + (1 << i) for i in range(1, _log2_floor(num - 1) + 1)]
  return [(rank + o) % num for o in _phone_book_offsets(num, distances)]
