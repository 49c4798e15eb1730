"""What the benchmarks share: timing variants side by side, and publishing their table."""

from __future__ import annotations

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


def publish(lines: list[str], path: str) -> None:
  """Prints the table and writes it to ``path``."""
  text = "\n".join(lines)
  print(text)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text + "\n")
