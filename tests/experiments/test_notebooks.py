"""Every Colab notebook runs top to bottom (at smoke size) without an error, and is stored without outputs."""

import glob
import os
import re
import subprocess
import sys
import tomllib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))


def test_there_are_notebooks():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "cluster_tour.ipynb", "dc_asgd.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stripped(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{path}: outputs not stripped"


def _installed_root():
  """The checkout that ``import experiments`` finds outside any checkout (None if it is not installed)."""
  found = subprocess.run(
      [sys.executable, "-c", "import experiments, os; print(os.path.dirname(os.path.dirname(experiments.__file__)))"],
      cwd=os.path.expanduser("~"), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
      capture_output=True, text=True)
  return os.path.realpath(found.stdout.strip()) if found.returncode == 0 else None


def _code(path):
  return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_installs_from_the_project_home(path):
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    home = tomllib.load(f)["project"]["urls"]["Homepage"]
  install = _code(path)[0]
  assert f'HOME = "{home}"' in install, f"{path}: the first cell must install from pyproject's Homepage {home}"
  assert 'f"delayjax[experiments] @ git+{HOME}"' in install
  assert "git clone" not in install and "sys.path" not in install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_imports_public_names_and_runs_the_paper_scale_only_when_asked(path):
  source = "\n".join(_code(path))
  private = re.findall(r"(?:from|import)\s+(?:delayjax|experiments)(?:\.\w+)*\._\w+|"
                       r"from\s+(?:delayjax|experiments)(?:\.\w+)*\s+import\s+[^\n]*\b_\w+", source)
  assert not private, f"{path} imports private modules: {private}"
  if "SCALE" in source:
    assert re.search(r'^SCALE = "quick"', source, re.MULTILINE), f"{path}: SCALE must default to 'quick'"
  assert "default_backend() in" not in source and "ACCELERATOR" not in source, f"{path}: scale chosen by device"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  monkeypatch.setenv("DELAYJAX_NOTEBOOK_SMOKE", "1")
  # The kernel imports delayjax and experiments as installed (`pip install -e ".[test]"`), as a user's
  # notebook does, so the install cell is skipped. Only a second checkout beside the installed one (a git
  # worktree) is put on the path, so that it tests its own code.
  if _installed_root() == os.path.realpath(ROOT):
    monkeypatch.delenv("PYTHONPATH", raising=False)
  else:
    monkeypatch.setenv("PYTHONPATH", ROOT)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # The kernel's XLA compiles without backend optimization: a smoke-size notebook is almost all compilation,
  # which this halves, and what is checked here (every cell runs, nothing warns) does not depend on it.
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  monkeypatch.chdir(tmp_path)
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert not [o for o in outputs if o.get("name") == "stderr" and "TqdmWarning" in o.get("text", "")]
