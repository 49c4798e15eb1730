"""Side-by-side times of reproductions on the library's runtimes and on the loops they ran on before.

The gossip reproductions (``gossip_adpsgd``, ``gossip_topology``,
``gossip_failures``) run on ``dj.simulate_gossip``. Until they moved there
they ran on a NumPy event loop, which now lives on as a test reference in the
checkout's ``tests/gossip/gossip_numpy_executor.py``; this benchmark loads it
from there (so it needs a checkout, not an installed wheel) and runs the same
reproduction with that executor as its ``run``. ``dai_staleness`` and
``variance_reduction`` run on ``dj.simulate``; until they moved there each ran
its own compiled loop, which this benchmark runs from the commit before the
move (:data:`REPLACED`), checked out into a temporary ``git worktree`` (a
checkout with its history), at the same quick-scale config. Each variant runs as
``python -m experiments run NAME --seeds N`` in a fresh process (so every
compile is counted, as a user's first run pays it) into a folder of its own.
Two figures per variant: the wall seconds the CLI prints for its runs
(start-up and plots left out, which both variants share), and the CPU seconds
of the whole process (start-up included), which background load on a shared
machine disturbs less. The variants of a reproduction run one after the
other, alternating, and the best of ``--rounds`` is kept of each figure; with
several rounds the last column gives the lowest and highest ratio of wall
times within a round (the two variants of a round ran minutes apart, under
about the same load), the spread to read a ratio near 1 by.

    python -m experiments.bench_reproductions [--names gossip_adpsgd ...] [--seeds 1 3] [--rounds 1]

Without ``--seeds``, each reproduction is timed at one seed and at its quick scale's seed count.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
from typing import Iterator

from ._bench import add_out_argument, publish

NAMES = ("gossip_adpsgd", "gossip_topology", "gossip_failures", "dai_staleness", "variance_reduction")
RUNTIMES = ("before", "dj")
# The last commit where each reproduction ran its own loop (the next one moved it onto dj.simulate), at the same
# quick-scale config as now.
REPLACED = {"dai_staleness": "87dbf25797aead7bb9027fe786da7064addf5908",
            "variance_reduction": "9bfea98b7a3ab9fba75da2405dc5bb582bc8dd77"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXECUTOR = os.path.join(ROOT, "tests", "gossip", "gossip_numpy_executor.py")
_SECONDS = re.compile(r"(\d+) runs performed, \d+ reused from .*?, ([0-9.]+) s;")


def time_runs(name: str, runtime: str, seeds: int, out: str, checkouts: dict[str, str]) -> tuple[float, float]:
  """``(wall seconds of the runs as the CLI prints them, CPU seconds of the process)`` of ``name`` on
  ``runtime`` in a fresh process (``"before"``: the NumPy executor or, for a name of :data:`REPLACED`, the
  checkout of its commit in ``checkouts``)."""
  root = checkouts[name] if runtime == "before" and name in REPLACED else ROOT
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  command = ([sys.executable, "-m", f"{__package__}.bench_reproductions", "--child"]
             if runtime == "before" and name not in REPLACED else [sys.executable, "-m", __package__])
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  done = subprocess.run([*command, "run", name, "--seeds", str(seeds), "--out", out, "--no-plot"], env=env,
                        capture_output=True, text=True, cwd=root)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if done.returncode != 0:
    raise RuntimeError(f"{name} on {runtime} failed:\n{done.stderr[-2000:]}")
  found = _SECONDS.search(done.stdout)
  if found is None or int(found.group(1)) == 0:
    raise RuntimeError(f"{name} on {runtime}: no runs were timed:\n{done.stdout[-2000:]}")
  return float(found.group(2)), (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _run_on_numpy_executor(argv: list[str]) -> int:
  """The CLI (``argv``: ``run NAME ...``) with the named reproduction's runs done by the NumPy executor."""
  if not os.path.exists(EXECUTOR):
    raise SystemExit(f"the NumPy executor is a test module of a checkout ({EXECUTOR}); it is not there.")
  spec = importlib.util.spec_from_file_location("gossip_numpy_executor", EXECUTOR)
  executor = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(executor)
  module = importlib.import_module(f"{__package__}.{argv[1]}")
  # One run at a time, as before: the executor has no batches.
  module.REPRODUCTION = dataclasses.replace(module.REPRODUCTION, run=executor.run_spec, batch=None, run_batch=None)
  from .__main__ import main as cli

  return cli(argv)


