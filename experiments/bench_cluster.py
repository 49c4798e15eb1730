"""Speed of the cluster simulator: wall-clock seconds to simulate a schedule, per paradigm.

64 workers with exponential compute times (mean 1 s) run 1e6 updates under
ASP, SSP(3) and DSSP(3, 15) (the event-loop paradigms the design requires in
seconds), and 1e5 under a few others (most of which apply or drop many
gradients per update: see the gradients column). Each row is the best of ``--rounds`` runs of
``dj.cluster.simulate`` (event loop plus building and validating the
``Schedule``). Prints a table (and writes it to ``--out FILE``; the published
one is ``experiments/results/bench_cluster.txt``).

A second table shows the large runs that sparse schedules make possible:
ASP on ``W`` workers for ``U`` updates (``--large 1024x1e6,1024x1e7``), each in
a fresh process so its peak resident memory is its own; it gives wall-clock and
CPU seconds (on a shared machine the CPU time is the steadier figure), events
(gradients) per CPU second, the peak memory (the process, imports included),
the schedule's own bytes, and what the dense ``[U, W]`` arrays of earlier
schedules (17 bytes per entry) would take.
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


def peak_memory_gib() -> float:
  """This process's peak resident memory: ``VmHWM`` (reset by exec, unlike ``ru_maxrss``, which a child
  inherits from the process that forked it) where Linux gives it."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def large_case(size: str) -> dict:
  """Runs one ``WxU[:lean]`` ASP case in this process and returns its figures."""
  shape, _, lean = size.partition(":")
  num_workers, num_updates = (int(float(x)) for x in shape.split("x"))
  workers = C.workers(num_workers, compute="exponential")
  start, cpu = time.perf_counter(), time.process_time()
  sched = C.simulate(C.asp(), workers, num_updates, seed=0, record_events=lean != "lean")
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  return dict(size=size, workers=num_workers, updates=num_updates, events=sched.num_contributions,
              seconds=seconds, cpu_seconds=cpu,
              peak_gib=peak_memory_gib(),
              schedule_gib=schedule_bytes(sched) / 2**30, dense_gib=17 * num_updates * num_workers / 2**30,
              mean_staleness=sched.mean_staleness())


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--one", help=argparse.SUPPRESS)   # a large case, run in a child process
  parser.add_argument("--large", default="1024x1e6,1024x1e7",
                      help="comma-separated ASP sizes WORKERSxUPDATES[:lean]; empty to skip")
  parser.add_argument("--rounds", type=int, default=3, help="runs per table row (0: large runs only)")
  parser.add_argument("--scale", type=float, default=1.0, help="multiplies every number of updates")
  parser.add_argument("--out", default=None, metavar="FILE",
                      help="also write the table to FILE (the published one is experiments/results/bench_cluster.txt)")
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(large_case(args.one)))
    return

  workers = C.workers(NUM_WORKERS, compute="exponential")
  lines = [
      f"dj.cluster.simulate time: {NUM_WORKERS} workers, exponential compute (mean 1 s), seed 0; "
      f"best of {args.rounds}",
      f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}, "
      f"load average {os.getloadavg()[0]:.1f} at the start (on a busy machine, CPU seconds are the steadier figure)",
      "",
      f"{'paradigm':<20} {'updates':>9} {'gradients':>10} {'seconds':>8} {'CPU s':>7} {'updates/CPU s':>13} "
      f"{'mean staleness':>15} {'idle fraction':>14}",
  ]
  if args.rounds == 0:
    lines = lines[1:2]   # the machine line only
  print("\n".join(lines), flush=True)
  for name, paradigm, num_updates in cases(args.scale) if args.rounds else []:
    best = best_cpu = np.inf
    for _ in range(args.rounds):
      start, cpu = time.perf_counter(), time.process_time()
      sched = C.simulate(paradigm, workers, num_updates, seed=0)
      best = min(best, time.perf_counter() - start)
      best_cpu = min(best_cpu, time.process_time() - cpu)
    gradients = int(sched.contributions.num_batches.sum())
    line = (f"{name:<20} {num_updates:>9} {gradients:>10} {best:>8.2f} {best_cpu:>7.2f} "
            f"{num_updates / best_cpu:>13.0f} "
            f"{sched.mean_staleness():>15.2f} {sched.idle_fraction.mean():>14.3f}")
    print(line, flush=True)
    lines.append(line)
    write(args.out, lines)   # after every row: a run stopped early keeps what it measured
    del sched
  if args.large:
    header = ["", "Large ASP runs (sparse schedules; each in a fresh process; lean = record_events=False)",
              f"{'workers x updates':<22} {'events':>10} {'seconds':>8} {'CPU s':>7} {'events/CPU s':>12} "
              f"{'peak RSS GiB':>12} "
              f"{'schedule GiB':>12} {'dense GiB':>10}"]
    print("\n".join(header), flush=True)
    lines += header
    for size in args.large.split(","):
      run = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", size],
                           capture_output=True, text=True)
      if run.returncode != 0:
        # Too large for this machine (e.g. out of memory): say so and go on.
        reason = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        line = f"{size:<22} failed: {reason}"
        print(line, flush=True)
        lines.append(line)
        continue
      r = json.loads(run.stdout.strip().splitlines()[-1])
      line = (f"{r['size']:<22} {r['events']:>10} {r['seconds']:>8.1f} {r['cpu_seconds']:>7.1f} "
              f"{r['events'] / r['cpu_seconds']:>12.0f} "
              f"{r['peak_gib']:>12.2f} {r['schedule_gib']:>12.2f} {r['dense_gib']:>10.1f}")
      print(line, flush=True)
      lines.append(line)
      write(args.out, lines)
  write(args.out, lines)


def write(path: str | None, lines: list[str]) -> None:
  """Writes the table so far to ``path`` (nothing without ``--out``)."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
