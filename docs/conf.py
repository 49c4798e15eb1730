"""Sphinx configuration of delayjax's documentation site.

Why Sphinx + MyST-NB + the book theme (Optax's toolchain) rather than mkdocs-material + mkdocstrings (Diffrax's):
delayjax's docstrings are written for Sphinx, as Optax's are: reStructuredText ``.. math::`` blocks, ``:func:``
roles, Google-style ``Args:`` sections (napoleon) and doctest ``Examples:``. mkdocstrings reads Markdown and would
show those as raw text. Pages are Markdown (MyST); MyST-NB can render notebooks too. See docs/README.md.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The package and the reproductions are documented from this checkout, whatever is installed.
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(HERE, "_ext"))

import delayjax  # noqa: E402

project = "delayjax"
author = "The delayjax authors"
copyright = "2026, the delayjax authors"
release = version = delayjax.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
    "sphinx_copybutton",
    "delayjax_apigen",
    "delayjax_gallery",
    "delayjax_references",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "_tools", "_ext", "**/.ipynb_checkpoints"]
root_doc = "index"

# Every cross-reference must resolve: the build runs with -W (warnings are errors) and -n (nitpicky). Names of
# other libraries (jax, optax, numpy, ...) have no inventory offline, so type annotations that name them are
# not links; everything in delayjax is.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|numpy|np|jnp|chex|flax|orbax|matplotlib|collections|typing|os|types)\b.*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|NamedTuple|Literal|Optional|Union|Protocol)"),
    (r"py:.*", r"(int|float|bool|str|bytes|tuple|list|dict|object|None|type|complex|slice|Ellipsis)"),
    (r"py:.*", r"(ArrayLike|PyTree|Array|Params|Updates|OptState|PRNGKey|DTypeLike|Shape)"),
    (r"py:.*", r"(pathlib|abc|dataclasses|enum|functools|numbers)\b.*"),
    (r"py:.*", r"(_[A-Za-z].*|.*\._[a-z_]+.*)"),  # private helpers named in annotations
    (r"py:.*", r"(delayjax\..*\.)?[A-Z]$"),  # type variables
]
# A docstring may name a helper that exists but is not public (``check_staleness``): the API extension shows it as
# code, not a link (docs/_ext/delayjax_apigen.py). A name that exists nowhere still fails the build. One docstring
# line reads as "type: description" to napoleon (GossipSchedule.max_lag's first line).
nitpick_ignore = [("py:class", "The largest message lag")]

# Docstrings: Google style, as Optax's.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("References", "notes_style"), ("Semantics", "notes_style"),
                            ("Source", "notes_style"), ("Raises", "params_style")]
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
add_module_names = False
python_use_unqualified_type_names = True

# Notebooks are not executed in the docs build (they run in CI from a built wheel: tests/test_packaging.py).
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# MathJax from a package (django-static-mathjax, in the docs extra) rather than a CDN: the site renders its math
# offline, as the tests render it in headless Chromium on a machine without internet access.
_static_math = os.path.join(HERE, "_build", "_mathjax")


def _vendor_mathjax():
  import mathjax  # django-static-mathjax's package: MathJax 3's distribution files

  source = os.path.join(os.path.dirname(mathjax.__file__), "static", "mathjax", "es5", "tex-svg.js")
  os.makedirs(_static_math, exist_ok=True)
  shutil.copyfile(source, os.path.join(_static_math, "tex-svg.js"))


_vendor_mathjax()
html_static_path = [_static_math]
mathjax_path = "tex-svg.js"

# Claims, settings and docstrings are quoted verbatim (straight quotes, as in the code).
smartquotes = False

html_theme = "sphinx_book_theme"
html_title = "delayjax"
html_theme_options = {
    "repository_url": "https://github.com/delayjax/delayjax",
    "use_repository_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # The download button links the page's source, which the site does not copy (html_copy_source).
    "use_download_button": False,
}
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False
