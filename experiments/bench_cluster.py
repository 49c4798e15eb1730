"""Speed of the cluster simulator: wall-clock seconds to simulate a schedule, per paradigm.

64 workers with exponential compute times (mean 1 s) run 1e6 updates under
ASP, SSP(3) and DSSP(3, 15) (the event-loop paradigms the design requires in
seconds), and 1e5 under a few others (most of which apply or drop many
gradients per update: see the gradients column). Each row is the best of ``--rounds`` runs of
``dj.cluster.simulate`` (event loop plus building and validating the
``Schedule``). Prints a table and writes it to
``experiments/results/bench_cluster.txt``.

    python experiments/bench_cluster.py [--rounds 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

if __package__ in (None, ""):
  # Run as a script from a checkout: make the repository root importable.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import delayjax as dj  # noqa: E402

C = dj.cluster
NUM_WORKERS = 64


def cases(scale: float):
  big, small = int(1_000_000 * scale), int(100_000 * scale)
  return [
      ("asp()", C.asp(), big),
      ("ssp(3)", C.ssp(3), big),
      ("dssp(3, 15)", C.dssp(3, 15), big),
      ("psp(8, 3)", C.psp(8, 3), small),
      ("softsync(8)", C.softsync(8), small),
      ("k_async(16)", C.k_async(16), small),
      ("k_sync(48)", C.k_sync(48), small),
      ("bsp()", C.bsp(), small),
      ("backup_workers(4)", C.backup_workers(4), small),
  ]


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--scale", type=float, default=1.0, help="multiplies every number of updates")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "bench_cluster.txt"))
  args = parser.parse_args(argv)

  workers = C.workers(NUM_WORKERS, compute="exponential")
  lines = [
      f"dj.cluster.simulate wall-clock time: {NUM_WORKERS} workers, exponential compute (mean 1 s), seed 0; "
      f"best of {args.rounds}",
      f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}",
      "",
      f"{'paradigm':<20} {'updates':>9} {'gradients':>10} {'seconds':>8} {'updates/s':>10} "
      f"{'mean staleness':>15} {'idle fraction':>14}",
  ]
  print("\n".join(lines), flush=True)
  for name, paradigm, num_updates in cases(args.scale):
    best = np.inf
    for _ in range(args.rounds):
      start = time.perf_counter()
      sched = C.simulate(paradigm, workers, num_updates, seed=0)
      best = min(best, time.perf_counter() - start)
    gradients = int(sched.num_batches.sum())
    line = (f"{name:<20} {num_updates:>9} {gradients:>10} {best:>8.2f} {num_updates / best:>10.0f} "
            f"{sched.mean_staleness():>15.2f} {sched.idle_fraction.mean():>14.3f}")
    print(line, flush=True)
    lines.append(line)
    del sched
  text = "\n".join(lines)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
