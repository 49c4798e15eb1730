"""The API reference, generated from the package itself so that it never goes stale.

``.. delayjax-api:: delayjax.cluster`` expands into the module's docstring and one autodoc entry for each of its
public names: the module's ``__all__`` or, for a module without one, the names it defines. A name is described on
one page only (where it is first public: ``delayjax`` before ``delayjax.runtime`` and ``delayjax.transforms``), so
that every cross-reference has exactly one target; the other pages link to it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

# The pages of the reference, in the order the site shows them; an object is described on the first that
# exports it.
MODULES = (
    "delayjax",
    "delayjax.workers",
    "delayjax.delays",
    "delayjax.cluster",
    "delayjax.topology",
    "delayjax.gossip",
    "delayjax.runtime",
    "delayjax.transforms",
    "delayjax.analysis",
    "delayjax.problems",
)


def public_names(module_name: str) -> list[str]:
  """The public names of a module: its ``__all__``, else what it defines (not what it imports)."""
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n, v in vars(module).items()
             if not n.startswith("_") and getattr(v, "__module__", None) == module_name
             and (inspect.isfunction(v) or inspect.isclass(v))]
  return [n for n in names if not n.startswith("__")]


def _home(obj):
  """Where an object is described: the first page of MODULES that exports it (by identity)."""
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    if any(getattr(module, n, None) is obj for n in public_names(module_name)):
      return module_name
  return None


def _is_namedtuple(cls) -> bool:
  return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _attributes_section(cls) -> list[str]:
  """The names an ``Attributes:`` section of a class docstring describes."""
  doc = inspect.getdoc(cls) or ""
  names, inside, indent = [], False, None
  for line in doc.splitlines():
    if re.match(r"^\s*Attributes\b.*:\s*$", line) or re.search(r"\.\s+Attributes:\s*$", line):
      inside, indent = True, None
      continue
    if not inside or not line.strip():
      continue
    here = len(line) - len(line.lstrip())
    indent = here if indent is None else indent
    if here < indent:
      inside = False
      continue
    match = re.match(r"^\s*(\w+(?:,\s*\w+)*)\s*(?:\(.*\))?:", line)
    if here == indent and match:
      names += [n.strip() for n in match.group(1).split(",")]
  return [n for n in names if hasattr(cls, n)]


def _classes_behind(module_name: str) -> list[str]:
  """Classes of a package's private modules (in their ``__all__``) that the package does not export.

  The synchronization paradigms are such classes: ``dj.cluster.ssp(3)`` returns an ``SSP``, whose docstring holds
  the rule; the factory's says "see SSP".
  """
  package = importlib.import_module(module_name)
  if not hasattr(package, "__path__"):
    return []
  found = []
  for sub, module in sorted(sys.modules.items()):
    if not sub.startswith(module_name + "._") or sub.count(".") != module_name.count(".") + 1:
      continue
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name, None)
      if inspect.isclass(obj) and obj.__module__ == sub and _home(obj) is None:
        found.append(f"{sub}.{name}")
  return found


def entries(module_name: str) -> list[str]:
  """reStructuredText for a module's page."""
  module = importlib.import_module(module_name)
  lines = [f".. automodule:: {module_name}", "", f".. currentmodule:: {module_name}", ""]
  described, elsewhere, submodules = [], [], []
  for name in public_names(module_name):
    obj = getattr(module, name)
    if inspect.ismodule(obj):
      submodules.append(obj.__name__)
    elif (inspect.isfunction(obj) or inspect.isclass(obj)) and _home(obj) != module_name:
      elsewhere.append((name, _home(obj)))
    else:
      described.append((name, obj))
  if submodules:
    lines += ["**Modules:** " + ", ".join(f":mod:`{m}`" for m in submodules), ""]
  for name, obj in described:
    if inspect.isclass(obj):
      if _is_namedtuple(obj):
        # A state's fields are described in its docstring; the generated "Alias for field number" lines are noise.
        lines += [f".. autoclass:: {name}", ""]
      else:
        lines += [f".. autoclass:: {name}", "   :members:"]
        documented = _attributes_section(obj)
        if documented:
          # Named in the docstring's Attributes section already, with a description there.
          lines += ["   :exclude-members: " + ", ".join(documented)]
        lines += [""]
    elif inspect.isfunction(obj) or callable(obj):
      lines += [f".. autofunction:: {name}", ""]
    else:
      lines += [f".. autodata:: {name}", "   :annotation:", ""]
  behind = _classes_behind(module_name)
  if behind:
    lines += ["The classes behind the factories", "--------------------------------", "",
              "What the factories above return; their docstrings state each rule in full.", ""]
    for qualified in behind:
      lines += [f".. autoclass:: {qualified}", ""]
  if elsewhere:
    links = ", ".join(f":obj:`{name} <{home}.{name}>`" for name, home in elsewhere)
    lines += [f"Also public here, described on their own pages: {links}.", ""]
  return lines


class ApiDirective(SphinxDirective):
  required_arguments = 1
  has_content = False

  def run(self):
    module_name = self.arguments[0]
    if module_name not in MODULES:
      raise self.error(f"delayjax-api: {module_name!r} is not one of the reference's modules {MODULES}")
    container = nodes.section()
    container.document = self.state.document
    self.state.nested_parse(StringList(entries(module_name), source=f"<api {module_name}>"), self.content_offset,
                            container, match_titles=True)
    return container.children


