"""Side-by-side times of the reproductions that can run on two executors: the library's runtime and the one it
is measured against.

The gossip reproductions (``gossip_adpsgd``, ``gossip_topology``,
``gossip_failures``) run either on ``dj.simulate_gossip`` (``--set
runtime=dj``, the compiled replica runtime) or on the NumPy event loop of
``experiments/_gossip_train.py`` (``runtime=numpy``). Each variant runs as
``python -m experiments run NAME --set runtime=... --seeds N`` in a fresh
process (so every compile is counted, as a user's first run pays it) into a
folder of its own, and the time is the one the CLI prints for its runs
(start-up and plots left out, which both variants share). The variants of a
reproduction run one after the other, alternating, and the best of
``--rounds`` is kept, so background load hits both alike.

    python -m experiments.bench_reproductions [--names gossip_adpsgd ...] [--seeds 1 3] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile

from ._bench import add_out_argument, publish

NAMES = ("gossip_adpsgd", "gossip_topology", "gossip_failures")
RUNTIMES = ("numpy", "dj")
_SECONDS = re.compile(r"(\d+) runs performed, \d+ reused from .*?, ([0-9.]+) s;")


def time_runs(name: str, runtime: str, seeds: int, out: str) -> float:
  """Seconds the runs of ``name`` on ``runtime`` took in a fresh process (the CLI's own figure)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, "-m", __package__, "run", name, "--set", f"runtime={runtime}",
                         "--seeds", str(seeds), "--out", out, "--no-plot"], env=env, capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"{name} on {runtime} failed:\n{done.stderr[-2000:]}")
  found = _SECONDS.search(done.stdout)
  if found is None or int(found.group(1)) == 0:
    raise RuntimeError(f"{name} on {runtime}: no runs were timed:\n{done.stdout[-2000:]}")
  return float(found.group(2))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.bench_reproductions", description=__doc__.split("\n")[0])
  parser.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
  parser.add_argument("--seeds", nargs="+", type=int, default=[1, 3], help="seed counts timed (3: the default)")
  parser.add_argument("--rounds", type=int, default=1)
  add_out_argument(parser, "bench_reproductions")
  args = parser.parse_args(argv)
  lines = [f"Runs of the gossip reproductions (quick scale), seconds, compile included; best of {args.rounds} "
           f"round(s); {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           f"{'reproduction':<18} {'seeds':>5} {'numpy':>9} {'dj':>9} {'dj / numpy':>10}"]
  with tempfile.TemporaryDirectory(prefix="bench-reproductions-") as folder:
    for name in args.names:
      for seeds in args.seeds:
        best = {runtime: float("inf") for runtime in RUNTIMES}
        for round_ in range(args.rounds):
          for runtime in RUNTIMES:
            out = os.path.join(folder, f"{name}-{runtime}-{seeds}-{round_}")
            best[runtime] = min(best[runtime], time_runs(name, runtime, seeds, out))
        lines.append(f"{name:<18} {seeds:>5} {best['numpy']:>9.1f} {best['dj']:>9.1f} "
                     f"{best['dj'] / best['numpy']:>10.2f}")
        print(lines[-1], file=sys.stderr)
  publish(lines, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
