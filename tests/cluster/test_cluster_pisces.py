"""Pisces' schedule agrees event for event with the slow server in ``pisces_reference.py``, and keeps its promises.

Both run on the same replayed durations and the same documented random
stream, so they must agree exactly: every update's time, contributions and
read versions, every training's read and push, and every client's idle time.
"""

import numpy as np
import pytest

import delayjax as dj
import pisces_reference
from test_cluster_reference import _assert_same

C = dj.cluster


def _stream(seed: int) -> np.random.Generator:
  """Pisces' documented selection stream for ``simulate(..., seed=seed)`` on workers without a seed."""
  return np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])


def _times(kind: str, seed: int, num: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if kind == "ties":
    return rng.integers(1, 4, size=(num, 5)).astype(np.float64)
  speed = rng.uniform(0.15, 1.0, size=(num, 1))   # heterogeneous clients, some 6x slower
  return rng.exponential(1.0, size=(num, 9)) / speed


SETTINGS = [
    dict(concurrency=3),
    dict(concurrency=4, beta=1.0, staleness_bound=2),
    dict(concurrency=2, explore=0.2, explore_decay=0.5, min_explore=0.0, window=2),
    dict(concurrency=5, utility=[3.0, 1.0, 2.0, 0.5, 1.0, 4.0, 1.0, 0.0]),
    dict(concurrency=4, selection="random"),
    dict(concurrency=4, aggregate_every=2),
    dict(concurrency=3, selection="random", aggregate_every=1),
]


def _reference_kwargs(s: dict) -> dict:
  names = {"staleness_bound": "bound", "explore_decay": "decay", "aggregate_every": "every"}
  return {names.get(k, k): v for k, v in s.items()}


@pytest.mark.parametrize("kind", ["ties", "heterogeneous"])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("seed", range(2))
def test_matches_reference(kind, setting, seed):
  s = SETTINGS[setting]
  times = _times(kind, seed, 8)
  sched = C.simulate(C.pisces(**s), C.workers(8, compute=C.replay(times)), 80, seed=seed)
  _assert_same(sched, pisces_reference.pisces(times, 80, _stream(seed), **_reference_kwargs(s)))


def test_reference_cases_exercise_the_rule():
  # The comparisons mean something only if the cases reach the rule's branches.
  times = _times("heterogeneous", 0, 8)
  sched = C.simulate(C.pisces(3), C.workers(8, compute=C.replay(times)), 200, seed=0)
  per_update = sched.contributes.sum(axis=1)
  assert per_update.max() >= 2 and per_update.min() == 1     # the pace applies buffers of varying size
  assert sched.staleness.max() >= 1
  counts = sched.contributes.sum(axis=0)
  assert counts.min() >= 1 and counts.max() > 3 * counts.min()   # exploitation prefers some clients
  events = sched.extras["event_update"]
  assert (events == -2).sum() >= 1


def test_concurrency_and_one_contribution_per_client_per_update():
  times = _times("heterogeneous", 1, 10)
  sched = C.simulate(C.pisces(4), C.workers(10, compute=C.replay(times)), 300, seed=1)
  x = sched.extras
  # At no instant do more than C clients train.
  starts, ends = x["event_read_time"], x["event_end_time"]
  for t in np.unique(starts):
    assert np.sum((starts <= t) & (ends > t)) <= 4
  np.testing.assert_allclose(sched.busy + sched.wait, sched.time[-1], rtol=1e-12)


def test_staleness_penalty_avoids_the_slow_clients():
  # Ten clients, five 8x slower, two slots: with the penalty the fast ones do most of the work; with beta = 0
  # and uniform utilities the score ties everywhere, so exploitation picks uniformly among the idle explored.
  workers = C.workers(10, compute="constant", speed=[1.0] * 5 + [0.125] * 5)
  penalised = C.simulate(C.pisces(2, beta=2.0, min_explore=0.0), workers, 400, seed=0)
  flat = C.simulate(C.pisces(2, beta=0.0, min_explore=0.0), workers, 400, seed=0)
  share = lambda s: s.contributes[:, 5:].sum() / s.contributes.sum()
  assert share(penalised) < 0.5 * share(flat)
  assert penalised.time[-1] < 0.5 * flat.time[-1]      # and the same updates take less time


def test_pace_bounds_staleness_with_known_latencies():
  # Constant latencies: after every client is measured, the slowest running client sees at most about b
  # aggregations while it trains (one interval is its latency / b), plus the one at its own push.
  workers = C.workers(6, compute="constant", speed=[1.0, 0.5, 0.25, 1.0, 0.5, 0.25])
  for b in (1, 2, 4):
    sched = C.simulate(C.pisces(3, staleness_bound=b), workers, 300, seed=0)
    assert sched.staleness[100:].max() <= b + 1


def test_fedbuff_buffer_size():
  sched = C.simulate(C.pisces(4, selection="random", aggregate_every=3), C.workers(8), 100, seed=0)
  np.testing.assert_array_equal(sched.contributes.sum(axis=1), 3)


def test_same_seed_same_schedule_and_str():
  w = C.workers(6, compute="exponential")
  a, b = (C.simulate(C.pisces(3, [1, 2, 3, 4, 5, 6]), w, 50, seed=3) for _ in range(2))
  np.testing.assert_array_equal(a.time, b.time)
  np.testing.assert_array_equal(a.read_version, b.read_version)
  assert a.paradigm.startswith("pisces(concurrency=3")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(concurrency=0), ValueError, "concurrency"),
    (dict(concurrency=2.5), TypeError, "concurrency"),
    (dict(concurrency=2, utility=[1, -1, 1, 1]), ValueError, r"utility\[1\]"),
    (dict(concurrency=2, utility="abc"), TypeError, "utility"),
    (dict(concurrency=2, beta=-0.1), ValueError, "beta"),
    (dict(concurrency=2, staleness_bound=0), ValueError, "staleness_bound"),
    (dict(concurrency=2, explore=1.5), ValueError, "explore"),
    (dict(concurrency=2, explore_decay=0.0), ValueError, "explore_decay"),
    (dict(concurrency=2, min_explore=-1), ValueError, "min_explore"),
    (dict(concurrency=2, window=0), ValueError, "window"),
    (dict(concurrency=2, selection="oort"), ValueError, "selection"),
    (dict(concurrency=2, aggregate_every=0), ValueError, "aggregate_every"),
])
def test_bad_inputs(kwargs, error, match):
  with pytest.raises(error, match=match):
    C.pisces(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(concurrency=5), "concurrency"),
    (dict(concurrency=2, utility=[1.0, 2.0]), "one value per worker"),
    (dict(concurrency=2, aggregate_every=3), "aggregate_every"),
])
def test_bad_inputs_against_the_cluster(kwargs, match):
  with pytest.raises(ValueError, match=match):
    C.simulate(C.pisces(**kwargs), C.workers(4), 10)
