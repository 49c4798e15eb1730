"""What the benchmarks share: timing variants side by side, and publishing their table."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import jax
import numpy as np


def best_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
  """Seconds of the best of ``rounds`` interleaved rounds of every run (each compiled and run once first).

  Interleaving makes background load hit all variants alike.
  """
  for run in runs.values():
    jax.block_until_ready(run())
  best = {name: np.inf for name in runs}
  for _ in range(rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
  """``--out FILE``: where the table goes. By default it is only printed, so a benchmark run never rewrites the
  tables published in ``experiments/results/`` unless asked (``--out experiments/results/NAME.txt``)."""
  parser.add_argument("--out", default=None, metavar="FILE",
                      help=f"also write the table to FILE (the published one is experiments/results/{name}.txt)")


def publish(lines: list[str], path: str | None) -> None:
  """Prints the table and, if ``path`` is given, writes it there (with the user's umask)."""
  text = "\n".join(lines)
  print(text)
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      f.write(text + "\n")