@contextlib.contextmanager
def _checkouts(names: list[str], folder: str) -> Iterator[dict[str, str]]:
  """A ``git worktree`` of each name's :data:`REPLACED` commit under ``folder``, removed afterwards."""
  made: dict[str, str] = {}
  try:
    for name in names:
      path = os.path.join(folder, f"before-{name}")
      done = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, REPLACED[name]],
                            capture_output=True, text=True)
      if done.returncode != 0:
        raise SystemExit(f"{name}: cannot check out its loop's commit {REPLACED[name]} (a clone with its history "
                         f"is needed): {done.stderr.strip()}")
      made[name] = path
    yield made
  finally:
    for path in made.values():
      subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], capture_output=True)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    return _run_on_numpy_executor(argv[1:])
  parser = argparse.ArgumentParser(prog="python -m experiments.bench_reproductions", description=__doc__.split("\n")[0])
  parser.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
  parser.add_argument("--seeds", nargs="+", type=int, default=None,
                      help="seed counts timed (default: 1 and the quick scale's)")
  parser.add_argument("--rounds", type=int, default=1)
  add_out_argument(parser, "bench_reproductions")
  args = parser.parse_args(argv)
  lines = [f"Runs of reproductions (quick scale, --jobs 1) on what they ran on before (the gossip ones: the NumPy "
           f"executor of tests/gossip/; the others: their own loops at the commits of REPLACED) and on delayjax's "
           f"runtimes, compile included; wall: the CLI's seconds for the runs; CPU: the whole process's CPU "
           f"seconds, start-up included; best of {args.rounds} round(s); "
           f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           f"{'reproduction':<18} {'seeds':>5} {'before wall':>11} {'dj wall':>8} {'dj/before':>9} "
           f"{'before CPU':>10} {'dj CPU':>7} {'dj/before':>9}" + ("  wall ratio by round" if args.rounds > 1 else "")]
  with tempfile.TemporaryDirectory(prefix="bench-reproductions-") as folder, _checkouts(
      [name for name in args.names if name in REPLACED], folder) as checkouts:
    for name in args.names:
      default = importlib.import_module(f"{__package__}.{name}").REPRODUCTION.scales["quick"]["seeds"]
      for seeds in args.seeds or sorted({1, default}):
        wall = {runtime: float("inf") for runtime in RUNTIMES}
        cpu = dict(wall)
        ratios = []
        for round_ in range(args.rounds):
          this_round = {}
          for runtime in RUNTIMES:
            out = os.path.join(folder, f"{name}-{runtime}-{seeds}-{round_}")
            seconds, used = time_runs(name, runtime, seeds, out, checkouts)
            this_round[runtime] = seconds
            wall[runtime], cpu[runtime] = min(wall[runtime], seconds), min(cpu[runtime], used)
          ratios.append(this_round["dj"] / this_round["before"])
        lines.append(f"{name:<18} {seeds:>5} {wall['before']:>11.2f} {wall['dj']:>8.2f} "
                     f"{wall['dj'] / wall['before']:>9.2f} {cpu['before']:>10.1f} {cpu['dj']:>7.1f} "
                     f"{cpu['dj'] / cpu['before']:>9.2f}" + (f"  {min(ratios):.2f}-{max(ratios):.2f}"
                                                             if args.rounds > 1 else ""))
        print(lines[-1], file=sys.stderr)
  publish(lines, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
