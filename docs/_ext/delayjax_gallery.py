"""The reproductions gallery, written at each build from the reproductions themselves so that it never goes stale.

One page per name of ``experiments._registry.NAMES``: the paper, what is reproduced, the commands, the quick
scale's settings, the paper's claims as the module states them, the verdicts of the last recorded full run
(``experiments/results/claims_quick.md``, with their intervals and seeds) and the paper's own numbers
(``REPRODUCTION.paper_numbers``), the plots of that recorded run (``experiments/results/plots_quick/NAME/``, copied
beside the page) and where a run writes its own. The pages are written into ``docs/gallery/`` (ignored by git)
before Sphinx reads the sources.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
CLAIMS = os.path.join(ROOT, "experiments", "results", "claims_quick.md")
PLOTS = os.path.join(ROOT, "experiments", "results", "plots_quick")
OUT = os.path.join(HERE, "gallery")


def recorded_claims(path: str = CLAIMS) -> tuple[str, dict[str, list[list[str]]]]:
  """The header paragraph of the recorded claims file and its table rows by reproduction name."""
  if not os.path.exists(path):
    return "", {}
  with open(path, encoding="utf-8") as f:
    text = f.read()
  paragraphs = [p for p in text.split("\n\n") if p.strip() and not p.startswith(("#", "|"))]
  rows: dict[str, list[list[str]]] = {}
  for line in text.splitlines():
    if not line.startswith("| ") or line.startswith(("| reproduction", "|---")):
      continue
    # Cells are split at the pipes that end them; a "|" inside one (a norm) is written escaped, and read back.
    cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
    match = re.match(r"^(\w+)", cells[0])
    if match and len(cells) >= 5:
      rows.setdefault(match.group(1), []).append(cells)
  return (paragraphs[0] if paragraphs else ""), rows


def short_paper(paper: str) -> str:
  """``Zheng, Meng, ...: Title, ICML 2017`` -> ``Zheng et al., ICML 2017``; several papers joined by "; "."""
  out = []
  for part in paper.split("; "):
    authors, sep, rest = part.partition(": ")
    if not sep:
      out.append(re.sub(r"\s*\(.*?\)", "", part))
      continue
    names = [a.strip() for a in authors.split(" (")[0].split(",")]
    if len(names) == 2:
      who = f"{names[0]} & {names[1]}"
    else:
      who = names[0] + (" et al." if len(names) > 2 else "")
    venue = re.sub(r"\s*\(.*?\)", "", rest).rsplit(", ", 1)[-1] if ", " in rest else ""
    out.append(f"{who}, {venue}" if venue else who)
  return "; ".join(out)


def _cell(value) -> str:
  return str(value).replace("|", "\\|").replace("\n", " ")


def _text_cell(value) -> str:
  """A table cell of prose: also its asterisks escaped (``x*``, the optimum, is not emphasis)."""
  return _cell(value).replace("*", "\\*")


def _docstring_intro(module) -> str:
  """The module docstring's first paragraph: what the reproduction does, in the module's own words."""
  doc = (module.__doc__ or "").strip()
  return doc.split("\n\n")[0].replace("\n", " ") if doc else ""


def page(name: str, rows: list[list[str]], run_note: str) -> str:
  module = importlib.import_module(f"experiments.{name}")
  repro = module.REPRODUCTION
  quick = repro.scales.get("quick", {})
  lines = [f"# `{name}`: {short_paper(repro.paper)}", "", f"**Paper:** {repro.paper}", "",
           f"**Reproduced:** {repro.description}", ""]
  intro = _docstring_intro(module)
  if intro:
    lines += [intro, ""]
  lines += ["```bash", f"python -m experiments run {name}                  # quick scale, from a checkout"]
  if "paper" in repro.scales:
    lines += [f"python -m experiments run {name} --scale paper    # the paper's model and data; wants a GPU"]
  lines += ["```", "",
            f"The run writes `results.json`, `results.csv`, `claims.csv` and its PNG plots to "
            f"`results/{name}/quick/`; `python -m experiments report results/{name}/quick` rebuilds them from the "
            f"saved runs. The module `experiments/{name}.py` says why each setting was chosen.", ""]
  if quick:
    lines += ["## Quick-scale settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{k}` | `{_cell(json.dumps(v))}` |" for k, v in quick.items()]
    lines += [""]
  lines += ["## The paper's claims", ""]
  if rows:
    lines += [run_note, "", "| claim | verdict | mean [95% interval], seeds | figures |", "|---|---|---|---|"]
    lines += [f"| {_text_cell(r[1])} | {r[2]} | {r[3]} | {_text_cell(r[4])} |" for r in rows]
  else:
    lines += ["The last recorded full run has no row for this reproduction; its claims, as the module states "
              "them:", ""]
    lines += [f"- {_cell(c.statement)}" for c in repro.claims]
  lines += [""]
  if repro.paper_numbers:
    columns = sorted({c for v in repro.paper_numbers.values() for c in v})
    lines += ["## The paper's own numbers", "", "| row | " + " | ".join(columns) + " |",
              "|---|" + "---|" * len(columns)]
    for key, values in repro.paper_numbers.items():
      lines += [f"| `{key}` | " + " | ".join(_cell(values.get(c, "")) for c in columns) + " |"]
    lines += [""]
  lines += ["## Plots", ""]
  plots = recorded_plots(name)
  if plots:
    lines += ["From the recorded full run whose verdicts are above (`experiments/results/plots_quick/"
              f"{name}/`):", ""]
    lines += [f"![{name}: {os.path.splitext(plot)[0]}]({name}/{plot})" for plot in plots]
    lines += [""]
  lines += [f"`python -m experiments run {name}` draws them from the run's own numbers and writes them as "
            f"`results/{name}/quick/*.png`, beside `results.csv`.", ""]
  return "\n".join(lines)


def recorded_plots(name: str) -> list[str]:
  """The PNG files the recorded full run drew for ``name`` (``experiments/results/plots_quick/NAME/``), sorted."""
  folder = os.path.join(PLOTS, name)
  return sorted(p for p in os.listdir(folder) if p.endswith(".png")) if os.path.isdir(folder) else []


def write_gallery(out: str = OUT) -> list[str]:
  """Writes the gallery's pages; returns the names, in the registry's order."""
  from experiments import _registry

  note, rows = recorded_claims()
  run_note = (f"Verdicts of the last recorded full run (`experiments/results/claims_quick.md`): {note}" if note else
              "Verdicts of the last recorded full run (`experiments/results/claims_quick.md`).")
  os.makedirs(out, exist_ok=True)
  names = list(_registry.NAMES)
  for stale in os.listdir(out):
    if stale.endswith(".md") and stale[:-3] not in names + ["index"]:
      os.remove(os.path.join(out, stale))
  for name in names:
    _write(os.path.join(out, f"{name}.md"), page(name, rows.get(name, []), run_note))
    # The recorded plots beside the page, so that its images are inside the documentation's sources.
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    for plot in recorded_plots(name):
      os.makedirs(os.path.join(out, name), exist_ok=True)
      shutil.copyfile(os.path.join(PLOTS, name, plot), os.path.join(out, name, plot))
  index = ["# Reproductions gallery", "",
           "Each reproduction is one module of the repository's `experiments/` folder, which the wheel installs as "
           "`delayjax_experiments`. `python -m experiments list` names them in a checkout "
           "(`python -m delayjax_experiments list` from an install), and `python -m experiments run NAME` "
           "runs one at quick scale on a laptop's CPU: a results table, the paper's claims checked on the run's "
           "own numbers over seeds (held / not held / inconclusive, with a 95% interval), and plots.", "",
           "| reproduction | paper | what is reproduced |", "|---|---|---|"]
  for name in names:
    repro = importlib.import_module(f"experiments.{name}").REPRODUCTION
    index.append(f"| [`{name}`]({name}.md) | {_cell(repro.paper)} | {_cell(repro.description)} |")
  index += ["", "```{toctree}", ":hidden:", ""] + names + ["```", ""]
  _write(os.path.join(out, "index.md"), "\n".join(index))
  return names


def _write(path: str, text: str) -> None:
  # Rewritten only when it changed, so that Sphinx rereads only what changed.
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if f.read() == text:
        return
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def home() -> str:
  """The project's home, pyproject.toml's Homepage: the one place the notebooks and their badges take it from."""
  import tomllib

  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["urls"]["Homepage"]


def colab_url(notebook: str) -> str:
  """The "Open in Colab" address of ``colab/NAME.ipynb`` in the project's GitHub home."""
  github = home().split("github.com/", 1)[1].rstrip("/")
  return f"https://colab.research.google.com/github/{github}/blob/main/colab/{notebook}"


