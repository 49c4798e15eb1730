"""Host planning time of ``dj.simulate`` and ``dj.simulate_gossip``: the array-operation planners against the
previous one-item-at-a-time Python planners, side by side in one process.

The previous planners are kept as the references of the planners' tests
(``tests/runtime/plan_reference.py``, ``tests/gossip/replica_plan_reference.py``),
which assert that both give identical plans. For each configuration both plan
the same schedule (a fresh copy each time, so that the previous planner pays
for the ``[updates, workers]`` views it builds, as in a real call), in
interleaved rounds; the table gives the best wall-clock and CPU microseconds
per update (per event for gossip schedules) and the ratio old / new.

- ``plan_steps`` (``dj.simulate``): ASP with exponential compute times at
  M = 4, 64, 1024 workers and 1e4, 1e5, 1e6 updates, SSP(3) and K-sync(M/2)
  at 1e5 updates; lanes chosen by the planner (as ``dj.simulate`` does).
- ``make_plan`` (``dj.simulate_gossip``): AD-PSGD on a ring, SGP(1) and
  D-PSGD on the exponential graph, M = 16 and 64.
- The peak memory of planning (``tracemalloc``: NumPy's arrays and Python's
  objects) at M = 64.

``--steady-state-against TREE`` instead compares ``dj.simulate``'s steady state
(gradient evaluations per second, compilation excluded: ``time_simulate`` of
``experiments/bench_runtime.py``) between this tree and another checkout
``TREE`` (e.g. a ``git worktree`` of an older commit), alternating fresh
processes of each.

    python -m experiments.bench_planning [--quick] [--out experiments/results/bench_planning.txt]
    python -m experiments.bench_planning --steady-state-against /path/to/other/tree [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc

import numpy as np

import delayjax as dj
from delayjax.cluster._schedule import Schedule
from delayjax.runtime._replica_plan import make_plan
from delayjax.runtime._waves import plan_steps
from experiments._bench import add_out_argument, publish

PARADIGMS = {
    "asp": lambda m: dj.cluster.asp(),
    "ssp3": lambda m: dj.cluster.ssp(3),
    "ksync": lambda m: dj.cluster.k_sync(max(1, m // 2)),
}
GOSSIP = {
    "ad_psgd ring": lambda m: dj.cluster.ad_psgd(dj.topology.ring(m)),
    "sgp(1)": lambda m: dj.cluster.sgp(1),
    "d_psgd exp": lambda m: dj.cluster.d_psgd(dj.topology.exponential(m)),
}


def _references():
  # The previous planners live with the tests that compare against them.
  sys.path.insert(0, os.getcwd())
  from tests.gossip import replica_plan_reference
  from tests.runtime import plan_reference
  return plan_reference.plan_steps, replica_plan_reference.make_plan


def fresh(schedule: Schedule) -> Schedule:
  """A copy without the dense views a previous planner built on the original."""
  c = schedule.contributions
  return Schedule.from_contributions(schedule.time, schedule.offsets, c.worker, c.read_version, schedule.wait,
                                     num_workers=schedule.num_workers, num_batches=c.num_batches)


def timed(fn) -> tuple[float, float, object]:
  gc.collect()
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return time.perf_counter() - wall, time.process_time() - cpu, out


def compare(runs: dict, rounds: int, budget: float = 30.0) -> dict[str, tuple[float, float]]:
  """Best (wall, CPU) seconds of each run over interleaved rounds (fewer once ``budget`` seconds are spent);
  ``None`` for a run that raised."""
  best = {name: (np.inf, np.inf) for name in runs}
  start = time.perf_counter()
  for done in range(rounds):
    if done and time.perf_counter() - start > budget:
      break
    for name, run in runs.items():
      if best[name] is None:
        continue
      try:
        wall, cpu, _ = timed(run)
      except ValueError as error:  # the previous planner's dense views are refused past DENSE_LIMIT
        best[name] = None
        print(f"  {name}: {error}", file=sys.stderr)
        continue
      best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
  return best


def row(label: str, count: int, best: dict) -> str:
  old, new = best["old"], best["new"]
  cells = [f"{label:<28s}"]
  for pair in (old, new):
    cells.append("       refused      " if pair is None else f"{pair[0] / count * 1e6:9.2f} {pair[1] / count * 1e6:9.2f} ")
  if old is None:
    cells.append("        -        -")
  else:
    cells.append(f"{old[0] / new[0]:8.1f} {old[1] / new[1]:8.1f}")
  return " ".join(cells)


def plan_rows(quick: bool) -> list[str]:
  old_plan, _ = _references()
  sizes = (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000)
  configs = [("asp", m, n) for m in (4, 64, 1024) for n in sizes]
  # K-sync(M/2) updates average M/2 gradients each: at most 1e6 gradients per schedule.
  configs += [(p, m, 100_000 if p == "ssp3" else min(100_000, 2_000_000 // m)) for p in ("ssp3", "ksync")
              for m in (4, 64, 1024)]
  lines = ["plan_steps (dj.simulate), microseconds per update: wall and CPU; old / new; gradients per update",
           f"{'schedule':<28s} {'old wall':>9s} {'old CPU':>9s}  {'new wall':>9s} {'new CPU':>9s}  "
           f"{'x wall':>8s} {'x CPU':>8s} {'grads':>6s}"]
  for paradigm, m, n in configs:
    schedule = dj.cluster.simulate(PARADIGMS[paradigm](m), dj.cluster.workers(m, compute="exponential"),
                                   num_updates=n, seed=0)
    rounds = 1 if n >= 1_000_000 else 3 if n >= 100_000 else 5
    best = compare({"old": lambda: old_plan(fresh(schedule), m, 1), "new": lambda: plan_steps(fresh(schedule), m, 1)},
                   rounds)
    lanes = plan_steps(schedule, m, 1).lanes
    label = f"{paradigm} M={m} U={n:.0e} L={lanes}"
    lines.append(row(label, schedule.num_updates, best)
                 + f" {schedule.num_contributions / max(schedule.num_updates, 1):6.1f}")
    print(lines[-1], flush=True)
  return lines


def gossip_rows(quick: bool) -> list[str]:
  _, old_make = _references()
  lines = ["", "make_plan (dj.simulate_gossip), microseconds per event: wall and CPU; old / new",
           f"{'schedule':<28s} {'old wall':>9s} {'old CPU':>9s}  {'new wall':>9s} {'new CPU':>9s}  "
           f"{'x wall':>8s} {'x CPU':>8s}"]
  for name, make in GOSSIP.items():
    for m in (16, 64):
      steps = 50 if quick else 200
      schedule = dj.cluster.simulate_gossip(make(m), dj.cluster.workers(m, compute="exponential", comm=0.3),
                                            steps, seed=0)
      best = compare({"old": lambda: old_make(schedule), "new": lambda: make_plan(schedule)}, 1 if quick else 3)
      lines.append(row(f"{name} M={m} E={schedule.num_events:.1e}", schedule.num_events, best))
      print(lines[-1], flush=True)
  return lines


def memory_rows(quick: bool) -> list[str]:
  old_plan, _ = _references()
  lines = ["", "peak memory of planning (tracemalloc), ASP M=64: MiB, and the plan's own tables",
           f"{'updates':>10s} {'old peak':>9s} {'new peak':>9s} {'tables':>9s}"]
  for n in (100_000,) if quick else (100_000, 1_000_000):
    schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(64, compute="exponential"), num_updates=n,
                                   seed=0)
    peaks = []
    for planner in (old_plan, plan_steps):
      copy = fresh(schedule)
      gc.collect()
      tracemalloc.start()
      plan = planner(copy, 64, 1)
      peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
      tracemalloc.stop()
    tables = sum(v.nbytes for v in vars(plan).values() if isinstance(v, np.ndarray)) / 2**20
    lines.append(f"{n:>10d} {peaks[0]:9.0f} {peaks[1]:9.0f} {tables:9.0f}")
    print(lines[-1], flush=True)
  return lines


_CHILD = ("import json, sys; from experiments.bench_runtime import time_simulate; "
          "r = time_simulate('mlp', sys.argv[1], int(sys.argv[2]), int(sys.argv[3])); "
          "print('RESULT ' + json.dumps({k: r[k] for k in ('rate', 'total_s', 'lanes')}))")


def steady_state_rows(other: str, rounds: int, quick: bool) -> list[str]:
  """dj.simulate's steady state here and in ``other``, alternating fresh processes (compilation excluded)."""
  here = os.getcwd()
  trees = {"this tree": here, "other": os.path.abspath(other)}
  configs = [("asp", 16, 4096)] if quick else [("asp", 16, 8192), ("asp", 64, 8192)]
  lines = [f"dj.simulate steady state (MLP 64-256-10, batch 32, median gradients/s over chunks), alternating "
           f"processes, {rounds} rounds each",
           f"other tree: {trees['other']} at {_head(trees['other'])}; this tree at {_head(here)}",
           f"{'schedule':<18s} {'this tree':>22s} {'other':>22s} {'this / other':>13s}"]
  for paradigm, m, n in configs:
    rates = {name: [] for name in trees}
    for _ in range(rounds):
      for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", _CHILD, paradigm, str(m), str(n)], cwd=tree, env=env,
                             capture_output=True, text=True, check=True).stdout
        rates[name].append(json.loads(out.split("RESULT ", 1)[1])["rate"])
    med = {name: float(np.median(v)) for name, v in rates.items()}
    spread = {name: f"{med[name]:8.0f} ({min(v):.0f}-{max(v):.0f})" for name, v in rates.items()}
    lines.append(f"{paradigm} M={m} U={n:<7d} {spread['this tree']:>22s} {spread['other']:>22s} "
                 f"{med['this tree'] / med['other']:13.3f}")
    print(lines[-1], flush=True)
  return lines


def _head(tree: str) -> str:
  return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def header(argv: list[str]) -> list[str]:
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  return [f"python -m experiments.bench_planning {' '.join(argv)}".rstrip(),
          f"numpy {np.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}, load average {load:.1f} at the start (on a busy machine, CPU time is the steadier "
          "figure)", ""]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer and shorter schedules")
  parser.add_argument("--steady-state-against", metavar="TREE", default=None,
                      help="compare dj.simulate's steady state with the checkout at TREE instead")
  parser.add_argument("--rounds", type=int, default=4, help="processes per tree for --steady-state-against")
  add_out_argument(parser, "bench_planning")
  args = parser.parse_args(argv)
  lines = header(argv)
  if args.steady_state_against:
    lines += steady_state_rows(args.steady_state_against, args.rounds, args.quick)
  else:
    lines += plan_rows(args.quick) + gossip_rows(args.quick) + memory_rows(args.quick)
  publish(lines, args.out)


if __name__ == "__main__":
  main()
