"""Pictures of a schedule: a per-worker timeline (Gantt chart) and the staleness histogram."""

from __future__ import annotations

from typing import Any

import numpy as np

from delayjax.cluster._schedule import Schedule

__all__ = ["plot_timeline", "plot_staleness"]


def _pyplot() -> Any:
  try:
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError(
        "plotting a schedule needs matplotlib; install it with `pip install delayjax[experiments]`.") from e
  return plt


def _axes(ax: Any) -> Any:
  return _pyplot().subplots()[1] if ax is None else ax


def timeline_intervals(schedule: Schedule, start: float = 0.0, stop: float | None = None
                       ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """The intervals ``plot_timeline`` draws: ``{kind: (worker, begin, end)}``, clipped to ``[start, stop]``.

  Kinds: ``"applied"`` (compute of a gradient that became part of an
  update), ``"dropped"`` (cancelled or discarded), ``"in_flight"`` (unfinished
  at the end), and ``"wait"`` (blocked: the gaps between a worker's
  computations, up to the last update).
  """
  if "event_worker" not in schedule.extras:
    raise ValueError("schedule has no per-gradient events (extras['event_*']); "
                     "plot_timeline needs a schedule from dj.cluster.simulate.")
  stop = schedule.total_time if stop is None else float(stop)
  ew = schedule.extras["event_worker"]
  rt = schedule.extras["event_read_time"]
  et = np.minimum(schedule.extras["event_end_time"], schedule.total_time)
  eu = schedule.extras["event_update"]
  out = {}
  for kind, mask in (("applied", eu >= 0), ("dropped", eu == -1), ("in_flight", eu == -2)):
    out[kind] = _clip(ew[mask], rt[mask], et[mask], start, stop)
  # Wait: from the end of one computation (or time 0) to the next read (or the last update).
  order = np.lexsort((rt, ew))
  w, r, e = ew[order], rt[order], et[order]
  first = np.r_[True, w[1:] != w[:-1]]
  prev_end = np.where(first, 0.0, np.r_[0.0, e[:-1]])
  last = np.r_[w[1:] != w[:-1], True]
  gaps_w = np.concatenate([w, w[last]])
  gaps_b = np.concatenate([prev_end, e[last]])
  gaps_e = np.concatenate([r, np.full(last.sum(), schedule.total_time)])
  idle = np.setdiff1d(np.arange(schedule.num_workers), ew)
  gaps_w = np.concatenate([gaps_w, idle])
  gaps_b = np.concatenate([gaps_b, np.zeros(idle.shape)])
  gaps_e = np.concatenate([gaps_e, np.full(idle.shape, schedule.total_time)])
  keep = gaps_e > gaps_b
  out["wait"] = _clip(gaps_w[keep], gaps_b[keep], gaps_e[keep], start, stop)
  return out


def _clip(w: np.ndarray, b: np.ndarray, e: np.ndarray, start: float, stop: float
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  b, e = np.maximum(b, start), np.minimum(e, stop)
  keep = e > b
  return w[keep], b[keep], e[keep]


def plot_timeline(schedule: Schedule, ax: Any = None, start: float = 0.0, stop: float | None = None,
                  show_wait: bool = True) -> Any:
  """Draws each worker's computations and waits over simulated time (a Gantt chart).

  One horizontal bar per computation in ``[start, stop]``, coloured by what
  became of the gradient (applied, dropped, in flight), and one grey bar per
  wait; dotted vertical lines mark updates when at most 200 are shown. For
  long schedules pass a window ``start, stop`` (seconds).

  Args:
    schedule: a schedule from ``dj.cluster.simulate``.
    ax: a matplotlib ``Axes`` to draw on (default: a new figure).
    start: first simulated second shown.
    stop: last simulated second shown (default: the last update).
    show_wait: whether to draw the waits.

  Returns:
    The ``Axes``. Its bar containers are labelled ``"applied"``,
    ``"dropped"``, ``"in flight"`` and ``"wait"`` (a kind with nothing to
    draw has none).
  """
  ax = _axes(ax)
  intervals = timeline_intervals(schedule, start, stop)
  styles = {
      "applied": dict(color="tab:blue", label="applied"),
      "dropped": dict(color="tab:red", label="dropped"),
      "in_flight": dict(color="tab:orange", label="in flight"),
      "wait": dict(color="lightgrey", label="wait", hatch="//"),
  }
  for kind, style in styles.items():
    w, b, e = intervals[kind]
    if (kind == "wait" and not show_wait) or w.shape[0] == 0:
      continue
    # White edges keep back-to-back computations of one worker apart.
    ax.barh(w, e - b, left=b, height=0.8, edgecolor="white", linewidth=0.5, **style)
  stop = schedule.total_time if stop is None else float(stop)
  shown = schedule.time[(schedule.time >= start) & (schedule.time <= stop)]
  if shown.shape[0] <= 200:
    for t in shown:
      ax.axvline(t, color="black", linewidth=0.5, linestyle=":")
  ax.set_xlabel("simulated seconds")
  ax.set_ylabel("worker")
  ax.set_yticks(range(schedule.num_workers))
  ax.invert_yaxis()
  ax.set_title(schedule.paradigm)
  ax.legend(loc="upper right", fontsize="small")
  return ax


def plot_staleness(schedule: Schedule, ax: Any = None, density: bool = False) -> Any:
  """Draws the histogram of the staleness of applied gradients, one bar per staleness value.

  Args:
    schedule: any schedule.
    ax: a matplotlib ``Axes`` (default: a new figure).
    density: plot fractions instead of counts.

  Returns:
    The ``Axes``; its single bar container holds ``max staleness + 1`` bars.
  """
  ax = _axes(ax)
  hist = schedule.staleness_histogram().astype(np.float64)
  if density:
    hist /= hist.sum()
  ax.bar(np.arange(hist.shape[0]), hist, width=0.9, color="tab:blue", label="staleness")
  ax.axvline(schedule.mean_staleness(), color="black", linestyle="--",
             label=f"mean {schedule.mean_staleness():.3g}")
  ax.set_xlabel("staleness (updates)")
  ax.set_ylabel("fraction of gradients" if density else "gradients")
  ax.set_title(schedule.paradigm)
  ax.legend(fontsize="small")
  return ax
