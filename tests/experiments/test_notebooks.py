"""The Colab notebooks: stored without outputs, installed from one variable, opened from a badge built from the home.

That each runs top to bottom from its first cell, installed from a built wheel in a fresh environment as in
Colab, is tests/test_packaging.py.
"""

import glob
import os
import re
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


def _code(path):
  return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _home():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["urls"]["Homepage"]


def _run_install_cell(path, variables):
  """Runs the install cell as on a fresh machine (nothing installed), with pip replaced by a recorder.

  Returns the cell's variables and the pip commands it would have run.
  """
  calls = []

  class Subprocess:
    @staticmethod
    def run(command, check):
      assert check
      calls.append(command)

  class Util:
    @staticmethod
    def find_spec(name):
      return None

  class Importlib:
    util = Util

  class Os:
    environ = dict(variables)
    path = os.path
    sep = os.sep

  source = _code(path)[0]
  imports = "import importlib.util, os, subprocess, sys"
  assert imports in source, f"{path}: the install cell's imports changed; update this test"
  namespace = {"importlib": Importlib, "os": Os, "subprocess": Subprocess, "sys": sys}
  exec(compile(source.replace(imports, ""), path, "exec"), namespace)
  return namespace, calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_installs_from_one_variable_built_from_the_project_home(path, tmp_path):
  namespace, calls = _run_install_cell(path, {})
  assert namespace["HOME"] == _home(), f"{path}: HOME must be pyproject's Homepage {_home()}"
  # The documented default: the project's home as a git URL (not on the package index yet).
  assert namespace["DELAYJAX_SOURCE"] == f"git+{_home()}"
  assert calls and calls[0][-1] == f"delayjax[experiments] @ git+{_home()}", calls
  # A wheel on this machine, as CI and a Colab upload give it, is installed by its file URL.
  wheel = tmp_path / "delayjax-0.1.0-py3-none-any.whl"
  wheel.write_bytes(b"")
  _, calls = _run_install_cell(path, {"DELAYJAX_SOURCE": str(wheel)})
  assert calls[0][-1] == f"delayjax[experiments] @ file://{wheel}"
  # The package name, once published.
  _, calls = _run_install_cell(path, {"DELAYJAX_SOURCE": "delayjax"})
  assert calls[0][-1] == "delayjax[experiments]"
  source = "\n".join(_code(path))
  assert "git clone" not in source and "sys.path" not in source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_has_an_open_in_colab_badge_built_from_the_project_home(path):
  nb = nbformat.read(path, as_version=4)
  first = nb.cells[0]
  assert first.cell_type == "markdown"
  github = _home().split("github.com/", 1)[1]
  url = f"https://colab.research.google.com/github/{github}/blob/main/colab/{os.path.basename(path)}"
  assert first.source.splitlines()[0] == (
      f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_imports_public_names_and_runs_the_paper_scale_only_when_asked(path):
  source = "\n".join(_code(path))
  package = r"(?:delayjax_experiments|delayjax|experiments)"
  private = re.findall(rf"(?:from|import)\s+{package}(?:\.\w+)*\._\w+|"
                       rf"from\s+{package}(?:\.\w+)*\s+import\s+[^\n]*\b_\w+", source)
  assert not private, f"{path} imports private modules: {private}"
  # The reproductions as the wheel installs them: a top-level `experiments` is a user's own folder's name.
  assert not re.findall(r"^\s*(?:from|import)\s+experiments\b", source, re.MULTILINE), path
  if "SCALE" in source:
    assert re.search(r'^SCALE = "quick"', source, re.MULTILINE), f"{path}: SCALE must default to 'quick'"
  assert "default_backend() in" not in source and "ACCELERATOR" not in source, f"{path}: scale chosen by device"
