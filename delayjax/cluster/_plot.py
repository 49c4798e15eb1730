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


_TIMELINE = "delayjax-timeline"
_STALENESS = "delayjax-staleness"


def _gid(container: Any) -> str:
  """The ``gid`` a plot helper gave the bars of a container (``""`` for others)."""
  return str(container.patches[0].get_gid()) if container.patches else ""


def _series_on(ax: Any, gid: str) -> list[Any]:
  """The bar containers of earlier series of one kind drawn on ``ax`` (marked by their bars' ``gid``)."""
  return [c for c in ax.containers if _gid(c).startswith(gid)]


def _legend_outside(ax: Any) -> None:
  """A legend to the right of the axes, where it covers no bar."""
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")


def plot_timeline(schedule: Schedule, ax: Any = None, start: float = 0.0, stop: float | None = None,
                  show_wait: bool = True, label: str | None = None) -> Any:
  """Draws each worker's computations and waits over simulated time (a Gantt chart).

  One horizontal bar per computation in ``[start, stop]``, coloured by what
  became of the gradient (applied, dropped, in flight), and one grey bar per
  wait; dotted vertical lines mark updates when at most 200 are shown. For
  long schedules pass a window ``start, stop`` (seconds). The legend sits to
  the right of the axes, so it covers no bar.

  Drawing a second schedule on the same ``ax`` overlays it in its own colour
  (the next of Matplotlib's cycle: applied bars plain, dropped ones hatched,
  in-flight ones faded) on thinner bars, with legend entries prefixed by
  its label; the update lines and the waits of overlays are not drawn.

  Args:
    schedule: a schedule from ``dj.cluster.simulate``.
    ax: a matplotlib ``Axes`` to draw on (default: a new figure).
    start: first simulated second shown.
    stop: last simulated second shown (default: the last update).
    show_wait: whether to draw the waits.
    label: the schedule's name in the legend of an overlay (default: its
      paradigm).

  Returns:
    The ``Axes``. The bar containers of the first schedule are labelled
    ``"applied"``, ``"dropped"``, ``"in flight"`` and ``"wait"`` (a kind with
    nothing to draw has none); those of an overlay ``"<label>: applied"``, ....
  """
  ax = _axes(ax)
  intervals = timeline_intervals(schedule, start, stop)
  index = len({_gid(c) for c in _series_on(ax, _TIMELINE)})
  if index == 0:
    styles = {
        "applied": dict(color="tab:blue"),
        "dropped": dict(color="tab:red"),
        "in_flight": dict(color="tab:orange"),
        "wait": dict(color="lightgrey", hatch="//"),
    }
    prefix, height = "", 0.8
  else:
    color = f"C{index}"
    styles = {"applied": dict(color=color), "dropped": dict(color=color, hatch="xx", alpha=0.7),
              "in_flight": dict(color=color, alpha=0.4)}
    prefix, height = f"{label or schedule.paradigm}: ", max(0.8 - 0.2 * index, 0.2)
  names = {"applied": "applied", "dropped": "dropped", "in_flight": "in flight", "wait": "wait"}
  for kind, style in styles.items():
    w, b, e = intervals[kind]
    if (kind == "wait" and not show_wait) or w.shape[0] == 0:
      continue
    # White edges keep back-to-back computations of one worker apart.
    ax.barh(w, e - b, left=b, height=height, edgecolor="white", linewidth=0.5, label=prefix + names[kind],
            gid=f"{_TIMELINE}:{index}", **style)
  if index == 0:
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
  else:
    ax.set_title(f"{ax.get_title()} vs {label or schedule.paradigm}")
  _legend_outside(ax)
  return ax


def plot_staleness(schedule: Schedule, ax: Any = None, density: bool = False, label: str | None = None) -> Any:
  """Draws the histogram of the staleness of applied gradients, one bar per staleness value.

  Drawing several schedules on one ``ax`` overlays their histograms, each in
  its own colour (Matplotlib's cycle, half transparent) with its mean as a
  dashed line of the same colour; the legend, to the right of the axes,
  names each by its ``label`` (default: its paradigm) and gives its mean.

  Args:
    schedule: any schedule.
    ax: a matplotlib ``Axes`` (default: a new figure).
    density: plot fractions instead of counts.
    label: the series' name (default: ``"staleness"`` when it is alone on
      the axes, its paradigm in an overlay; a first series drawn alone is
      renamed by its paradigm when a second one arrives).

  Returns:
    The ``Axes``; each series is one bar container of ``max staleness + 1``
    bars, labelled with its name, and one dashed line at its mean.
  """
  ax = _axes(ax)
  earlier = _series_on(ax, _STALENESS)
  index = len(earlier)
  name = label or schedule.paradigm or f"schedule {index}"
  if index == 1 and earlier[0].get_label() == "staleness":
    # A second series arrives: the first, drawn alone as "staleness", is now named by its paradigm.
    earlier[0].set_label(_gid(earlier[0])[len(_STALENESS) + 1:])
  hist = schedule.staleness_histogram().astype(np.float64)
  if density:
    hist /= hist.sum()
  color = f"C{index}"
  gid = f"{_STALENESS}:{name}"
  ax.bar(np.arange(hist.shape[0]), hist, width=0.9, color=color, alpha=1.0 if index == 0 else 0.5,
         label=label or ("staleness" if index == 0 else name), gid=gid)
  mean = schedule.mean_staleness()
  ax.axvline(mean, color=color, linestyle="--", label=f"mean {mean:.3g}", gid=gid)
  ax.set_xlabel("staleness (updates)")
  ax.set_ylabel("fraction of gradients" if density else "gradients")
  if index == 0:
    ax.set_title(schedule.paradigm)
    _legend_outside(ax)
    return ax
  ax.set_title("staleness of the applied gradients")
  series = _series_on(ax, _STALENESS)
  means = {line.get_gid(): line.get_xdata()[0] for line in ax.lines}
  for container in series:
    for patch in container.patches:   # a first series was drawn opaque, alone
      patch.set_alpha(0.5)
  ax.legend(series, [f"{c.get_label()} (mean {means[_gid(c)]:.3g})" for c in series], loc="upper left",
            bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")
  return ax
