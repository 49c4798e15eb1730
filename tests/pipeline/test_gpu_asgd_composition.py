"""GPU A-SGD (Paine et al. 2013) as a composition: asynchronous workers that are each a synchronous pipeline.

A worker of an ASP cluster is a GPipe pipeline of ``K`` stages; its time per
minibatch is the pipeline's makespan for one minibatch of ``m`` micro-batches,
given to ``dj.cluster.workers`` as a constant (equal stage times) or as a
replay table (random stage times, one pipeline run per worker). These tests
pin each link of the recipe in ``docs/howto/pipelines.md``:

- the makespan against the hand count ``(m + K - 1)(t_f + t_b) + 2 (K - 1) c``;
- the cluster's update times, workers and read versions against an event
  simulation of ASP written here in NumPy, with those compute times;
- ``dj.simulate`` on that schedule against a NumPy ASP loop on least squares
  (float64, 1e-10), the gradient exact inside a worker (GPipe reads one
  version for every pass of a minibatch).
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

C = dj.cluster
# The runtime comparison is to 1e-10, not bit for bit: XLA's quick compile settings are fine.
LR, BATCH, N_EXAMPLES, DIM = 0.05, 4, 32, 3


def _minibatch_times(num_stages: int, num_microbatches: int, num_minibatches: int, *, forward, backward, comm=0.0,
                     seed: int = 0) -> np.ndarray:
  """float64 ``[num_minibatches]``: seconds of each minibatch of one GPipe worker (the recipe's helper)."""
  p = C.pipeline("gpipe", num_stages, num_minibatches, num_microbatches=num_microbatches, forward=forward,
                 backward=backward, comm=comm, seed=seed)
  # The flush: minibatch u + 1 enters once stage 0 has applied update u, the last stage to finish minibatch u.
  return np.diff(p.update_time[:, 0], prepend=0.0)


_NO_COMM = [(1, 1, 1.0, 2.0, 0.0), (2, 4, 1.0, 2.0, 0.0), (4, 3, 0.5, 1.25, 0.0), (4, 8, 1.0, 2.0, 0.0)]


# DAPPLE's one-forward-one-backward steady state waits a round trip of communication per micro-batch, so the
# count with c > 0 is GPipe's only; without communication the two schedules take the same time.
@pytest.mark.parametrize("schedule,K,m,f,b,c", [("gpipe", *case) for case in _NO_COMM + [(4, 8, 1.0, 2.0, 0.25),
                                                                                       (3, 1, 2.0, 3.0, 0.5)]]
                         + [("dapple", *case) for case in _NO_COMM])
def test_worker_time_is_the_pipeline_makespan(schedule, K, m, f, b, c):
  # Hand count, equal stage times: stage K - 1 ends its m forwards at m f + (K - 1)(f + c) (fill), runs its m
  # backwards, and stage 0 ends the last backward (K - 1)(b + c) later (drain).
  hand = (m + K - 1) * (f + b) + 2 * (K - 1) * c
  p = C.pipeline(schedule, K, 3, num_microbatches=m, forward=f, backward=b, comm=c)
  np.testing.assert_allclose(np.diff(p.update_time[:, 0], prepend=0.0), hand, rtol=1e-12)
  np.testing.assert_allclose(_minibatch_times(K, m, 3, forward=f, backward=b, comm=c), hand, rtol=1e-12)
  # Inside a worker the gradient is exact: every pass of minibatch u uses version u of its stage.
  assert not p.forward_staleness.any() and not p.backward_staleness.any()
  # The constant handed to the cluster is taken as it is.
  np.testing.assert_allclose(C.workers(2, compute=hand).mean_time(), hand)


def _numpy_asp(durations: list[np.ndarray], num_updates: int):
  """ASP by hand: each push is one update at once, the pusher reads the new version; ties in worker order.

  ``durations[m][j % len]`` is the seconds of worker ``m``'s ``j``-th gradient. Returns float64 ``[U]`` times,
  int64 ``[U]`` pushing workers and int64 ``[U]`` read versions.
  """
  heap = [(float(d[0]), m) for m, d in enumerate(durations)]
  heapq.heapify(heap)
  read = [0] * len(durations)
  count = [1] * len(durations)
  times, who, versions = [], [], []
  for u in range(num_updates):
    t, m = heapq.heappop(heap)
    times.append(t)
    who.append(m)
    versions.append(read[m])
    read[m] = u + 1
    d = durations[m]
    heapq.heappush(heap, (t + float(d[count[m] % len(d)]), m))
    count[m] += 1
  return np.array(times), np.array(who), np.array(versions)


def _assert_schedule_is(sched, times, who, versions):
  np.testing.assert_allclose(sched.time, times, rtol=1e-12, atol=0)
  expected = np.zeros_like(sched.contributes)
  expected[np.arange(len(who)), who] = True
  np.testing.assert_array_equal(sched.contributes, expected)
  np.testing.assert_array_equal(sched.read_version[np.arange(len(who)), who], versions)


CLUSTERS = {
    # M equal pipelines of K = 4 stages and m = 4 micro-batches: the simultaneous pushes, in worker order.
    "equal": dict(stages=[4, 4, 4], micro=[4, 4, 4]),
    # Heterogeneous workers (pipelines of 2, 3 and 4 stages, m = 2, 4, 6): their minibatch times differ.
    "mixed": dict(stages=[2, 3, 4, 4], micro=[2, 4, 6, 3]),
}


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_asp_of_pipelined_workers_matches_a_numpy_event_simulation(name):
  case = CLUSTERS[name]
  per_worker = [(m + K - 1) * (1.0 + 2.0) for K, m in zip(case["stages"], case["micro"])]  # f = 1, b = 2
  made = [float(_minibatch_times(K, m, 1, forward=1.0, backward=2.0)[0]) for K, m in zip(case["stages"],
                                                                                         case["micro"])]
  assert made == per_worker
  sched = C.simulate(C.asp(), C.workers(len(made), compute=made), 40, seed=0)
  times, who, versions = _numpy_asp([np.array([d]) for d in made], 40)
  _assert_schedule_is(sched, times, who, versions)
  if name == "equal":  # M equal workers: staleness M - 1 after the first round
    np.testing.assert_array_equal((np.arange(40) - versions)[3:], 2)
  else:
    assert len(set((np.arange(40) - versions).tolist())) > 2


def test_asp_of_pipelines_with_random_stage_times_replays_each_workers_own_pipeline():
  # Random stage times: one pipeline run per worker, its minibatch times replayed by the cluster.
  table = np.stack([_minibatch_times(3, 4, 12, forward="exponential", backward=C.gamma(4, 2.0), comm=0.1, seed=w)
                    for w in range(3)])
  assert len(np.unique(np.round(table, 9))) == table.size  # every minibatch time differs
  sched = C.simulate(C.asp(), C.workers(3, compute=table), 30, seed=0)
  times, who, versions = _numpy_asp(list(table), 30)
  _assert_schedule_is(sched, times, who, versions)
  # Each gradient of a worker took that worker's pipeline's minibatch time.
  ev = sched.extras
  for w in range(3):
    mine = ev["event_worker"] == w
    took = (ev["event_end_time"] - ev["event_read_time"])[mine]
    np.testing.assert_allclose(took, table[w, np.arange(mine.sum()) % 12], rtol=1e-9)


def _data():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((N_EXAMPLES, DIM))
  return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal(N_EXAMPLES)}


