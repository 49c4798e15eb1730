"""Speed of the cluster simulator: wall-clock seconds to simulate a schedule, per paradigm.

64 workers with exponential compute times (mean 1 s) run 1e6 updates under
ASP, SSP(3) and DSSP(3, 15) (the event-loop paradigms the design requires in
seconds), and 1e5 under a few others (most of which apply or drop many
gradients per update: see the gradients column). Each row is the best of ``--rounds`` runs of
``dj.cluster.simulate`` (event loop plus building and validating the
``Schedule``). Prints a table and writes it to
``experiments/results/bench_cluster.txt``.

A second table shows the large runs that sparse schedules make possible:
ASP on ``W`` workers for ``U`` updates (``--large 1024x1e6,1024x1e7``), each in
a fresh process so its peak resident memory is its own; it gives seconds, events
(gradients) per second, the peak memory, the schedule's own bytes, and what the
dense ``[U, W]`` arrays of earlier schedules (17 bytes per entry) would take.
A size written ``WxU:lean`` runs with ``record_events=False``.

    python experiments/bench_cluster.py [--rounds 3] [--scale 1.0] [--large 1024x1e6,1024x1e7,10000x1e8:lean]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
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


def schedule_bytes(sched) -> int:
  """Bytes of the schedule's arrays (time, contributions, per-worker totals, extras)."""
  s = sched._sparse  # pylint: disable=protected-access
  arrays = [sched.time, sched.wait, sched.busy, sched.dropped, s.offsets, s.worker, s.read_version,
            *sched.extras.values()] + ([] if s.num_batches is None else [s.num_batches])
  return sum(a.nbytes for a in arrays)


def large_case(size: str) -> dict:
  """Runs one ``WxU[:lean]`` ASP case in this process and returns its figures."""
  shape, _, lean = size.partition(":")
  num_workers, num_updates = (int(float(x)) for x in shape.split("x"))
  workers = C.workers(num_workers, compute="exponential")
  start = time.perf_counter()
  sched = C.simulate(C.asp(), workers, num_updates, seed=0, record_events=lean != "lean")
  seconds = time.perf_counter() - start
  return dict(size=size, workers=num_workers, updates=num_updates, events=sched.num_contributions,
              seconds=seconds, peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              schedule_gib=schedule_bytes(sched) / 2**30, dense_gib=17 * num_updates * num_workers / 2**30,
              mean_staleness=sched.mean_staleness())


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--one", help=argparse.SUPPRESS)   # a large case, run in a child process
  parser.add_argument("--large", default="1024x1e6,1024x1e7",
                      help="comma-separated ASP sizes WORKERSxUPDATES[:lean]; empty to skip")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--scale", type=float, default=1.0, help="multiplies every number of updates")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "bench_cluster.txt"))
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(large_case(args.one)))
    return

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
  if args.large:
    header = ["", "Large ASP runs (sparse schedules; each in a fresh process; lean = record_events=False)",
              f"{'workers x updates':<22} {'events':>10} {'seconds':>8} {'events/s':>9} {'peak RSS GiB':>12} "
              f"{'schedule GiB':>12} {'dense GiB':>10}"]
    print("\n".join(header), flush=True)
    lines += header
    for size in args.large.split(","):
      out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", size], check=True,
                           capture_output=True, text=True).stdout
      r = json.loads(out.strip().splitlines()[-1])
      line = (f"{r['size']:<22} {r['events']:>10} {r['seconds']:>8.1f} {r['events'] / r['seconds']:>9.0f} "
              f"{r['peak_gib']:>12.2f} {r['schedule_gib']:>12.2f} {r['dense_gib']:>10.1f}")
      print(line, flush=True)
      lines.append(line)
  text = "\n".join(lines)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