def _resolve(app, env, node, contnode):
  """Resolves a reference to a public delayjax object by name, wherever it is described.

  A docstring names an object as its own module sees it (``:func:`saga``` in ``delayjax.transforms``,
  ``:func:`delayjax.transforms.prox_l1```), while the reference describes it once, on its home page
  (``delayjax.saga``). The object is found by identity and the reference pointed at its home.
  """
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"].lstrip("~.")
  context = node.get("py:module") or "delayjax"
  if target.startswith("delayjax."):
    candidates = [target]
  else:
    # As its own module sees it, then as the page's module does, then wherever a module exports that name.
    head = target.split(".")[-2:] if _member_of_class(f"{context}.{target}") else target.split(".")[-1:]
    name = ".".join(head)
    candidates = [f"{context}.{target}", f"{context}.{name}", f"delayjax.{target}"]
    candidates += [f"{m}.{name}" for m in MODULES if name.split(".")[0] in public_names(m)]
  domain = env.get_domain("py")
  candidates += _private_definitions(target.split(".")[-1])
  fallback = None
  for candidate in candidates:
    obj = _lookup(candidate)
    if obj is None:
      continue
    top = _lookup_top(candidate)
    home = _home(top)
    if home is None:
      # A class that no package exports: described under its defining module if a page shows it (the classes
      # behind the paradigm factories), else the reference goes to its public base class.
      found = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], candidate, node, contnode)
      if found is not None:
        return found
      if fallback is None and inspect.isclass(top) and node["reftype"] in ("class", "obj"):
        base = next((b for b in top.__mro__[1:] if _home(b) is not None), None)
        fallback = base and f"{_home(base)}.{base.__name__}"
      continue
    owner = candidate.rsplit(".", 2 if _member_of_class(candidate) else 1)[0]
    qualified = home + candidate[len(owner):]
    found = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], qualified, node, contnode)
    if found is not None:
      return found
  if fallback is not None:
    return domain.resolve_xref(env, node["refdoc"], app.builder, "class", fallback, node, contnode)
  if any(_lookup(c) is not None for c in candidates) or _private_definitions(target.split(".")[-1], functions=True):
    # A helper that exists but is not public (``check_staleness``, ``server_versions_behind``): shown as code,
    # not a link. A name that does not exist at all is still an unresolved reference, and fails the build.
    return contnode
  return None


def _private_definitions(name, functions=False):
  """Where a class (or function) of that name is defined in a private module of delayjax."""
  found = []
  for module_name, module in list(sys.modules.items()):
    obj = getattr(module, name, None) if module_name.startswith("delayjax.") else None
    if (inspect.isclass(obj) or functions and inspect.isfunction(obj)) and obj.__module__ == module_name:
      found.append(f"{module_name}.{name}")
  return found


def _lookup(dotted):
  """The object a dotted name imports to, or None."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    try:
      for attr in parts[cut:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


def _member_of_class(dotted):
  parts = dotted.rsplit(".", 1)
  return len(parts) == 2 and inspect.isclass(_lookup(parts[0]))


def _lookup_top(dotted):
  """The described object of a name: the class for a method or attribute of a class, else the object."""
  return _lookup(dotted.rsplit(".", 1)[0]) if _member_of_class(dotted) else _lookup(dotted)


_SECTION_NOTE = re.compile(r"^(\s*)(Attributes|Args|Returns|Raises) \((.+)\):\s*$")
_SECTION_AFTER_SENTENCE = re.compile(r"^(\s*)(.*\S[.:])\s+(Attributes|Args|Returns|Raises):\s*$")


def _sections(app, what, name, obj, options, lines):
  """Lets a Google-style section header carry a note, as some of the docstrings write them.

  ``Attributes (N = ...):`` becomes the note as a sentence and then ``Attributes:``; a header that ends a
  sentence's line (``Build it with :func:`workers`. Attributes:``) is moved to a line of its own. Napoleon
  recognizes only a bare header on its own line, and read the rest as an indented quotation.
  """
  del app, what, name, obj, options
  out, pending = [], None
  for line in lines:
    # A note that goes on over several lines is joined until the header's closing "):".
    if pending is not None:
      line = pending + " " + line.strip()
      pending = None
    if re.match(r"^\s*(Attributes|Args|Returns|Raises) \(", line) and not line.rstrip().endswith("):"):
      pending = line.rstrip()
      continue
    note, after = _SECTION_NOTE.match(line), _SECTION_AFTER_SENTENCE.match(line)
    if note:
      indent, header, text = note.groups()
      out += [f"{indent}{text[0].upper()}{text[1:]}.", "", f"{indent}{header}:"]
    elif after:
      indent, sentence, header = after.groups()
      out += [f"{indent}{sentence}", "", f"{indent}{header}:"]
    else:
      out.append(line)
  if pending is not None:
    out.append(pending)
  lines[:] = out


def setup(app):
  app.connect("autodoc-process-docstring", _sections, priority=400)
  app.add_directive("delayjax-api", ApiDirective)
  app.connect("missing-reference", _resolve)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