def _loss(w, batch):
  return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _numpy_training(durations: list[np.ndarray], num_updates: int, seed: int) -> np.ndarray:
  """ASP SGD on least squares in float64, from the event simulation above; float64 ``[U + 1, DIM]`` iterates.

  Update ``u`` applies ``w_{u+1} = w_u - lr g(w_{v_u})``, the minibatch gradient at the version the worker read;
  the minibatch is the sampling contract's (``dj.runtime.minibatch_indices`` of the update, worker and draw).
  """
  data = _data()
  x, y = data["x"], data["y"]
  _, who, versions = _numpy_asp(durations, num_updates)
  drawn = np.zeros(len(durations), np.int64)
  path = [np.zeros(DIM)]
  for u in range(num_updates):
    m, w_read = int(who[u]), path[int(versions[u])]
    idx = np.asarray(dj.runtime.minibatch_indices(seed, u, m, int(drawn[m]), num_examples=N_EXAMPLES,
                                                  batch_size=BATCH))
    drawn[m] += 1
    g = x[idx].T @ (x[idx] @ w_read - y[idx]) / BATCH
    path.append(path[-1] - LR * g)
  return np.stack(path)


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", list(CLUSTERS))
def test_training_on_pipelined_asp_workers_matches_the_numpy_loop(name):
  case = CLUSTERS[name]
  made = [float(_minibatch_times(K, m, 1, forward=1.0, backward=2.0)[0]) for K, m in zip(case["stages"],
                                                                                         case["micro"])]
  U, seed = 24, 1
  sched = C.simulate(C.asp(), C.workers(len(made), compute=made), U, seed=0)
  assert sched.staleness.max() > 0
  with jax.enable_x64(True):
    data = {k: jnp.asarray(v) for k, v in _data().items()}
    result = dj.simulate(_loss, optax.sgd(LR), jnp.zeros(DIM, jnp.float64), data, sched, seed=seed,
                         sampling=dj.Sampling(batch_size=BATCH), record=dj.Record(eval_fn=lambda w: w, every=1),
                         execution=dj.Execution(lanes=4))
    path = np.asarray(result.history.eval_metrics, np.float64)
  ref = _numpy_training([np.array([d]) for d in made], U, seed)
  np.testing.assert_allclose(path, ref, rtol=0, atol=1e-10)
  np.testing.assert_allclose(np.asarray(result.params), ref[-1], rtol=0, atol=1e-10)
  np.testing.assert_array_equal(result.history.time, sched.time)
