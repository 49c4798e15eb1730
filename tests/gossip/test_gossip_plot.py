"""The gossip timeline draws what the schedule says (Agg backend, no display)."""

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import delayjax as dj  # noqa: E402

C = dj.cluster


def bars(ax, label):
  return next((c.patches for c in ax.containers if c.get_label() == label), [])


def collection(ax, label):
  return next((c for c in ax.collections if c.get_label() == label), None)


def line(ax, label):
  return next((l for l in ax.get_lines() if l.get_label() == label), None)


@pytest.mark.parametrize("paradigm", [C.ad_psgd(), C.sgp(1), C.gossipgrad()], ids=str)
def test_timeline_draws_every_computation_wait_and_mix(paradigm):
  w = C.workers(4, compute="gamma", comm=C.uniform(0.1, 0.6), speed=[1, 1, 1, 0.5])
  s = C.simulate_gossip(paradigm, w, 12, seed=2)
  ax = C.plot_gossip_timeline(s)
  # Compute bars: one per gradient started; their widths per replica add up to busy, the waits to wait.
  busy, wait = np.zeros(4), np.zeros(4)
  for p in bars(ax, "compute"):
    busy[round(p.get_y() + p.get_height() / 2)] += p.get_width()
  for p in bars(ax, "wait"):
    wait[round(p.get_y() + p.get_height() / 2)] += p.get_width()
  np.testing.assert_allclose(busy, s.busy, atol=1e-9)
  np.testing.assert_allclose(wait, s.wait, atol=1e-9)
  assert len(bars(ax, "compute")) == np.count_nonzero(s.kind == C.READ)
  params, grads = collection(ax, "mix params"), collection(ax, "mix gradients")
  drawn = (0 if params is None else len(params.get_segments())) + (0 if grads is None else len(grads.get_segments()))
  assert drawn == s.num_mixes
  assert (grads is not None) == bool(np.any(s.mixes == C.GRADS))
  np.testing.assert_allclose(np.sort(line(ax, "apply").get_xdata()), np.sort(s.time[s.kind == C.GRAD]))
  one_way = line(ax, "one-way")
  assert (0 if one_way is None else len(one_way.get_xdata())) == int(np.sum((s.members >= 0) & ~s.receives))
  assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"compute", "apply"}
  plt.close("all")


def test_window_and_lag_histogram():
  s = C.simulate_gossip(C.sgp(2), C.workers(6, comm=C.exponential(1.0)), 20, seed=0)
  ax = C.plot_gossip_timeline(s, start=5.0, stop=10.0)
  for p in bars(ax, "compute"):
    assert p.get_x() >= 5.0 - 1e-12 and p.get_x() + p.get_width() <= 10.0 + 1e-12
  shown = (s.time >= 5.0) & (s.time <= 10.0) & (s.kind == C.MIX)
  assert len(collection(ax, "mix params").get_segments()) == shown.sum()
  ax = C.plot_gossip_lags(s)
  np.testing.assert_array_equal([p.get_height() for p in bars(ax, "messages")], s.lag_histogram())
  plt.close("all")
