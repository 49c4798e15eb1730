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
  M = 4, 16, 64, 1024 workers and 1e4, 1e5, 1e6 updates, SSP(3) at 1e5 and
  1e6 updates, K-sync(M/2) at up to 1e5 updates; lanes chosen by the planner
  (as ``dj.simulate`` does). With ``--before TREE``, the ``plan_steps`` of
  another checkout (e.g. a ``git worktree`` of an earlier commit) is timed in
  the same rounds, as a third column.
- ``make_plan`` (``dj.simulate_gossip``): AD-PSGD on a ring, SGP(1) and
  D-PSGD on the exponential graph, M = 16 and 64.
- The peak memory of planning (``tracemalloc``: NumPy's arrays and Python's
  objects) and the plan's own tables, ASP at M = 64 and 1024.

``--simulate-rss`` instead runs ``dj.simulate`` (a 4-weight linear model,
batch 1, ASP at M = 16 and 1024 workers, 1e6 updates) in a fresh process per
tree (this one, and ``--before TREE`` if given) and gives the process's peak
resident memory, its resident memory before the call, and the bytes of the
``History``'s per-update arrays (``update``, ``time``, ``loss``,
``staleness``: part of its documented fields, so they grow with the updates)
and of all its arrays.
With ``--history evaluations`` (or ``both``) this tree also runs with
``dj.simulate(..., record=dj.Record(history="evaluations"))``, which keeps none of them
(``experiments/results/bench_planning_rss_history.txt``).

