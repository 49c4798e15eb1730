"""Topologies: closed-form spectral gaps, mixing-matrix properties, one-peer sequences, and errors."""

import math

import numpy as np
import pytest

import delayjax as dj

T = dj.topology


@pytest.mark.parametrize("num", [6, 8, 16])
def test_ring_gap_is_the_closed_form(num):
  # Metropolis weights on a ring are 1/3 on edges and the diagonal: eigenvalues (1 + 2 cos(2 pi k / M)) / 3.
  w = T.mixing_matrix(T.ring(num))
  np.testing.assert_allclose(w[0, [0, 1, num - 1]], 1 / 3)
  assert T.spectral_gap(w) == pytest.approx(2 * (1 - math.cos(2 * math.pi / num)) / 3, abs=1e-12)
  np.testing.assert_allclose(T.mixing_matrix(T.ring(num), "uniform"), w)


@pytest.mark.parametrize("dim", [1, 2, 3, 4])
def test_hypercube_and_complete_gaps(dim):
  # Hypercube: W = (I + A) / (d + 1), A's eigenvalues d - 2k, so the gap is 2 / (d + 1).
  assert T.hypercube(2 ** dim).spectral_gap() == pytest.approx(2 / (dim + 1), abs=1e-12)
  w = T.mixing_matrix(T.complete(2 ** dim + 1))
  np.testing.assert_allclose(w, 1 / (2 ** dim + 1))
  assert T.spectral_gap(w) == pytest.approx(1.0, abs=1e-12)


def test_torus_gap_from_its_eigenvalues():
  rows, cols = 3, 5
  lam = [(1 + 2 * math.cos(2 * math.pi * a / rows) + 2 * math.cos(2 * math.pi * b / cols)) / 5
         for a in range(rows) for b in range(cols) if (a, b) != (0, 0)]
  assert T.torus(rows, cols).spectral_gap() == pytest.approx(1 - max(map(abs, lam)), abs=1e-12)
  assert np.all(T.torus(rows, cols).degree == 4)


def test_metropolis_on_an_irregular_graph():
  # A star: the centre has degree M - 1, leaves 1: every edge gets 1 / M, leaves keep 1 - 1/M.
  num = 5
  a = np.zeros((num, num), bool)
  a[0, 1:] = a[1:, 0] = True
  w = T.mixing_matrix(T.from_adjacency(a))
  np.testing.assert_allclose(w[0], [1 / num] * num)
  np.testing.assert_allclose(np.diag(w)[1:], 1 - 1 / num)
  T.check_mixing(w, doubly=True)
  u = T.mixing_matrix(T.from_adjacency(a), "uniform")   # column stochastic, not doubly
  np.testing.assert_allclose(u.sum(axis=0), 1.0)
  with pytest.raises(ValueError, match="doubly stochastic"):
    T.check_mixing(u.T, doubly=True)


def test_gap_grows_from_ring_to_exponential_to_complete():
  gaps = [t.spectral_gap() for t in (T.ring(16), T.torus(4, 4), T.exponential(16), T.complete(16))]
  assert gaps == sorted(gaps) and len(set(gaps)) == 4


def test_random_regular_is_regular_connected_and_seeded():
  g = T.random_regular(12, 3, seed=4)
  assert np.all(g.degree == 3) and not g.directed
  assert np.array_equal(g.adjacency, T.random_regular(12, 3, seed=4).adjacency)
  assert T.spectral_gap(g.mixing_matrix()) > 0


def test_exponential_graph_links():
  g = T.exponential(8, directed=True)
  np.testing.assert_array_equal(g.neighbors(0), [1, 2, 4])
  np.testing.assert_array_equal(T.exponential(8).neighbors(0), [1, 2, 4, 6, 7])
  with pytest.raises(ValueError, match="undirected"):
    T.mixing_matrix(g)
  np.testing.assert_allclose(T.mixing_matrix(g, "uniform").sum(axis=0), 1.0)


def _sgp_phone_book(num, rank, distances):
  # The reference's construction, literally: forward then backward peer per distance, no duplicates.
  book = []
  for d in distances:
    for p in ((rank + d) % num, (rank - d) % num):
      if p not in book:
        book.append(p)
  return book


