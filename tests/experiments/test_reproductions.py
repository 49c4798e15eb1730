"""Every reproduction runs end to end through the CLI at smoke size; list, run, resume and report work."""

import csv
import json
import os
import subprocess
import sys

import pytest

from experiments import _registry
from experiments.__main__ import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_list_names_every_reproduction(capsys):
  assert main(["list"]) == 0
  out = capsys.readouterr().out
  for name in _registry.NAMES:
    assert name in out
  assert "claims" in out


def test_unknown_reproduction_is_an_error(capsys):
  assert main(["run", "nope"]) == 2
  assert "known:" in capsys.readouterr().err


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _smoke_run(name: str, out: str) -> str:
  """``python -m experiments run NAME --smoke`` in a process of its own; returns what it printed.

  Its XLA compiles without backend optimization: a smoke run is almost all compilation, which this halves,
  and what is checked here (the pipeline runs, writes, resumes and reports) does not depend on it.
  """
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, "-m", "experiments", "run", name, "--smoke", "--out", out], env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", _registry.NAMES)
def test_reproduction_runs_resumes_and_reports(name, tmp_path, capsys):
  out = str(tmp_path / name)
  printed = _smoke_run(name, out)
  assert "claims (checked on this run's numbers" in printed

  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  repro = _registry.get(name)
  specs = repro.specs(saved["config"])
  assert saved["reproduction"] == name and len(saved["rows"]) >= 1
  assert len(os.listdir(os.path.join(out, "runs"))) == len(specs) * saved["config"]["seeds"]
  # Mid-run checkpoints are removed once a run's record is written.
  checkpoints = os.path.join(out, "checkpoints")
  assert not os.path.isdir(checkpoints) or not os.listdir(checkpoints)
  assert [c["claim"] for c in saved["claims"]] == [c.name for c in repro.claims]
  for claim in saved["claims"]:
    assert claim["verdict"] in ("held", "not held", "inconclusive", "not evaluated") and claim["figures"]
    assert claim["held"] == {"held": True, "not held": False}.get(claim["verdict"])
  with open(os.path.join(out, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  assert [r["key"] for r in rows] == [r["key"] for r in saved["rows"]]
  pngs = [p for p in os.listdir(out) if p.endswith(".png")]
  assert pngs
  for p in pngs:
    with open(os.path.join(out, p), "rb") as f:
      assert f.read(8) == PNG

  # A second run finds every run finished and performs none.
  assert main(["run", name, "--smoke", "--out", out, "--no-plot"]) == 0
  assert "0 runs performed" in capsys.readouterr().out

  # report rebuilds the same table from the run records and writes the claims as Markdown.
  os.remove(os.path.join(out, "results.csv"))
  assert main(["report", str(tmp_path), "--no-plot"]) == 0
  assert os.path.exists(os.path.join(out, "results.csv"))
  with open(os.path.join(out, "results.json")) as f:
    assert json.load(f)["rows"] == saved["rows"]
  with open(tmp_path / "claims.md") as f:
    assert f.read().count(f"| {name} (quick) |") == len(repro.claims)


def test_report_without_results_fails(tmp_path, capsys):
  assert main(["report", str(tmp_path)]) == 1
  assert "no results.json" in capsys.readouterr().err