``--steady-state-against TREE`` instead compares ``dj.simulate``'s steady state
(gradient evaluations per second, compilation excluded: ``time_simulate`` of
``experiments/bench_runtime.py``) between this tree and another checkout
``TREE`` (e.g. a ``git worktree`` of an older commit), alternating fresh
processes of each.

    python -m experiments.bench_planning [--quick] [--before TREE] [--sections plan,gossip,memory]
        [--out experiments/results/bench_planning.txt]
    python -m experiments.bench_planning --simulate-rss [--before TREE] [--quick] [--history both]
    python -m experiments.bench_planning --steady-state-against /path/to/other/tree [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
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
from ._bench import add_out_argument, publish

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


def planner_of(tree: str):
  """``plan_steps`` as the checkout at ``tree`` has it (its ``_waves.py``, loaded under another name)."""
  path = os.path.join(os.path.abspath(tree), "delayjax", "runtime", "_waves.py")
  spec = importlib.util.spec_from_file_location("_waves_before", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module.plan_steps


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
  """Best (wall, CPU) seconds of each run over interleaved rounds (the previous planner's, ``old``, in fewer
  once ``budget`` seconds are spent); ``None`` for a run that raised."""
  best = {name: (np.inf, np.inf) for name in runs}
  start = time.perf_counter()
  for done in range(rounds):
    over = done and time.perf_counter() - start > budget
    if over and set(runs) == {"old", "new"}:
      break
    for name, run in runs.items():
      if best[name] is None or (over and name == "old"):
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
  for name in ("old", "before", "new"):
    if name in best:
      pair = best[name]
      cells.append("       refused      " if pair is None else f"{pair[0] / count * 1e6:9.2f} {pair[1] / count * 1e6:9.2f} ")
  if old is None:
    cells.append("        -        -")
  else:
    cells.append(f"{old[0] / new[0]:8.1f} {old[1] / new[1]:8.1f}")
  if "before" in best:
    cells.append(f"{best['before'][1] / new[1]:8.2f}")
  return " ".join(cells)


def plan_rows(quick: bool, before: str | None = None) -> list[str]:
  old_plan, _ = _references()
  before_plan = None if before is None else planner_of(before)
  sizes = (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000)
  configs = [("asp", m, n) for m in (4, 16, 64, 1024) for n in sizes]
  configs += [("ssp3", m, n) for m in (4, 16, 64, 1024) for n in sizes[1:]]
  # K-sync(M/2) updates average M/2 gradients each: at most 1e6 gradients per schedule.
  configs += [("ksync", m, min(100_000, 2_000_000 // m)) for m in (4, 64, 1024)]
  lines = ["plan_steps (dj.simulate), microseconds per update: wall and CPU; old / new; gradients per update"
           + ("" if before is None else f"; before: {os.path.abspath(before)} at {_head(before)}"),
           f"{'schedule':<28s} {'old wall':>9s} {'old CPU':>9s}  "
           + ("" if before is None else f"{'bef. wall':>9s} {'bef. CPU':>9s}  ")
           + f"{'new wall':>9s} {'new CPU':>9s}  {'x wall':>8s} {'x CPU':>8s} "
           + ("" if before is None else f"{'bef./new':>8s} ") + f"{'grads':>6s}"]
  for paradigm, m, n in configs:
    schedule = dj.cluster.simulate(PARADIGMS[paradigm](m), dj.cluster.workers(m, compute="exponential"),
                                   num_updates=n, seed=0)
    rounds = 1 if n >= 1_000_000 else 3 if n >= 100_000 else 5
    runs = {"old": lambda: old_plan(fresh(schedule), m, 1), "new": lambda: plan_steps(fresh(schedule), m, 1)}
    if before_plan is not None:
      runs["before"] = lambda: before_plan(fresh(schedule), m, 1)
      rounds = max(rounds, 3)  # the figures this column compares are a few microseconds: the best of three
    best = compare(runs, rounds)
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
  lines = ["", "peak memory of planning (tracemalloc), ASP: MiB, and the plan's own tables (old: the reference's; "
           "1024 workers x 1e6 updates are refused by the reference's dense views)",
           f"{'workers':>8s} {'updates':>10s} {'old peak':>9s} {'new peak':>9s} {'old tables':>11s} {'tables':>9s}"]
  for m, n in [(64, 100_000), (1024, 100_000)] if quick else [(64, 100_000), (64, 1_000_000), (1024, 1_000_000)]:
    schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(m, compute="exponential"), num_updates=n,
                                   seed=0)
    peaks, tables = [], []
    for planner in (old_plan, plan_steps):
      copy = fresh(schedule)
      gc.collect()
      tracemalloc.start()
      try:
        plan = planner(copy, m, 1)
      except ValueError:  # the reference's dense views are refused past DENSE_LIMIT
        plan = None
      peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
      tracemalloc.stop()
      tables.append(np.nan if plan is None else
                    sum(v.nbytes for v in vars(plan).values() if isinstance(v, np.ndarray)) / 2**20)
      del plan
    cells = ["  refused" if np.isnan(tables[0]) else f"{peaks[0]:9.0f}", f"{peaks[1]:9.0f}",
             "    refused" if np.isnan(tables[0]) else f"{tables[0]:11.0f}", f"{tables[1]:9.0f}"]
    lines.append(f"{m:>8d} {n:>10d} " + " ".join(cells))
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


_RSS_CHILD = """
import os, sys
import jax, jax.numpy as jnp, numpy as np, optax
import delayjax as dj
def memory():
  with open("/proc/self/status") as f:
    fields = dict(line.split(":", 1) for line in f)
  return [int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")]
m, n = int(sys.argv[1]), int(sys.argv[2])
evaluate = lambda p: loss(p, data)
if hasattr(dj, "Record"):
  option = dict(sampling=dj.Sampling(batch_size=1), record=dj.Record(eval_fn=evaluate, every=n // 10,
                                                                      history=sys.argv[3]))
else:
  # An older tree takes keywords, and the oldest has no history argument: only a run that keeps less passes it.
  option = dict(batch_size=1, eval_every=n // 10, eval_fn=evaluate,
                **({} if sys.argv[3] == "updates" else {"history": sys.argv[3]}))
x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
data = {"x": x, "y": x.sum(axis=1)}
loss = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)
schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(m, compute="exponential"), num_updates=n, seed=0)
before = memory()[0]
h = dj.simulate(loss, optax.sgd(0.01), jnp.zeros(4), data, schedule, **option).history
per_update = sum(a.nbytes for a in (h.update, h.time, h.loss, h.staleness))
whole = sum(np.asarray(a).nbytes for a in jax.tree.leaves(tuple(h)))
print("RESULT", before, memory()[1], per_update / 2**20, h.eval_update.size, whole / 2**10)
"""


def simulate_rss_rows(before: str | None, quick: bool, history: str = "updates") -> list[str]:
  """Peak resident memory of a ``dj.simulate`` call, in a fresh process per tree (and ``history`` setting of
  this tree: ``"updates"``, ``"evaluations"`` or ``"both"``)."""
  settings = ["updates", "evaluations"] if history == "both" else [history]
  runs = [(f"this tree, history={h}" if len(settings) > 1 or h != "updates" else "this tree", os.getcwd(), h)
          for h in settings]
  if before is not None:
    runs.append(("before", os.path.abspath(before), "updates"))
  lines = ["dj.simulate memory (linear model, batch 1, ASP, eval every U/10): MiB resident before the call and at "
           "the peak, the History's per-update arrays (MiB), and all its arrays (KiB)",
           f"{'tree':<50s} {'workers':>8s} {'updates':>9s} {'RSS before':>11s} {'peak RSS':>9s} {'per-update':>11s} "
           f"{'evals':>6s} {'History KiB':>11s}"]
  for m, n in [(16, 100_000)] if quick else [(16, 1_000_000), (1024, 1_000_000)]:
    for name, tree, setting in runs:
      env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
      out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(m), str(n), setting], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout
      rss_before, peak, per_update, evals, whole = out.split("RESULT ", 1)[1].split()
      lines.append(f"{name + ' (' + _head(tree) + ')':<50s} {m:>8d} {n:>9d} {float(rss_before):11.0f} "
                   f"{float(peak):9.0f} {float(per_update):11.1f} {int(evals):6d} {float(whole):11.1f}")
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
  parser.add_argument("--before", metavar="TREE", default=None,
                      help="also time the plan_steps of the checkout at TREE (an earlier commit)")
  parser.add_argument("--sections", default="plan,gossip,memory",
                      help="the tables to time, comma-separated among plan (plan_steps), gossip (make_plan) and "
                           "memory (peak memory of planning); default all")
  parser.add_argument("--simulate-rss", action="store_true",
                      help="the peak resident memory of dj.simulate at 1e6 updates instead")
  parser.add_argument("--history", choices=("updates", "evaluations", "both"), default="updates",
                      help="with --simulate-rss: dj.simulate's history setting(s) for this tree")
  add_out_argument(parser, "bench_planning")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  if not sections or set(sections) - {"plan", "gossip", "memory"}:
    parser.error(f"--sections takes plan, gossip and/or memory, comma-separated; got {args.sections!r}")
  lines = header(argv)
  if args.simulate_rss:
    lines += simulate_rss_rows(args.before, args.quick, args.history)
  elif args.steady_state_against:
    lines += steady_state_rows(args.steady_state_against, args.rounds, args.quick)
  else:
    tables = {"plan": lambda: plan_rows(args.quick, args.before), "gossip": lambda: gossip_rows(args.quick),
              "memory": lambda: memory_rows(args.quick)}
    for name, rows in tables.items():
      if name in sections:
        lines += rows()
  publish(lines, args.out)


if __name__ == "__main__":
  main()
