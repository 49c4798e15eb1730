"""Plots every reproduction draws the same way: curves against updates and simulated time, staleness histograms."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np


def pyplot() -> Any:
  """matplotlib's pyplot on the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def mean_curve(records: Sequence[dict[str, Any]], x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
  """The seeds' ``y`` curves averaged on the first seed's ``x`` grid (linear interpolation)."""
  grid = np.asarray(records[0]["curves"][x], np.float64)
  ys = []
  for r in records:
    xs = np.asarray(r["curves"][x], np.float64)
    values = np.asarray([np.nan if v is None else v for v in r["curves"][y]], np.float64)
    ys.append(np.interp(grid, xs, values) if xs.shape != grid.shape or np.any(xs != grid) else values)
  return grid, np.nanmean(np.stack(ys), axis=0) if ys else np.zeros_like(grid)


def group(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """Records by spec key, in first-seen order."""
  out: dict[str, list[dict[str, Any]]] = {}
  for r in records:
    out.setdefault(r["key"], []).append(r)
  return out


def curves(records: Sequence[dict[str, Any]], out: str, name: str, *, y: str = "test_error",
           ylabel: str = "test error", panels: Callable[[dict[str, Any]], str] | None = None,
           label: Callable[[dict[str, Any]], str] | None = None, log_y: bool = False,
           xs: Sequence[str] = ("update", "time")) -> str:
  """Writes ``name.png``: one row of panels per x axis (updates, simulated time), one column per panel group.

  Args:
    records: run records with ``curves``.
    panels: spec -> panel title (e.g. ``"M = 8"``) or titles (a baseline drawn in
      several panels); one panel for all if None.
    label: spec -> line label; the spec key if None.
  """
  plt = pyplot()
  by_key = group(records)
  def panel_titles(spec: dict[str, Any]) -> list[str]:
    t = panels(spec) if panels else ""
    return [t] if isinstance(t, str) else list(t)

  titles: list[str] = []
  for recs in by_key.values():
    titles += [t for t in panel_titles(recs[0]["spec"]) if t not in titles]
  fig, axes = plt.subplots(len(xs), len(titles), figsize=(4.2 * len(titles), 3.2 * len(xs)), squeeze=False)
  for key, recs in by_key.items():
    spec = recs[0]["spec"]
    for title in panel_titles(spec):
      for row, x in enumerate(xs):
        gx, gy = mean_curve(recs, x, y)
        axes[row, titles.index(title)].plot(gx, gy, label=label(spec) if label else key)
  for col, title in enumerate(titles):
    for row, x in enumerate(xs):
      ax = axes[row, col]
      ax.set_title(title, fontsize=10)
      ax.set_xlabel({"update": "updates", "time": "simulated time (s)"}.get(x, x))
      ax.set_ylabel(ylabel)
      if log_y:
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
    axes[0, col].legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, f"{name}.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def staleness_histograms(records: Sequence[dict[str, Any]], out: str, name: str = "staleness",
                         label: Callable[[dict[str, Any]], str] | None = None) -> str:
  """Writes ``name.png``: the fraction of gradients applied at each staleness, one line per spec (first seed)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for key, recs in group(records).items():
    hist = np.asarray(recs[0].get("staleness_hist") or [1], np.float64)
    if hist.sum() <= 0:
      continue
    ax.step(np.arange(hist.shape[0]), hist / hist.sum(), where="mid",
            label=label(recs[0]["spec"]) if label else key)
  ax.set_xlabel("staleness tau (updates)")
  ax.set_ylabel("fraction of gradients")
  ax.set_title("Staleness histogram")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, f"{name}.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def bars(rows: Sequence[dict[str, Any]], out: str, name: str, *, x: str, y: str, series: str,
         ylabel: str, xlabel: str) -> str:
  """Writes ``name.png``: grouped bars of ``y`` (with its ``y_std`` error bar) by ``x`` (groups) and ``series`` (bars)."""
  plt = pyplot()
  xs = list(dict.fromkeys(r[x] for r in rows))
  ss = list(dict.fromkeys(r[series] for r in rows))
  width = 0.8 / max(len(ss), 1)
  fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(xs) * max(1, len(ss) / 3), 3.8))
  for i, s in enumerate(ss):
    pos, val, err = [], [], []
    for j, xv in enumerate(xs):
      match = [r for r in rows if r[x] == xv and r[series] == s]
      if match:
        pos.append(j + (i - (len(ss) - 1) / 2) * width)
        val.append(match[0][y])
        err.append(match[0].get(f"{y}_std") or 0.0)
    ax.bar(pos, val, width, yerr=err, capsize=2, label=str(s))
  ax.set_xticks(range(len(xs)), [str(v) for v in xs])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=7, ncol=2)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  path = os.path.join(out, f"{name}.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
