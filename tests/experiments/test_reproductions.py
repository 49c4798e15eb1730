"""Every reproduction runs end to end through the CLI at smoke size; list, run, resume and report work."""

import csv
import json
import os
import pickle
import subprocess
import sys

import pytest

from experiments import _registry
from experiments.__main__ import main
from tests import fast_compile

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_reproductions_run_can_be_sent_to_a_worker_process():
  """``--jobs`` sends each reproduction's ``run`` (or ``run_batch``) to spawned processes: it must pickle."""
  for repro in _registry.all_reproductions():
    for what in ("run", "run_batch"):
      function = getattr(repro, what)
      if function is not None:
        assert callable(pickle.loads(pickle.dumps(function))), (repro.name, what)


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

# The reproductions run in groups, each group in one process (``run NAME NAME ...``): a smoke run is mostly
# start-up (importing JAX, matplotlib and scikit-learn: about 5 s) and compilation, so a group pays the
# start-up once, and the programs its reproductions have in common compile once. The default suite runs one
# reproduction per runtime (dj.simulate with a cluster schedule, dj.simulate_gossip, dj.simulate_pipeline);
# the others are marked slow, in seven groups of about equal length (40-56 s each on 2 cores) that the two CI
# workers share.
FAST = ("delay_adaptive", "gossip_adpsgd", "pipeline_bubbles")
SLOW_GROUPS = (
    ("dc_asgd", "staleness_aware", "dssp", "momentum", "dai_staleness", "ksync", "federated", "async_local_sgd"),
    ("dana", "accumulation", "variance_reduction", "generalization", "async_sgdi", "pipeline_dapple",
     "pipeline_decoupled", "digest"),
    ("gossip_topology", "gossip_failures", "gossip_acid", "gossip_dcs3gd", "gossip_layup", "hpsgd", "lasgd", "asap"),
    ("sme", "pipeline_stashing", "pipeline_pipemare", "consistency", "gem", "local_optimizers", "pipeline_2bw",
     "compression"),
    ("streaming_diloco", "weight_prediction", "async_rl"),
    ("psp", "zeno", "hsag", "async_prox", "sketch_project", "crossbow", "aet_sgd", "gossip_unreliable", "gpu_asgd"),
    ("gba", "apam", "gossip_grad", "async_svrg_variants", "saddle_escape", "pisces", "momentum_compensation",
     "coded_gradients"),
)


def test_groups_run_every_reproduction_once():
  # A group of one would not do: `run NAME --out DIR` writes into DIR itself, where the checks look in DIR/NAME.
  grouped = list(FAST) + [name for group in SLOW_GROUPS for name in group]
  assert len(grouped) == len(set(grouped)), "a reproduction is in two smoke groups"
  assert set(grouped) == set(_registry.NAMES), (
      f"add {sorted(set(_registry.NAMES) - set(grouped))} to a group of SLOW_GROUPS (two or more names)")
  assert all(len(group) > 1 for group in SLOW_GROUPS)


def _smoke_run(names: tuple[str, ...], out: str) -> str:
  """``python -m experiments run NAMES... --smoke --out OUT`` in a process of its own; returns what it printed.

  Its XLA compiles quickly (tests/fast_compile.py): a smoke run is almost all compilation, and what is
  checked here (the pipeline runs, writes, resumes and reports) does not depend on the code XLA generates.
  """
  env = fast_compile.child_env(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, "-m", "experiments", "run", *names, "--smoke", "--out", out], env=env,
                        capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


def _check_outputs(name: str, out: str) -> dict:
  """What one reproduction's smoke run wrote: every run's record, the table, the claims, PNG plots."""
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
  return saved


def _runs_resumes_and_reports(names: tuple[str, ...], tmp_path, capsys) -> None:
  printed = _smoke_run(names, str(tmp_path))
  assert printed.count("claims (checked on this run's numbers") == len(names)
  saved = {name: _check_outputs(name, str(tmp_path / name)) for name in names}

  # A second run finds every run finished and performs none.
  assert main(["run", *names, "--smoke", "--out", str(tmp_path), "--no-plot"]) == 0
  assert capsys.readouterr().out.count("\n0 runs performed") == len(names)

  # report rebuilds the same tables from the run records and writes the claims as Markdown.
  for name in names:
    os.remove(tmp_path / name / "results.csv")
  assert main(["report", str(tmp_path), "--no-plot"]) == 0
  with open(tmp_path / "claims.md") as f:
    claims = f.read()
  for name in names:
    assert os.path.exists(tmp_path / name / "results.csv")
    with open(tmp_path / name / "results.json") as f:
      assert json.load(f)["rows"] == saved[name]["rows"]
    assert claims.count(f"| {name} (quick) |") == len(_registry.get(name).claims)


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_one_reproduction_per_runtime_runs_resumes_and_reports(tmp_path, capsys):
  _runs_resumes_and_reports(FAST, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.standard_promotion
@pytest.mark.parametrize("names", SLOW_GROUPS, ids=lambda names: "+".join(names))
def test_reproductions_run_resume_and_report(names, tmp_path, capsys):
  _runs_resumes_and_reports(names, tmp_path, capsys)


@pytest.mark.parametrize("names, message", [
    (["all", "dc_asgd"], "run all takes no other names"),
    (["dc_asgd", "nope"], "unknown reproduction 'nope'"),
    (["dc_asgd", "dssp", "dc_asgd"], "dc_asgd named twice"),
])
def test_run_refuses_bad_names_before_anything_runs(names, message, tmp_path, capsys):
  assert main(["run", *names, "--smoke", "--out", str(tmp_path)]) == 2
  assert message in capsys.readouterr().err
  assert not os.listdir(tmp_path)


def test_report_without_results_fails(tmp_path, capsys):
  assert main(["report", str(tmp_path)]) == 1
  assert "no results.json" in capsys.readouterr().err