@pytest.mark.parametrize("num", [2, 5, 8, 16])
def test_one_peer_exponential_is_a_permutation_cycling_the_phone_book(num):
  seq = T.one_peer_exponential(num, 20)
  book = _sgp_phone_book(num, 0, [2 ** i for i in range(int(math.log2(num - 1)) + 1 if num > 2 else 1)])
  np.testing.assert_array_equal(seq[:, 0], [book[t % len(book)] for t in range(20)])
  for row in seq:
    assert sorted(row) == list(range(num)) and np.all(row != np.arange(num))
  # forward_only: the reference's N-peer graph with one peer, distances j * 2^i for j = 1.
  forward = T.one_peer_exponential(num, 20, forward_only=True)
  distances = [2 ** i for i in range(int(math.log(num - 1, 2)) + 1 if num > 2 else 1)]
  np.testing.assert_array_equal((forward[:, -1] + 1) % num, [distances[t % len(distances)] for t in range(20)])


def test_bipartite_peers_pair_active_odd_with_passive_even():
  num = 16
  seq = T.bipartite_peers(num, 10)
  distances = [1] + [1 + 2 ** i for i in range(1, int(math.log2(num - 1)) + 1)]
  np.testing.assert_array_equal(seq[:8, 1], _sgp_phone_book(num, 1, distances))
  assert np.all(seq[:, 0::2] == -1) and np.all(seq[:, 1::2] % 2 == 0)
  with pytest.raises(ValueError, match="even"):
    T.bipartite_peers(7, 3)


def _torchdistx_dissemination(num, steps):
  # The reference's construction: num cumulative shuffles of [0..N-1] seeded with 100 N, cycled, one per period.
  import random
  rnd = random.Random(num * 100)
  lst, orders = list(range(num)), []
  for _ in range(num):
    rnd.shuffle(lst)
    orders.append(lst.copy())
  period = max(1, math.ceil(math.log(num, 2)))
  out = []
  for t in range(steps):
    topo = orders[(t // period) % num]
    out.append([topo[(topo.index(r) + 2 ** (t % period)) % num] for r in range(num)])
  return np.array(out)


@pytest.mark.parametrize("num", [2, 5, 8])
def test_gossipgrad_partners_follow_the_reference(num):
  steps = 3 * num + 2
  np.testing.assert_array_equal(T.gossipgrad_partners(num, steps), _torchdistx_dissemination(num, steps))


def test_gossipgrad_partners_with_a_seed_rotate_and_reshuffle():
  num, steps, period = 8, 9, 3
  seq = T.gossipgrad_partners(num, steps, seed=1)
  for t, row in enumerate(seq):
    assert sorted(row) == list(range(num))
    # Within a period the order is fixed: rebuild it from the period's first step (distance 1: one cycle).
    start = seq[t - t % period]
    order, cur = np.empty(num, np.int64), 0
    for i in range(num):
      order[i] = cur
      cur = start[cur]
    pos = np.argsort(order)
    np.testing.assert_array_equal((pos[row] - pos) % num, 2 ** (t % period))
  np.testing.assert_array_equal(T.gossipgrad_partners(num, steps, seed=1), seq)
  assert not np.array_equal(seq[3:6], T.gossipgrad_partners(num, steps, seed=2)[3:6])


def test_errors_name_the_problem():
  a = np.zeros((4, 4), bool)
  a[0, 1] = a[1, 0] = a[2, 3] = a[3, 2] = True
  with pytest.raises(ValueError, match="connected"):
    T.from_adjacency(a)
  with pytest.raises(ValueError, match="self-loops"):
    T.from_adjacency(np.eye(3))
  with pytest.raises(ValueError, match="power of 2"):
    T.hypercube(6)
  with pytest.raises(ValueError, match="even"):
    T.random_regular(5, 3)
  with pytest.raises(ValueError, match="degree must be < num_nodes"):
    T.random_regular(4, 4)
  with pytest.raises(ValueError, match="num_nodes"):
    T.ring(1)
  with pytest.raises(ValueError, match="rule"):
    T.mixing_matrix(T.ring(4), "max")
  with pytest.raises(ValueError, match="row stochastic"):
    T.check_mixing(np.full((3, 3), 0.5))
  with pytest.raises(ValueError, match="stochastic"):
    T.spectral_gap(np.full((3, 3), 0.5))
