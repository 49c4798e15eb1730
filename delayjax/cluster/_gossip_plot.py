"""Pictures of a gossip schedule: a per-replica timeline with its mixes, and the message lag histogram."""

from __future__ import annotations

from typing import Any

import numpy as np

from delayjax.cluster._gossip import GRAD, GRADS, MIX, PARAMS, GossipSchedule
from delayjax.cluster._plot import _axes, _clip

__all__ = ["plot_gossip_timeline", "plot_gossip_lags", "gossip_intervals"]


def gossip_intervals(schedule: GossipSchedule, start: float = 0.0, stop: float | None = None
                     ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """The bars ``plot_gossip_timeline`` draws: ``{"compute" | "wait": (replica, begin, end)}``, clipped to ``[start, stop]``.

  ``compute``: the intervals each replica computed (``extras["busy_*"]``);
  ``wait``: the gaps between them up to the last event.
  """
  if "busy_worker" not in schedule.extras:
    raise ValueError("schedule has no compute intervals (extras['busy_*']); plot_gossip_timeline needs a "
                     "schedule from dj.cluster.simulate_gossip.")
  end = schedule.total_time
  stop = end if stop is None else float(stop)
  w = schedule.extras["busy_worker"]
  b = schedule.extras["busy_start"]
  e = np.minimum(schedule.extras["busy_stop"], end)
  out = {"compute": _clip(w, b, e, start, stop)}
  order = np.lexsort((b, w))
  w, b, e = w[order], b[order], e[order]
  first = np.r_[True, w[1:] != w[:-1]] if w.size else np.zeros(0, bool)
  last = np.r_[w[1:] != w[:-1], True] if w.size else np.zeros(0, bool)
  prev_end = np.where(first, 0.0, np.r_[0.0, e[:-1]])
  idle = np.setdiff1d(np.arange(schedule.num_workers), w)
  gw = np.concatenate([w, w[last], idle])
  gb = np.concatenate([prev_end, e[last], np.zeros(idle.shape)])
  ge = np.concatenate([b, np.full(int(last.sum()), end), np.full(idle.shape, end)])
  keep = ge > gb
  out["wait"] = _clip(gw[keep], gb[keep], ge[keep], start, stop)
  return out


def plot_gossip_timeline(schedule: GossipSchedule, ax: Any = None, start: float = 0.0, stop: float | None = None,
                         show_wait: bool = True) -> Any:
  """Draws each replica's computations and waits over simulated time, and every mix between them.

  One horizontal bar per computation (blue, ``"compute"``) and per wait
  (grey, ``"wait"``); a dot where a gradient is applied (``"apply"``); each
  mix in ``[start, stop]`` a vertical segment spanning its members, with a
  marker on each replica that receives: green for parameter mixes
  (``"mix params"``), purple for gradient mixes (``"mix gradients"``), red
  where a member does not receive (a one-way message: SGP's push, a lost
  reply; ``"one-way"``). For long schedules pass a window ``start, stop``.

  Args:
    schedule: a schedule from ``dj.cluster.simulate_gossip``.
    ax: a matplotlib ``Axes`` (default: a new figure).
    start: first simulated second shown.
    stop: last simulated second shown (default: the last event).
    show_wait: whether to draw the waits.

  Returns:
    The ``Axes``. Its bar containers are labelled ``"compute"`` and
    ``"wait"``; its line collections ``"mix params"``, ``"mix gradients"`` and
    ``"one-way"``; the apply markers ``"apply"`` (kinds with nothing to draw
    are left out).
  """
  ax = _axes(ax)
  stop = schedule.total_time if stop is None else float(stop)
  bars = gossip_intervals(schedule, start, stop)
  for kind, style in (("compute", dict(color="tab:blue")), ("wait", dict(color="lightgrey", hatch="//"))):
    w, b, e = bars[kind]
    if (kind == "wait" and not show_wait) or w.shape[0] == 0:
      continue
    ax.barh(w, e - b, left=b, height=0.6, edgecolor="white", linewidth=0.5, label=kind, **style)
  shown = (schedule.time >= start) & (schedule.time <= stop)
  grads = shown & (schedule.kind == GRAD)
  if grads.any():
    ax.plot(schedule.time[grads], schedule.worker[grads], linestyle="none", marker="o", markersize=3,
            color="black", label="apply")
  mixes = schedule.mix[shown & (schedule.kind == MIX)]
  times = schedule.time[shown & (schedule.kind == MIX)]
  for what, colour, label in ((PARAMS, "tab:green", "mix params"), (GRADS, "tab:purple", "mix gradients")):
    sel = schedule.mixes[mixes] == what
    if not sel.any():
      continue
    segments = []
    for k, t in zip(mixes[sel], times[sel]):
      members = schedule.members[k][schedule.members[k] >= 0]
      segments.append([(t, members.min() - 0.3), (t, members.max() + 0.3)] if members.size > 1
                      else [(t, members[0] - 0.3), (t, members[0] + 0.3)])
    ax.vlines([s[0][0] for s in segments], [s[0][1] for s in segments], [s[1][1] for s in segments],
              colors=colour, linewidth=1.0, label=label)
  one_way = schedule.members[mixes] >= 0
  one_way &= ~schedule.receives[mixes]
  if one_way.any():
    k, a = np.nonzero(one_way)
    ax.plot(times[k], schedule.members[mixes][k, a], linestyle="none", marker="x", color="tab:red",
            markersize=5, label="one-way")
  ax.set_xlabel("simulated seconds")
  ax.set_ylabel("replica")
  ax.set_yticks(range(schedule.num_workers))
  ax.set_ylim(schedule.num_workers - 0.5, -0.5)
  ax.set_xlim(start, stop)
  ax.set_title(schedule.paradigm)
  ax.legend(loc="upper right", fontsize="small")
  return ax


def plot_gossip_lags(schedule: GossipSchedule, ax: Any = None) -> Any:
  """Draws the histogram of message lags (local versions by which a mixed-in value was old).

  Returns:
    The ``Axes``; its single bar container (``"messages"``) holds ``max lag + 1`` bars.
  """
  ax = _axes(ax)
  hist = schedule.lag_histogram()
  ax.bar(np.arange(hist.shape[0]), hist, width=0.9, color="tab:green", label="messages")
  ax.set_xlabel("message lag (sender's versions)")
  ax.set_ylabel("messages")
  ax.set_title(schedule.paradigm)
  ax.legend(fontsize="small")
  return ax
