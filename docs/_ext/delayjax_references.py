"""The references page, collected at each build from the docstrings' ``References:`` so that it never goes stale.

Every linked citation in a public docstring of delayjax becomes one row: title (linked), authors, year and venue as
the docstring gives them, the delayjax names that cite it, and where the implemented rule comes from. The source is
read from the citing docstrings' own statements (each says in place when only an abstract could be read, or when it
follows the authors' code); ``SOURCES`` records what a docstring does not say in words that can be matched.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAPER, CODE, ABSTRACT = "paper text", "authors' code", "**abstract only**"

# Where a rule comes from when the citing docstrings do not say it in words _source() recognizes. Keyed by link.
SOURCES = {
    "https://arxiv.org/abs/1609.08326": PAPER,  # DC-ASGD: the rule as printed in the paper (Algorithms 1-3)
    "https://arxiv.org/abs/1511.05950": PAPER,
    "https://arxiv.org/abs/1412.6980": PAPER,
    "https://doi.org/10.1145/79173.79181": PAPER,
    "https://papers.nips.cc/paper/4687-large-scale-distributed-deep-networks": PAPER,
    "https://papers.nips.cc/paper/4894-more-effective-distributed-ml-via-a-stale-synchronous-parallel-parameter-server":
        PAPER,
    "https://arxiv.org/abs/1706.02677": PAPER,
    # Standard methods cited beside a construction: the cited method itself is the published one.
    "https://arxiv.org/abs/1212.0901": PAPER,  # Nesterov momentum as Bengio et al. rewrite it
    "https://arxiv.org/abs/1407.0202": PAPER,  # SAGA
    # SVRG and AsySVRG, cited by dj.svrg beside a paper it could read only the abstract of (Zhang, Zheng, Kwok).
    "https://proceedings.neurips.cc/paper_files/paper/2013/hash/ac1dd209cbcc5e5d1c6e28598e8cbbe8-Abstract.html": PAPER,
    "https://doi.org/10.1609/aaai.v30i1.10305": PAPER,
    "https://openreview.net/forum?id=ryQu7f-RZ": PAPER,  # AMSGrad
}

_ABSTRACT_WORDS = re.compile(
    r"only the (?:paper's )?abstract|abstract only|from (?:the|its|their) (?:paper's )?abstract|abstract-level|"
    r"the library's construction|delayjax's construction|could not be (?:confirmed|read|verified)", re.I)
_CODE_WORDS = re.compile(r"authors' (?:reference |simulator )?code|the reference code|checked against the authors",
                         re.I)

_CITATION = re.compile(r"`([^`<]+?)\s*<(https?://[^>\s]+)>`_+")


def _objects():
  """(public name, object) of every documented object of the package: modules, functions and classes."""
  import delayjax

  found = []
  for info in sorted(pkgutil.walk_packages(delayjax.__path__, prefix="delayjax."), key=lambda m: m.name):
    module = importlib.import_module(info.name)
    found.append((info.name, module))
    for name, value in vars(module).items():
      if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == info.name:
        found.append((f"{info.name}.{name}", value))
  return found


def _public_name(obj, fallback: str) -> str:
  """The name a user types for an object (``delayjax.dana``), from the API reference's pages."""
  from delayjax_apigen import MODULES, public_names

  for module_name in MODULES:
    module = importlib.import_module(module_name)
    for name in public_names(module_name):
      if getattr(module, name, None) is obj:
        return f"{module_name}.{name}"
  return fallback


def _source(docs: list[str]) -> str:
  text = re.sub(r"\s+", " ", " ".join(docs))  # a statement may break across the docstring's lines
  kinds = []
  if _ABSTRACT_WORDS.search(text):
    kinds.append(ABSTRACT)
  if _CODE_WORDS.search(text):
    kinds.append(CODE)
  return " and ".join(kinds)


def collect() -> list[dict]:
  """One dict per cited link: title, authors, details (venue, year), year, link, cited_by, source."""
  refs: dict[str, dict] = {}
  for dotted, obj in _objects():
    doc = inspect.getdoc(obj) or ""
    flat = re.sub(r"\s+", " ", doc)
    for match in _CITATION.finditer(flat):
      title, link = match.group(1).strip(), match.group(2).rstrip(".,")
      # A bold note ends its sentence with ".**": without the markers, the authors start after its ". ".
      before = flat[:match.start()].replace("**", "")
      authors = re.split(r"(?:References:|Reference:|\. |; |: |\(|\bsee\b)", before)[-1].strip(" ,")
      after = re.split(r"(?:; |\. (?=[A-Z])|\)|$)", flat[match.end():], maxsplit=1)[0].strip(" ,.")
      after = after.split(" (")[0] if after.count("(") > after.count(")") else after
      year = re.search(r"\b(19[6-9]\d|20[0-3]\d)\b", f"{after} {title}")
      entry = refs.setdefault(link, {"title": title, "authors": authors, "details": after, "link": link,
                                     "year": year.group(1) if year else "", "cited_by": [], "docs": []})
      if not entry["authors"] and authors:
        entry["authors"] = authors
      if not entry["year"] and year:
        entry["year"] = year.group(1)
      public = _public_name(obj, dotted)
      if inspect.ismodule(obj) and "._" in public:
        # A private module's docstring (the pipeline schedules): cited by the package that exports its names.
        public = public.split("._")[0]
      if public not in entry["cited_by"]:
        entry["cited_by"].append(public)
      entry["docs"].append(doc)
  for entry in refs.values():
    entry["source"] = SOURCES.get(entry["link"]) or _source(entry.pop("docs")) or PAPER
    entry.pop("docs", None)
  return sorted(refs.values(), key=lambda e: (e["year"] or "9999", e["title"].lower()))


def _cite(name: str) -> str:
  """A link to the API entry of a citing name; the classes behind the paradigm factories by their short name."""
  if "._" not in name:
    return f"{{py:obj}}`{name}`"
  module_name, _, short = name.rpartition(".")
  obj = getattr(importlib.import_module(module_name), short, None) if importlib.util.find_spec(module_name) else None
  return f"{{py:class}}`{short} <{name}>`" if inspect.isclass(obj) else f"`{name}`"


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def page() -> str:
  refs = collect()
  lines = [
      "# References",
      "",
      "Every paper delayjax implements or builds on, collected from the docstrings of the package (each docstring "
      "states the rule in math and says, in place, what of it could be checked). The last column says where the "
      "implemented rule was taken from: the **paper text**, the **authors' code**, or the **abstract only**, where "
      "nothing more of the paper could be reached; there the docstring says which parts are the library's own "
      "construction. Where a docstring does not say, the rule is the paper's as published.",
      "",
      f"{len(refs)} papers.",
      "",
      "| year | paper | authors | where | implemented as | rule's source |",
      "|---|---|---|---|---|---|",
  ]
  for e in refs:
    cited = ", ".join(_cite(name) for name in e["cited_by"])
    lines.append(f"| {e['year']} | [{_cell(e['title'])}]({e['link']}) | {_cell(e['authors'])} | "
                 f"{_cell(e['details'])} | {cited} | {e['source']} |")
  lines.append("")
  return "\n".join(lines)


def _on_init(app):
  del app
  path = os.path.join(HERE, "references.md")
  text = page()
  if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)


def setup(app):
  app.connect("builder-inited", _on_init)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
