"""The plot helpers draw what the schedule says (Agg backend, no display)."""

import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import delayjax as dj  # noqa: E402
from delayjax.cluster import _plot  # noqa: E402

C = dj.cluster


def containers(ax):
  return {c.get_label(): c.patches for c in ax.containers}


def bars_of(ax, label):
  return containers(ax).get(label, [])


@pytest.mark.parametrize("paradigm", [C.k_sync(2), C.ssp(1), C.backup_workers(1), C.k_batch_async(2)])
def test_timeline_draws_one_bar_per_computation(paradigm):
  sched = C.simulate(paradigm, C.workers(4, compute="gamma"), 40, seed=1)
  ax = C.plot_timeline(sched)
  x = sched.extras
  started = x["event_read_time"] < sched.total_time
  for label, code in (("applied", None), ("dropped", -1), ("in flight", -2)):
    sel = started & ((x["event_update"] >= 0) if code is None else (x["event_update"] == code))
    # Zero-length computations (cancelled at their start) draw nothing.
    sel &= np.minimum(x["event_end_time"], sched.total_time) > x["event_read_time"]
    assert len(bars_of(ax, label)) == sel.sum()
  applied = x["event_update"] >= 0
  widths = sorted(p.get_width() for p in bars_of(ax, "applied"))
  np.testing.assert_allclose(widths, np.sort(x["event_end_time"][applied] - x["event_read_time"][applied]))
  ys = sorted(round(p.get_y() + p.get_height() / 2) for p in bars_of(ax, "applied"))
  assert ys == sorted(x["event_worker"][applied].tolist())
  # The waits drawn add up to each worker's recorded wait.
  wait = np.zeros(sched.num_workers)
  for p in bars_of(ax, "wait"):
    wait[round(p.get_y() + p.get_height() / 2)] += p.get_width()
  np.testing.assert_allclose(wait, sched.wait, rtol=1e-9, atol=1e-9)
  plt.close("all")


def test_timeline_window_clips_intervals():
  sched = C.simulate(C.bsp(), C.workers(3, compute="constant"), 10)
  ax = C.plot_timeline(sched, start=2.5, stop=5.0)
  applied = bars_of(ax, "applied")
  # Rounds [2, 3), [3, 4), [4, 5) overlap the window for each of the 3 workers.
  assert len(applied) == 9
  assert min(p.get_x() for p in applied) == 2.5
  assert max(p.get_x() + p.get_width() for p in applied) == 5.0
  assert len(bars_of(ax, "wait")) == 0
  plt.close("all")


def test_staleness_plot_has_one_bar_per_staleness_value():
  sched = C.simulate(C.asp(), C.workers(5), 500, seed=0)
  fig, ax = plt.subplots()
  assert C.plot_staleness(sched, ax=ax) is ax
  bars = bars_of(ax, "staleness")
  hist = sched.staleness_histogram()
  assert len(bars) == hist.shape[0]
  np.testing.assert_array_equal([p.get_height() for p in bars], hist)
  dens = bars_of(C.plot_staleness(sched, density=True), "staleness")
  assert sum(p.get_height() for p in dens) == pytest.approx(1.0)
  plt.close("all")


def test_missing_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  sched = C.simulate(C.asp(), C.workers(2), 5)
  with pytest.raises(ImportError, match=r"pip install delayjax\[experiments\]"):
    C.plot_staleness(sched)
  with pytest.raises(ImportError, match=r"pip install delayjax\[experiments\]"):
    _plot.plot_timeline(sched)


def test_timeline_needs_events():
  plain = C.Schedule(time=[1.0], contributes=[[True]], read_version=[[0]], wait=[0.0])
  with pytest.raises(ValueError, match="no per-gradient events"):
    C.plot_timeline(plain)


def test_overlaid_staleness_histograms_have_distinct_colours_and_labels():
  w = C.workers(4, compute="exponential")
  scheds = [C.simulate(p, w, 200, seed=0) for p in (C.asp(), C.ssp(1), C.k_async(2))]
  fig, ax = plt.subplots()
  C.plot_staleness(scheds[0], ax=ax)   # alone first: labelled "staleness", then renamed by its paradigm
  C.plot_staleness(scheds[1], ax=ax, label="SSP(1)")
  C.plot_staleness(scheds[2], ax=ax)
  series = [c for c in ax.containers if c.patches]
  assert [c.get_label() for c in series] == [scheds[0].paradigm, "SSP(1)", scheds[2].paradigm]
  colours = {tuple(c.patches[0].get_facecolor()[:3]) for c in series}
  assert len(colours) == 3
  # Each mean line has its series' colour, and the legend names every series with its mean.
  for c, line in zip(series, ax.lines):
    assert matplotlib.colors.to_rgb(line.get_color()) == tuple(c.patches[0].get_facecolor()[:3])
  texts = [t.get_text() for t in ax.get_legend().get_texts()]
  assert texts == [f"{c.get_label()} (mean {s.mean_staleness():.3g})" for c, s in zip(series, scheds)]
  # The legend sits right of the axes: it covers no bar.
  fig.canvas.draw()
  assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
  plt.close("all")


def test_overlaid_timelines_have_distinct_colours_and_labels():
  w = C.workers(3, compute="exponential")
  ax = C.plot_timeline(C.simulate(C.bsp(), w, 10, seed=0))
  C.plot_timeline(C.simulate(C.k_sync(2), w, 10, seed=1), ax=ax, label="K-sync(2)")
  labels = {c.get_label(): c for c in ax.containers}
  assert {"applied", "K-sync(2): applied", "K-sync(2): dropped"} <= labels.keys()
  first = labels["applied"].patches[0].get_facecolor()
  second = labels["K-sync(2): applied"].patches[0].get_facecolor()
  assert first != second
  assert "K-sync(2): applied" in [t.get_text() for t in ax.get_legend().get_texts()]
  plt.close("all")
