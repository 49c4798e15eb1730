"""Every ``Examples:`` block in the package's docstrings runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import delayjax

MODULES = sorted(m.name for m in pkgutil.walk_packages(delayjax.__path__, prefix="delayjax."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name}"


def test_the_examples_are_collected():
  attempted = sum(doctest.testmod(importlib.import_module(n), report=False).attempted for n in
                  ("delayjax.delays", "delayjax.runtime._delayed", "delayjax.transforms._staleness",
                   "delayjax.transforms._dc_asgd"))
  assert attempted >= 10
