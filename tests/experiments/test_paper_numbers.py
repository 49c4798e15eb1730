"""The papers' own numbers (``Reproduction.paper_numbers``) sit on rows the reproduction produces.

The results table prints a paper number on the row whose key it names; a spec renamed without its paper number
would leave the number on no row, silently. Each key must be a row key of the quick scale's specs, or of another
scale's where the paper's setting only runs there (DC-ASGD's M = 4 is a paper-scale row: the quick scale runs
M = 16 and 32).
"""

import dataclasses
import math

import pytest

from experiments import _framework, _registry


def orphans(repro: _framework.Reproduction) -> list[str]:
  """The paper_numbers rows that no scale's specs produce."""
  keys = set()
  for scale in repro.scales:
    keys |= {s["key"] for s in repro.specs(_framework.config_for(repro, scale))}
  return sorted(set(repro.paper_numbers) - keys)


@pytest.mark.parametrize("name", _registry.NAMES)
def test_every_paper_number_names_a_row_the_specs_produce(name):
  repro = _registry.get(name)
  assert not orphans(repro), f"{name}: paper_numbers rows {orphans(repro)} are not spec keys of any scale"


@pytest.mark.parametrize("name", _registry.NAMES)
def test_every_paper_number_is_a_finite_number_under_a_named_column(name):
  for key, columns in _registry.get(name).paper_numbers.items():
    assert columns, f"{name}: paper_numbers[{key!r}] names no column"
    for column, value in columns.items():
      assert isinstance(column, str) and column, f"{name}: paper_numbers[{key!r}] has column {column!r}"
      assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
          f"{name}: paper_numbers[{key!r}][{column!r}] = {value!r}"


def test_a_renamed_spec_orphans_its_paper_number():
  """The check catches what it is for: the same reproduction with one spec key renamed fails it."""
  repro = _registry.get("dc_asgd")
  assert "asgd-M4" in repro.paper_numbers

  def renamed_specs(config):
    return [{**s, "key": s["key"].replace("asgd-M4", "asgd-w4")} for s in repro.specs(config)]

  assert orphans(dataclasses.replace(repro, specs=renamed_specs)) == ["asgd-M4"]


@pytest.mark.parametrize("name", _registry.NAMES)
def test_every_reproduction_shows_the_papers_numbers_or_says_why_not(name):
  """Issue 28: the paper's own numbers beside ours wherever the paper gives them; a module without any says why
  (only the abstract was reachable, or the paper gives no figure for a setting a row stands for)."""
  import importlib
  import inspect

  repro = _registry.get(name)
  # The reproduction's own module: its run may come from a shared one (experiments/_gossip_train.py).
  source = inspect.getsource(importlib.import_module(f"experiments.{name}"))
  assert repro.paper_numbers or "# No paper_numbers: " in source, (
      f"{name}: no paper_numbers and no '# No paper_numbers: <why>' comment where its Reproduction is built")