def notebooks_page() -> str:
  import nbformat

  lines = ["# Notebooks", "",
           "The notebooks in `colab/` run top to bottom in Colab and in CI, which builds a wheel, installs it into a "
           "fresh environment and runs each from its first cell. Their first cell installs delayjax from one "
           "variable, `DELAYJAX_SOURCE`: delayjax is not on the package index yet and its GitHub home is not "
           "published yet, so in Colab build a wheel in a checkout (`python -m build`), upload it and set "
           "`DELAYJAX_SOURCE` to its path before running the first cell. They run the quick scale unless you set "
           "`SCALE = \"paper\"`.", "",
           "| notebook | what it shows | |", "|---|---|---|"]
  for path in sorted(os.listdir(os.path.join(ROOT, "colab"))):
    if not path.endswith(".ipynb"):
      continue
    nb = nbformat.read(os.path.join(ROOT, "colab", path), as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    title = next((ln[2:] for ln in (markdown[0] if markdown else "").splitlines() if ln.startswith("# ")), path)
    lines.append(f"| `colab/{path}` | {_cell(title)} | [Open in Colab]({colab_url(path)}) |")
  return "\n".join(lines + [""])


def _on_init(app):
  del app
  write_gallery()
  _write(os.path.join(HERE, "notebooks.md"), notebooks_page())


def setup(app):
  app.connect("builder-inited", _on_init)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
