"""Plots every reproduction draws the same way: curves against updates and simulated time, staleness histograms.

Conventions, so that a reader can trust a figure: one colour per method
across all figures of a reproduction (:func:`palette`, passed as
``colors``); test errors in percent everywhere; every curve is the mean over
seeds with a band from the lowest to the highest seed, and the figure says
so; a bar's whiskers are the 95% interval of its mean, cut to the range its
quantity can take (no negative error rates); a diverged run is left out of
every mean, band and whisker, and the legend or the bar says how many
there were ("diverged on 1 of 5 seeds"); legends sit outside the axes, so
they never cover a curve.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
          "tab:olive", "tab:cyan", "navy", "darkgoldenrod", "teal", "crimson", "indigo", "black")


def pyplot() -> Any:
  """matplotlib's pyplot on the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def palette(names: Sequence[Any]) -> dict[str, str]:
  """One colour per name (by position in ``names``): build it once per reproduction and pass it to every plot."""
  return {str(n): COLORS[i % len(COLORS)] for i, n in enumerate(dict.fromkeys(names))}


def _num(value: Any) -> float:
  return float("nan") if value is None else float(value)


def _color(colors: Mapping[str, str] | None, label: str, seen: dict[str, str]) -> str:
  if colors and label in colors:
    return colors[label]
  if label not in seen:
    seen[label] = COLORS[(len(seen) + len(colors or {})) % len(COLORS)]
  return seen[label]


