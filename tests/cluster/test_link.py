"""dj.cluster.link: a push's communication time is latency + bytes / bandwidth, against closed forms."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def durations(sched):
  """Seconds of each applied gradient (read to push), per worker, in order."""
  x = sched.extras
  return {m: x["event_end_time"][(x["event_worker"] == m) & (x["event_update"] >= 0)]
          - x["event_read_time"][(x["event_worker"] == m) & (x["event_update"] >= 0)]
          for m in range(sched.num_workers)}


@pytest.mark.parametrize("bandwidth,nbytes,latency", [(100.0, 50.0, 0.25), (1e6, 38_440, 0.0), (2e3, 0, 0.1)])
def test_bsp_rounds_take_compute_plus_latency_plus_bytes_over_bandwidth(bandwidth, nbytes, latency):
  compute = 1.0
  w = C.workers(4, compute=compute, comm=C.link(bandwidth, nbytes, latency=latency))
  sched = C.simulate(C.bsp(), w, 5, seed=0)
  step = compute + latency + nbytes / bandwidth
  np.testing.assert_allclose(sched.time, step * np.arange(1, 6))
  assert w.mean_time() == pytest.approx(np.full(4, step))


def test_asp_worker_with_a_slower_link_pushes_at_its_own_period():
  # Worker m pushes every 1 + b / B_m seconds: its j-th push at j (1 + b / B_m).
  nbytes, bandwidths = 1000.0, [1e3, 4e3, math.inf]
  w = C.workers(3, compute=1.0, comm=[C.link(b, nbytes) for b in bandwidths])
  sched = C.simulate(C.asp(), w, 30, seed=0)
  for m, b in enumerate(bandwidths):
    period = 1.0 + (0.0 if math.isinf(b) else nbytes / b)
    np.testing.assert_allclose(durations(sched)[m], period)


def test_a_link_changes_no_compute_draw_and_adds_exactly_its_transfer():
  # The same seed with and without the link: every gradient takes b / B seconds longer, nothing else moves.
  base = C.workers(3, compute="gamma")
  linked = C.workers(3, compute="gamma", comm=C.link(500.0, 250.0))
  a = durations(C.simulate(C.asp(), base, 60, seed=1))
  b = durations(C.simulate(C.asp(), linked, 60, seed=1))
  for m in range(3):
    n = min(len(a[m]), len(b[m]))
    np.testing.assert_allclose(b[m][:n], a[m][:n] + 0.5, rtol=1e-12)


def test_random_latency_plus_transfer_has_the_stated_mean():
  net = C.link(1e3, 100.0, latency=C.exponential(0.2))
  x = net.sample(np.random.default_rng(0), 100_000)
  assert net.mean == pytest.approx(0.3)
  assert x.mean() == pytest.approx(0.3, rel=0.02)
  assert x.min() >= 0.1


def test_message_bytes_of_a_compressor_shorten_the_round():
  params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
  dense, sparse = dj.message_bytes(params), dj.message_bytes(params, dj.top_k(0.01))
  bandwidth = 1e4
  rounds = []
  for nbytes in (dense, sparse):
    sched = C.simulate(C.bsp(), C.workers(2, compute=1.0, comm=C.link(bandwidth, nbytes)), 3, seed=0)
    rounds.append(sched.time[0])
  assert rounds == pytest.approx([1.0 + dense / bandwidth, 1.0 + sparse / bandwidth])



@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bandwidth=0.0, message_bytes=1.0), ValueError, "bandwidth"),
    (dict(bandwidth=-5.0, message_bytes=1.0), ValueError, "bandwidth"),
    (dict(bandwidth="fast", message_bytes=1.0), TypeError, "bandwidth"),
    (dict(bandwidth=float("nan"), message_bytes=1.0), ValueError, "bandwidth"),
    (dict(bandwidth=1.0, message_bytes=-1.0), ValueError, "message_bytes"),
    (dict(bandwidth=1.0, message_bytes=1.0, latency=-0.1), ValueError, "latency"),
    (dict(bandwidth=1.0, message_bytes=1.0, latency=object()), TypeError, "latency"),
])
def test_bad_links_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    C.link(**kwargs)
