"""The classic pipeline picture: devices against time, forward, backward and weight-gradient blocks, update marks."""

from __future__ import annotations

from typing import Any

import numpy as np

from delayjax.cluster._pipeline import PipelineSchedule
from delayjax.cluster._plot import _axes

__all__ = ["plot_pipeline"]


def plot_pipeline(schedule: PipelineSchedule, ax: Any = None, start: float = 0.0, stop: float | None = None,
                  labels: bool | None = None) -> Any:
  """Draws each device's forward and backward passes over simulated time, and its updates.

  One horizontal bar per pass inside ``[start, stop]`` on the row of the
  device that runs it (forward passes blue, backward passes orange, the
  weight-gradient passes of a split backward (``"zb-h1"``) green), the
  micro-batch index written in each bar, with its model chunk after a dot
  when a device holds several (``"interleaved"``) (``labels``; by default when
  at most 120 bars are shown), and a black tick at each update. Idle gaps
  are the pipeline's bubbles.

  Args:
    schedule: a schedule from ``dj.cluster.pipeline``.
    ax: a matplotlib ``Axes`` (default: a new figure).
    start: first simulated second shown.
    stop: last simulated second shown (default: the end of the run).
    labels: write micro-batch indices in the bars.

  Returns:
    The ``Axes``; its bar containers are labelled ``"forward"``,
    ``"backward"``, ``"weight"`` (split backward passes only) and ``"update"``.
  """
  ax = _axes(ax)
  stop = schedule.total_time if stop is None else float(stop)
  K, S, v = schedule.num_stages, schedule.num_model_stages, schedule.virtual_stages
  micro = np.broadcast_to(np.arange(schedule.num_passes)[:, None], (schedule.num_passes, S))
  stage = np.broadcast_to(schedule.device_of[None, :], (schedule.num_passes, S))
  chunk = np.broadcast_to((np.arange(S) // K)[None, :], (schedule.num_passes, S))
  passes = [("forward", "tab:blue", schedule.forward_start, schedule.forward_end),
            ("backward", "tab:orange", schedule.backward_start, schedule.backward_end)]
  if np.any(schedule.weight_end > schedule.weight_start):
    passes.append(("weight", "tab:green", schedule.weight_start, schedule.weight_end))
  shown = []
  for label, color, b, e in passes:
    keep = (np.minimum(e, stop) > np.maximum(b, start))
    bb, ee = np.maximum(b[keep], start), np.minimum(e[keep], stop)
    ax.barh(stage[keep], ee - bb, left=bb, height=0.8, color=color, edgecolor="white", linewidth=0.5,
            label=label)
    names = [f"{n}.{c}" if v > 1 else str(n) for n, c in zip(micro[keep], chunk[keep])]
    shown.append((bb, ee, stage[keep], names))
  if labels is None:
    labels = sum(s[0].shape[0] for s in shown) <= 120
  if labels:
    for bb, ee, kk, nn in shown:
      for b0, e0, k0, n0 in zip(bb, ee, kk, nn):
        ax.text((b0 + e0) / 2, k0, n0, ha="center", va="center", fontsize="x-small", color="white")
  u_time = schedule.update_time
  keep = (u_time >= start) & (u_time <= stop)
  u_stage = np.broadcast_to(schedule.device_of[None, :], u_time.shape)[keep]
  width = max(1e-3 * (stop - start), 1e-12)
  ax.barh(u_stage, np.full(u_stage.shape, width), left=u_time[keep], height=0.95, color="black", label="update")
  ax.set_xlabel("simulated seconds")
  ax.set_ylabel("device" if v > 1 else "stage")
  ax.set_yticks(range(K))
  ax.invert_yaxis()
  name = schedule.schedule if schedule.schedule != "1f1b" else f"1F1B ({schedule.weights})"
  chunks = f", v={v}" if v > 1 else ""
  ax.set_title(f"{name}: K={K}{chunks}, m={schedule.num_microbatches}, bubble {schedule.bubble_fraction():.0%}")
  ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.06), ncol=len(passes) + 1, fontsize="small", frameon=False)
  return ax
