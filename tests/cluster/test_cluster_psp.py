"""PSP's schedule agrees event for event with the slow reference in ``psp_reference.py``.

The reference takes its samples from a callable; here it is the stream that
:class:`~delayjax.cluster.PSP` documents (the push's sample is the
``sample_size`` workers with the smallest of ``M`` uniform keys drawn from the
seed's barrier stream), so the two simulators see the same random samples and
must agree exactly: every update's time, contributions and read versions, every
gradient's read and push, and every worker's waiting time.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import delayjax as dj
import cluster_reference as ref
import psp_reference
from test_cluster_reference import _assert_same

C = dj.cluster


def _sampler(seed: int):
  """PSP's documented sample stream for ``simulate(..., seed=seed)`` on workers without a seed of their own."""
  rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])
  return lambda num, beta: [int(w) for w in np.argsort(rng.random(num))[:beta]]


def _times(kind: str, seed: int, num_workers: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if kind == "ties":
    # Small integers: many pushes at the same second, to pin down the tie rule.
    return rng.integers(1, 4, size=(num_workers, 5)).astype(np.float64)
  if kind == "heterogeneous":
    speed = rng.uniform(0.3, 1.0, size=(num_workers, 1))
    return rng.exponential(1.0, size=(num_workers, 11)) / speed
  # One worker 6x slower than the others, which are nearly equal: the case PSP is for.
  times = rng.uniform(0.9, 1.1, size=(num_workers, 7))
  times[-1] *= 6.0
  return times


def _run(times: np.ndarray, beta: int, s: int, seed: int, num_updates: int):
  num = times.shape[0]
  sched = C.simulate(C.psp(beta, s), C.workers(num, compute=C.replay(times)), num_updates, seed=seed)
  return sched, psp_reference.psp(times, num_updates, beta, s, _sampler(seed))


@pytest.mark.parametrize("kind", ["ties", "heterogeneous", "one_straggler"])
@pytest.mark.parametrize("beta,s", [(1, 0), (2, 0), (2, 1), (3, 2), (5, 0), (5, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(kind, beta, s, seed):
  times = _times(kind, seed, 5)
  sched, result = _run(times, beta, s, seed, 80)
  _assert_same(sched, result)


@pytest.mark.parametrize("kind", ["ties", "heterogeneous", "one_straggler"])
@pytest.mark.parametrize("s", [0, 2])
def test_sampling_everyone_is_ssp(kind, s):
  # beta = M: the sample is the whole cluster, so PSP is the unsampled barrier, SSP (pBSP at s = 0).
  times = _times(kind, 7, 4)
  sched, result = _run(times, 4, s, 7, 80)
  _assert_same(sched, result)
  _assert_same(sched, ref.ssp(times, 80, s))


def test_reference_cases_exercise_the_rule():
  # The comparisons above only mean something if the cases hit the interesting branches.
  times = _times("one_straggler", 1, 5)
  small, _ = _run(times, 2, 1, 1, 400)
  full, _ = _run(times, 5, 1, 1, 400)
  assert small.wait.sum() > 0                        # a sample holding a laggard blocks
  assert small.wait.sum() < full.wait.sum()          # ... less often than the whole cluster does
  # SSP keeps every clock within s + 1 of the slowest (a worker starts only within s of it, then pushes); PSP
  # breaks that bound when its sample leaves the laggard out.
  gap = lambda sched: np.ptp(np.cumsum(sched.contributes, axis=0), axis=1).max()  # noqa: E731
  assert gap(full) <= 1 + 1 < gap(small)


@st.composite
def small_clusters(draw):
  num_workers = draw(st.integers(1, 6))
  width = draw(st.integers(1, 6))
  values = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]) if draw(st.booleans()) else st.floats(0.01, 5.0)
  times = np.array(draw(st.lists(values, min_size=num_workers * width, max_size=num_workers * width)))
  return times.reshape(num_workers, width)


@settings(max_examples=100, deadline=None)
@given(times=small_clusters(), num_updates=st.integers(1, 40), data=st.data())
def test_matches_reference_on_random_clusters(times, num_updates, data):
  beta = data.draw(st.integers(1, times.shape[0]))
  s = data.draw(st.integers(0, 3))
  seed = data.draw(st.integers(0, 2**32 - 1))
  sched, result = _run(times, beta, s, seed, num_updates)
  _assert_same(sched, result)


@pytest.mark.parametrize("make, message", [
    (lambda: C.psp(0, 1), r"^sample_size must be an integer >= 1, got 0\.$"),
    (lambda: C.psp(-2, 1), r"^sample_size must be an integer >= 1, got -2\.$"),
    (lambda: C.psp(2, -1), r"^staleness must be an integer >= 0, got -1\.$"),
    (lambda: C.simulate(C.psp(4, 1), C.workers(3), 10), r"^sample_size must be <= the number of workers \(3\), "
                                                        r"got 4\.$"),
])
def test_bad_input_names_the_argument_the_value_and_what_is_allowed(make, message):
  with pytest.raises(ValueError, match=message):
    make()