def seed_curves(records: Sequence[dict[str, Any]], x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
  """The seeds' ``y`` curves on the first seed's ``x`` grid (linear interpolation): ``(grid, [seeds, points])``."""
  grid = np.asarray(records[0]["curves"][x], np.float64)
  ys = []
  for r in records:
    xs = np.asarray(r["curves"][x], np.float64)
    values = np.asarray([np.nan if v is None else v for v in r["curves"][y]], np.float64)
    ys.append(np.interp(grid, xs, values) if xs.shape != grid.shape or np.any(xs != grid) else values)
  return grid, np.stack(ys) if ys else np.zeros((0,) + grid.shape)


def mean_curve(records: Sequence[dict[str, Any]], x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
  """The seeds' ``y`` curves averaged on the first seed's ``x`` grid (linear interpolation)."""
  grid, ys = seed_curves(records, x, y)
  return grid, np.nanmean(ys, axis=0) if ys.size else np.zeros_like(grid)


def group(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """Records by spec key, in first-seen order."""
  out: dict[str, list[dict[str, Any]]] = {}
  for r in records:
    out.setdefault(r["key"], []).append(r)
  return out


def aggregation(records: Sequence[dict[str, Any]], band: str = "band: lowest to highest seed") -> str:
  """What a curve of these records is: ``"mean of 5 seeds; band: lowest to highest seed"``."""
  counts = {len(recs) for recs in group(records).values()}
  n = max(counts) if counts else 0
  seeds = f"{n} seeds" if len(counts) <= 1 else f"{min(counts)}-{n} seeds"
  return f"mean of {seeds}; {band}" if n > 1 else "one seed"


def legend_outside(fig: Any, ax: Any, colors_used: Mapping[str, Any] | None = None) -> None:
  """One legend for the figure, to the right of the axes (it never covers a curve); only labels drawn."""
  handles, labels = [], []
  for a in fig.axes:
    for h, label in zip(*a.get_legend_handles_labels()):
      if label not in labels and not label.startswith("_"):
        handles.append(h)
        labels.append(label)
  if handles:
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def save(fig: Any, out: str, name: str) -> str:
  path = os.path.join(out, f"{name}.png")
  fig.savefig(path, dpi=110, bbox_inches="tight")
  pyplot().close(fig)
  return path


def diverged(record: Mapping[str, Any], y: str | None = None) -> bool:
  """Whether a run diverged: its record says so, or its curve ``y`` ends non-finite."""
  curve = record.get("curves", {}).get(y) if y else None
  return bool(record.get("diverged")) or bool(curve) and not np.isfinite(_num(curve[-1]))


def mean_interval(mean: float, std: float, n: int, bounds: tuple[float | None, float | None],
                  confidence: float = 0.95) -> tuple[float, float]:
  """The ``confidence`` t interval of a mean of ``n`` values whose population std is ``std`` (as
  ``mean_rows`` writes it), cut to ``bounds`` (``None``: unbounded on that side); ``(mean, mean)`` for
  fewer than two values or a non-finite ``std``."""
  if n < 2 or not np.isfinite(std) or not np.isfinite(mean):
    low = high = mean
  else:
    from ._framework import t_quantile

    half = t_quantile(confidence, n - 1) * std * np.sqrt(n / (n - 1)) / np.sqrt(n)
    low, high = mean - half, mean + half
  if bounds[0] is not None:
    low = max(low, bounds[0])
  if bounds[1] is not None:
    high = min(high, bounds[1])
  return float(low), float(high)


def curves(records: Sequence[dict[str, Any]], out: str, name: str, *, y: str = "test_error",
           ylabel: str | None = None, panels: Callable[[dict[str, Any]], Any] | None = None,
           label: Callable[[dict[str, Any]], str] | None = None, log_y: bool = False,
           xs: Sequence[str] = ("update", "time"), colors: Mapping[str, str] | None = None,
           percent: bool | None = None) -> str:
  """Writes ``name.png``: one row of panels per x axis (updates, simulated time), one column per panel group.

  Each line is the mean over seeds, its band the lowest to highest seed.

  Args:
    records: run records with ``curves``.
    y: the curve drawn; an error (``*_error``) is drawn in percent unless ``percent=False``.
    panels: spec -> panel title (e.g. ``"M = 8"``) or titles (a baseline drawn in
      several panels); one panel for all if None.
    label: spec -> line label; the spec key if None.
    colors: label -> colour (:func:`palette`), the same in every figure of a reproduction.
  """
  plt = pyplot()
  percent = y.endswith("_error") if percent is None else percent
  scale = 100.0 if percent else 1.0
  ylabel = ylabel or y.replace("_", " ")
  if percent and "%" not in ylabel:
    ylabel += " (%)"
  by_key = group(records)

  def panel_titles(spec: dict[str, Any]) -> list[str]:
    t = panels(spec) if panels else ""
    return [t] if isinstance(t, str) else list(t)

  titles: list[str] = []
  for recs in by_key.values():
    titles += [t for t in panel_titles(recs[0]["spec"]) if t not in titles]
  fig, axes = plt.subplots(len(xs), len(titles), figsize=(4.2 * len(titles), 3.1 * len(xs)), squeeze=False)
  seen: dict[str, str] = {}
  for key, recs in by_key.items():
    spec = recs[0]["spec"]
    text = label(spec) if label else key
    color = _color(colors, text, seen)
    # A diverged seed (its record says so, or its curve ends non-finite) drops out of the mean and the band,
    # its early finite points too: the legend says so.
    kept = [r for r in recs if not diverged(r, y)]
    if len(kept) < len(recs):
      text = f"{text} (diverged on {len(recs) - len(kept)} of {len(recs)} seeds, left out)"
    for title in panel_titles(spec):
      for row, x in enumerate(xs):
        ax = axes[row, titles.index(title)]
        if not kept:
          ax.plot([], [], color=color, label=text, linewidth=1.4)  # in the legend, with nothing to draw
          continue
        gx, gy = seed_curves(kept, x, y)
        ax.plot(gx, scale * np.nanmean(gy, axis=0), color=color, label=text, linewidth=1.4)
        if gy.shape[0] > 1:
          ax.fill_between(gx, scale * np.nanmin(gy, axis=0), scale * np.nanmax(gy, axis=0), color=color,
                          alpha=0.15, linewidth=0)
  for col, title in enumerate(titles):
    for row, x in enumerate(xs):
      ax = axes[row, col]
      ax.set_title(title, fontsize=10)
      ax.set_xlabel({"update": "updates", "time": "simulated time (s)"}.get(x, x))
      ax.set_ylabel(ylabel)
      if log_y and any(np.any(np.asarray(line.get_ydata(), np.float64) > 0) for line in ax.lines):
        ax.set_yscale("log")  # only where something is positive: an all-zero panel stays linear
      ax.grid(alpha=0.3)
  fig.suptitle(aggregation(records), fontsize=9)
  fig.tight_layout()
  legend_outside(fig, axes[0, -1])
  return save(fig, out, name)


def staleness_histograms(records: Sequence[dict[str, Any]], out: str, name: str = "staleness",
                         label: Callable[[dict[str, Any]], str] | None = None,
                         colors: Mapping[str, str] | None = None) -> str:
  """Writes ``name.png``: the fraction of gradients applied at each staleness, one line per spec (first seed)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.4))
  seen: dict[str, str] = {}
  for key, recs in group(records).items():
    hist = np.asarray(recs[0].get("staleness_hist") or [1], np.float64)
    if hist.sum() <= 0:
      continue
    text = label(recs[0]["spec"]) if label else key
    ax.step(np.arange(hist.shape[0]), hist / hist.sum(), where="mid", label=text, color=_color(colors, text, seen))
  ax.set_xlabel("staleness tau (updates)")
  ax.set_ylabel("fraction of gradients")
  ax.set_title("Staleness histogram (first seed of each run)", fontsize=10)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  legend_outside(fig, ax)
  return save(fig, out, name)


def bars(rows: Sequence[dict[str, Any]], out: str, name: str, *, x: str, y: str, series: str,
         ylabel: str, xlabel: str, colors: Mapping[str, str] | None = None, log_y: bool = False,
         bounds: tuple[float | None, float | None] = (0.0, None)) -> str:
  """Writes ``name.png``: grouped bars of ``y`` by ``x`` and ``series``: the mean over the seeds that did not
  diverge (``mean_rows``), whiskers its 95% interval cut to ``bounds`` (the values ``y`` can take; default
  non-negative), and above a bar with diverged seeds how many ("1/5 diverged")."""
  plt = pyplot()
  xs = list(dict.fromkeys(r[x] for r in rows))
  ss = list(dict.fromkeys(r[series] for r in rows))
  width = 0.8 / max(len(ss), 1)
  fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(xs) * max(1, len(ss) / 3), 3.6))
  seen: dict[str, str] = {}
  notes = []
  for i, s in enumerate(ss):
    pos, val, err = [], [], []
    for j, xv in enumerate(xs):
      match = [r for r in rows if r[x] == xv and r[series] == s]
      if match:
        r = match[0]
        mean, bad = _num(r[y]), int(r.get("diverged_seeds") or 0)
        low, high = mean_interval(mean, _num(r.get(f"{y}_std")), int(r.get("seeds", 1)) - bad, bounds)
        pos.append(j + (i - (len(ss) - 1) / 2) * width)
        val.append(mean if np.isfinite(mean) else 0.0)
        err.append((mean - low, high - mean) if np.isfinite(mean) else (0.0, 0.0))
        if bad:
          notes.append((pos[-1], high if np.isfinite(high) else 0.0, f"{bad}/{r.get('seeds', bad)} diverged"))
    ax.bar(pos, val, width, yerr=np.asarray(err, np.float64).T.reshape(2, -1), capsize=2, label=str(s),
           color=_color(colors, str(s), seen))
  for where, top, text in notes:
    ax.annotate(text, (where, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                fontsize=6, rotation=90)
  if notes and not log_y:
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + 0.25 * (high - low))  # room for the notes above the highest whisker
  ax.set_xticks(range(len(xs)), [str(v) for v in xs])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if log_y:
    ax.set_yscale("log")
  seeds = max((r.get("seeds", 1) for r in rows), default=1)
  title = f"mean of {seeds} seeds; whiskers: 95% interval of the mean" if seeds > 1 else "one seed"
  if notes:
    title += "; diverged seeds left out"
  ax.set_title(title, fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  legend_outside(fig, ax)
  return save(fig, out, name)
