"""The wheel and sdist a user installs, checked as a user gets them, and every notebook run from the wheel.

The notebooks run as in Colab: a fresh virtual environment with no checkout on its path and nothing but a Jupyter
kernel installed, each notebook executed from its first cell, whose install cell installs delayjax from
``DELAYJAX_SOURCE`` (here the wheel just built). The first notebook's install cell installs the wheel and its
dependencies; later ones find them installed, as a Colab session does after its first notebook.
"""

import email
import glob
import json
import os
import subprocess
import sys
import time
import tomllib
import zipfile

import pytest

from tests import fast_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))

pytestmark = pytest.mark.slow


def _pyproject():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
  """``python -m build`` of this checkout: the sdist, then the wheel built from the sdist."""
  pytest.importorskip("build", reason="the test extra's `build` is not installed (pip install -e '.[test]')")
  out = tmp_path_factory.mktemp("dist")
  subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), ROOT], check=True, capture_output=True)
  wheels, sdists = glob.glob(str(out / "*.whl")), glob.glob(str(out / "*.tar.gz"))
  assert len(wheels) == 1 and len(sdists) == 1, os.listdir(out)
  return wheels[0], sdists[0]


def test_wheel_and_sdist_are_what_pyproject_says(dist):
  wheel, sdist = dist
  twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist], capture_output=True,
                         text=True)
  if "No module named twine" in twine.stderr:
    pytest.skip("the test extra's `twine` is not installed")
  assert twine.returncode == 0, twine.stdout + twine.stderr
  project = _pyproject()
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
  assert "delayjax/py.typed" in names  # type checkers read the package's annotations
  top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  # The reproductions under a name of their own: a top-level `experiments` would shadow a user's own folder.
  assert top == {"delayjax", "delayjax_experiments"}, top
  # Every package of the checkout is in the wheel (pyproject.toml lists them), the reproductions' modules too.
  packages = {os.path.relpath(d, ROOT) for d, _, files in os.walk(os.path.join(ROOT, "delayjax"))
              if "__init__.py" in files}
  assert {p for p in packages if f"{p}/__init__.py" not in names} == set()
  shipped = {n.split("/", 1)[1] for n in names if n.startswith("delayjax_experiments/")}
  assert shipped == {p for p in os.listdir(os.path.join(ROOT, "experiments")) if p.endswith(".py")}, shipped
  assert not [n for n in names if n.startswith(("tests/", "docs/", "colab/")) or "__pycache__" in n]
  urls = dict(v.split(", ", 1) for v in meta.get_all("Project-URL"))
  assert urls == project["urls"]
  assert set(meta.get_all("Classifier")) == set(project["classifiers"])
  assert meta["Keywords"].split(",") == project["keywords"]
  assert set(meta.get_all("Provides-Extra")) >= {"experiments", "test", "docs"}


def _venv(path):
  subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
  python = str(path / "bin" / "python")
  # The kernel only: delayjax and its dependencies come from the notebooks' own install cell.
  subprocess.run([python, "-m", "pip", "install", "-q", "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6.0"],
                 check=True)
  return python


RUNNER = r'''
import json, os, sys, time
import nbclient, nbformat

times = {}
for path in sys.argv[2:]:
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  client = nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": "."}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
  times[os.path.basename(path)] = round(time.perf_counter() - start, 1)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors, (path, errors)
probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
    "import delayjax, delayjax_experiments, sys; print(sys.executable); print(delayjax.__file__); "
    "print(delayjax_experiments.__file__)")])
nbclient.NotebookClient(probe, timeout=120, kernel_name="python3").execute()
where = probe.cells[0].outputs[0]["text"].split()
with open(sys.argv[1], "w") as f:
  json.dump({"times": times, "kernel": where[0], "delayjax": where[1], "experiments": where[2]}, f)
'''


# Minutes of installs and notebook runs: .ci/run runs it in a step of its own (DELAYJAX_WHEEL_NOTEBOOKS=1), so
# that the suite README.md shows stays an edit-test loop.
@pytest.mark.skipif(os.environ.get("DELAYJAX_WHEEL_NOTEBOOKS") != "1",
                    reason="run with DELAYJAX_WHEEL_NOTEBOOKS=1 (a step of its own in .ci/run)")
def test_every_notebook_runs_from_its_first_cell_on_the_wheel(dist, tmp_path):
  wheel, _ = dist
  python = _venv(tmp_path / "venv")
  work = tmp_path / "work"  # the notebooks' working directory: no checkout in it or above it
  work.mkdir()
  runner = tmp_path / "run_notebooks.py"
  runner.write_text(RUNNER)
  report = tmp_path / "report.json"
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}
  env.update(
      DELAYJAX_SOURCE=wheel,
      DELAYJAX_NOTEBOOK_SMOKE="1",  # the shortest run that exercises every cell
      MPLBACKEND="Agg",
      PATH=f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",  # the kernel spec's `python`
      # A smoke-size notebook is almost all compilation (tests/fast_compile.py); what is checked (every cell
      # runs) does not depend on the code XLA generates.
      XLA_FLAGS=fast_compile.FLAGS,
  )
  start = time.perf_counter()
  subprocess.run([python, str(runner), str(report)] + NOTEBOOKS, cwd=work, env=env, check=True)
  result = json.loads(report.read_text())
  venv = str(tmp_path / "venv")
  assert result["kernel"].startswith(venv), result
  assert result["delayjax"].startswith(venv) and result["experiments"].startswith(venv), result
  assert set(result["times"]) == {os.path.basename(p) for p in NOTEBOOKS}
  print(f"notebooks from the wheel ({time.perf_counter() - start:.0f} s with the install):",
        json.dumps(result["times"]))
