"""Writes README.md's reproductions table from the last recorded full run, so that the front door never goes stale.

    python docs/_tools/readme_claims.py           # rewrite the table between the markers
    python docs/_tools/readme_claims.py --check   # exit 1 if README.md's table is not what it would write

The table (between ``<!-- claims:begin -->`` and ``<!-- claims:end -->``) has two reproductions of the registry
a row, in its order: for each, the command, the paper, and how its claims came out at quick scale in
``experiments/results/claims_quick.md`` (held / not held / inconclusive).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))


def table() -> str:
  from delayjax_gallery import recorded_claims, short_paper

  from experiments import _registry

  note, rows = recorded_claims()
  cells = []
  for repro in _registry.all_reproductions():
    verdicts = collections.Counter(re.sub(r"[*]", "", r[2]).strip() for r in rows.get(repro.name, []))
    counts = (f"{verdicts['held']} / {verdicts['not held']} / {verdicts['inconclusive']}" if verdicts else
              "not in the last full run")
    cells.append(f"`run {repro.name}` | {short_paper(repro.paper)} | {counts}")
  # Two reproductions a row: the front door stays short as the registry grows.
  lines = ["| command | paper | held / not held / inconclusive " * 2 + "|", "|---|---|---" * 2 + "|"]
  for i in range(0, len(cells), 2):
    pair = cells[i:i + 2] + ([" |  | "] if i + 1 == len(cells) else [])
    lines.append(f"| {' | '.join(pair)} |")
  total = collections.Counter(re.sub(r"[*]", "", r[2]).strip() for v in rows.values() for r in v)
  lines += ["", f"{sum(total.values())} claims: {total['held']} held, {total['not held']} not held, "
            f"{total['inconclusive']} inconclusive, each a paired comparison over seeds with a 95% interval "
            "([experiments/results/claims_quick.md](experiments/results/claims_quick.md); "
            "each reproduction's page in the docs' gallery shows its claims, intervals and the paper's numbers)."]
  return "\n".join(lines)


def render(readme: str) -> str:
  if BEGIN not in readme or END not in readme:
    raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
  head, rest = readme.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale, writing nothing")
  args = parser.parse_args(argv)
  with open(README, encoding="utf-8") as f:
    current = f.read()
  new = render(current)
  if args.check:
    if new != current:
      print("README.md's reproductions table is stale: run python docs/_tools/readme_claims.py", file=sys.stderr)
      return 1
    return 0
  if new != current:
    with open(README, "w", encoding="utf-8") as f:
      f.write(new)
  return 0


if __name__ == "__main__":
  sys.exit(main())
