"""The reproduction framework: runs (config x seed) that resume, claims checked on the numbers, outputs.

A reproduction module builds one :class:`Reproduction`: its paper, its scales
(``quick``: 2-core CPU and bundled data in under two minutes; ``paper``: the
paper's model and data, for a GPU), the grid of run specs a scale asks for,
the function that performs one run, how runs are summarized into table rows,
the paper's claims and its plots. :func:`execute` does the rest the same way
for all of them: a progress bar, one atomically written JSON file per
finished run under ``OUT/runs/`` (a restarted reproduction skips those whose
configuration is unchanged), the results table in the terminal, and
``results.json``, ``results.csv``, ``claims.csv`` and PNG plots in ``OUT``.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Progress = Callable[[int, int], None]  # (done, total) of the current run, for the inner progress bar


class RunProgress:
  """What one run gets from the framework: a progress callback and a folder for mid-run checkpoints.

  Call it with ``(done, total)`` to move the run's progress bar. A run that
  can checkpoint (``dj.simulate``'s ``checkpoint_dir``) writes to
  ``checkpoint_dir``, which is unique to the run's configuration and seed, so
  an interrupted run continues where it stopped; the framework deletes it
  once the run's record is written.
  """

  def __init__(self, bar: Any, checkpoint_dir: str | None):
    self.bar = bar
    self.checkpoint_dir = checkpoint_dir

  def __call__(self, done: int, total: int) -> None:
    self.bar.total = total
    self.bar.n = done
    self.bar.refresh()
Summary = Mapping[str, Mapping[str, Any]]  # row key -> that row's numbers (means over seeds)


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  """A claim checked on a run's own numbers: whether it held and the figures that decided it."""

  held: bool | None  # None: the numbers needed are missing (e.g. a run was left out by --only)
  figures: str


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim of a paper and the check that decides it from the summary of a reproduction.

  ``check`` receives the summary (row key -> numbers, means over seeds) and
  returns a :class:`ClaimResult`; it must compute ``held`` from those numbers.
  """

  name: str
  statement: str
  check: Callable[[Summary], ClaimResult]

  def evaluate(self, summary: Summary) -> ClaimResult:
    try:
      return self.check(summary)
    except KeyError as missing:
      return ClaimResult(None, f"not evaluated: no result for {missing}")


@dataclasses.dataclass(frozen=True)
class Reproduction:
  """What a reproduction module declares; :func:`execute` runs it.

  Attributes:
    name: the CLI name (the module's name).
    paper: authors, title, venue and year.
    description: one line on what is reproduced.
    scales: scale name -> config (a JSON-serializable dict; ``steps`` is the
      length of each run, which ``--steps`` overrides for smoke tests).
    specs: config -> the run specs (dicts with a unique ``"key"``), without seeds.
    run: ``run(config, spec, seed, progress) -> record``, ``progress`` a
      :class:`RunProgress` (a JSON-serializable
      dict with ``"metrics"`` (scalars) and optionally ``"curves"`` (name ->
      list) and ``"staleness_hist"``).
    summarize: ``(config, records) -> rows`` (dicts with a ``"key"``), the
      results table, averaged over seeds; :func:`mean_rows` does the usual.
    claims: the paper's claims.
    plots: ``(config, records, rows, out_dir) -> paths`` of the PNG files written.
    paper_numbers: the paper's own figures, row key -> {column: value}, shown
      side by side with the reproduction's.
    columns: the table's columns (default: every column of the rows).
    smoke: config overrides for ``--smoke`` (a seconds-long run of the whole
      pipeline, for tests): fewer steps, seeds and grid points.
  """

  name: str
  paper: str
  description: str
  scales: Mapping[str, Mapping[str, Any]]
  specs: Callable[[Mapping[str, Any]], list[dict[str, Any]]]
  run: Callable[[Mapping[str, Any], Mapping[str, Any], int, Progress], dict[str, Any]]
  summarize: Callable[[Mapping[str, Any], list[dict[str, Any]]], list[dict[str, Any]]]
  claims: Sequence[Claim]
  plots: Callable[[Mapping[str, Any], list[dict[str, Any]], list[dict[str, Any]], str], list[str]]
  paper_numbers: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
  columns: Sequence[str] = ()
  smoke: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def config_for(repro: Reproduction, scale: str, steps: int | None = None, seeds: int | None = None,
               overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The config of ``scale`` with the ``--set``, ``--steps`` and ``--seeds`` overrides applied."""
  if scale not in repro.scales:
    raise ValueError(f"scale must be one of {sorted(repro.scales)} for {repro.name}, got {scale!r}.")
  config = dict(repro.scales[scale])
  for key, value in (overrides or {}).items():
    if key not in config:
      raise ValueError(f"--set {key}=...: {repro.name} ({scale}) has no such setting; it has {sorted(config)}.")
    config[key] = value
  config["scale"] = scale
  if steps is not None:
    if steps < 1:
      raise ValueError(f"steps must be >= 1, got {steps}.")
    config["steps"] = int(steps)
  if seeds is not None:
    if seeds < 1:
      raise ValueError(f"seeds must be >= 1, got {seeds}.")
    config["seeds"] = int(seeds)
  return config


def fingerprint(*parts: Any) -> str:
  """A short hash of JSON-serializable parts: a finished run is reused only if it matches."""
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_json(path: str, value: Any) -> None:
  """Writes ``value`` as JSON atomically: an interrupted run never leaves a truncated file."""
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(to_json(value), f, indent=1)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def to_json(value: Any) -> Any:
  """NumPy and JAX values as plain JSON types (non-finite floats as None)."""
  if isinstance(value, dict):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
    arr = np.asarray(value)
    return to_json(arr.item()) if arr.ndim == 0 else to_json(arr.tolist())
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else None
  return value


def run_path(out: str, spec_key: str, seed: int) -> str:
  safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in spec_key)
  return os.path.join(out, "runs", f"{safe}__seed{seed}.json")


def execute(repro: Reproduction, config: Mapping[str, Any], out: str, *, first_seed: int = 0,
            only: Sequence[str] | None = None, plots: bool = True, verbose: bool = True) -> dict[str, Any]:
  """Runs every (spec, seed) not already finished in ``out``, then writes the table, claims and plots.

  Returns:
    ``{"config", "rows", "claims", "records", "ran", "reused", "seconds", "files"}``;
    ``ran`` and ``reused`` count the runs performed now and read back.
  """
  from tqdm.auto import tqdm

  specs = repro.specs(config)
  keys = [s["key"] for s in specs]
  if len(set(keys)) != len(keys):
    raise ValueError(f"{repro.name}: run spec keys must be unique, got {keys}.")
  if only:
    specs = [s for s in specs if any(o in s["key"] for o in only)]
  seeds = list(range(first_seed, first_seed + int(config.get("seeds", 1))))
  jobs = [(spec, seed) for spec in specs for seed in seeds]
  records, ran, reused = [], 0, 0
  start = time.perf_counter()
  bar = tqdm(jobs, desc=repro.name, unit="run", file=sys.stderr, disable=not verbose)
  for spec, seed in bar:
    path = run_path(out, spec["key"], seed)
    stamp = fingerprint(config, spec, seed)
    record = _finished(path, stamp)
    if record is None:
      bar.set_postfix_str(f"{spec['key']} seed {seed}")
      inner = tqdm(total=1, desc="  updates", file=sys.stderr, leave=False, disable=not verbose)
      checkpoints = os.path.join(out, "checkpoints", os.path.basename(path)[:-len(".json")] + f"__{stamp}")
      t0 = time.perf_counter()
      record = dict(repro.run(config, spec, seed, RunProgress(inner, checkpoints)))
      inner.close()
      record.update(key=spec["key"], spec=spec, seed=seed, fingerprint=stamp,
                    seconds=time.perf_counter() - t0)
      # Fresh records take the JSON form too, so a resumed run summarizes exactly what a fresh one does.
      record = to_json(record)
      write_json(path, record)
      shutil.rmtree(checkpoints, ignore_errors=True)
      ran += 1
    else:
      reused += 1
    records.append(record)
  bar.close()
  return finish(repro, config, records, out, ran=ran, reused=reused,
                seconds=time.perf_counter() - start, plots=plots, verbose=verbose)


def _finished(path: str, stamp: str) -> dict[str, Any] | None:
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, json.JSONDecodeError):
    return None
  return record if record.get("fingerprint") == stamp else None


def finish(repro: Reproduction, config: Mapping[str, Any], records: list[dict[str, Any]], out: str, *,
           ran: int = 0, reused: int = 0, seconds: float = 0.0, plots: bool = True,
           verbose: bool = True) -> dict[str, Any]:
  """Summarizes records into the table, checks the claims, writes the outputs, prints the table."""
  rows = repro.summarize(config, records)
  summary = {r["key"]: r for r in rows}
  claims = []
  for claim in repro.claims:
    result = claim.evaluate(summary)
    claims.append({"claim": claim.name, "statement": claim.statement,
                   "held": result.held, "figures": result.figures})
  os.makedirs(out, exist_ok=True)
  files = [os.path.join(out, "results.json"), os.path.join(out, "results.csv"), os.path.join(out, "claims.csv")]
  write_json(files[0], {"reproduction": repro.name, "paper": repro.paper, "config": dict(config),
                        "rows": rows, "claims": claims, "paper_numbers": dict(repro.paper_numbers),
                        "run_seconds": sum(float(r.get("seconds", 0.0)) for r in records)})
  write_csv(files[1], rows)
  write_csv(files[2], claims)
  if plots and records:
    files += repro.plots(config, records, rows, out)
  result = {"config": dict(config), "rows": rows, "claims": claims, "records": records, "ran": ran,
            "reused": reused, "seconds": seconds, "files": files}
  if verbose:
    print(render(repro, rows, claims))
    print(f"\n{ran} runs performed, {reused} reused from {os.path.join(out, 'runs')}, {seconds:.1f} s; "
          f"wrote {', '.join(os.path.basename(f) for f in files)} to {out}")
  return result


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
  """Writes rows (dicts) as CSV with the union of their keys as columns, atomically."""
  columns: list[str] = []
  for r in rows:
    columns += [k for k in r if k not in columns and not isinstance(r[k], (list, dict))]
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".csv")
  with os.fdopen(fd, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
      writer.writerow({k: _cell(r.get(k)) for k in columns})
  os.replace(tmp, path)


def _cell(value: Any) -> Any:
  if isinstance(value, float):
    return f"{value:.6g}"
  return "" if value is None else value


def mean_rows(records: list[dict[str, Any]], *, fields: Sequence[str] = ()) -> list[dict[str, Any]]:
  """One row per spec key (in first-seen order): the spec's ``fields`` and each metric's mean and std over seeds.

  A metric ``m`` becomes ``m`` (the mean over seeds: NaN if any seed's value
  is missing or NaN, e.g. a diverged run or a target never reached, so that
  no claim is decided on the lucky seeds alone) and ``m_std`` (over the
  finite values); ``seeds`` counts the records and ``nonfinite`` the most
  seeds any one metric was not finite for.
  """
  groups: dict[str, list[dict[str, Any]]] = {}
  for r in records:
    groups.setdefault(r["key"], []).append(r)
  rows = []
  for key, group in groups.items():
    row: dict[str, Any] = {"key": key}
    for f in fields:
      row[f] = group[0]["spec"].get(f)
    names = list(group[0]["metrics"])
    nonfinite = 0
    for name in names:
      values = np.array([_num(g["metrics"].get(name)) for g in group], dtype=np.float64)
      finite = values[np.isfinite(values)]
      nonfinite = max(nonfinite, int(np.sum(~np.isfinite(values))))
      row[name] = float(values.mean()) if finite.size == values.size else float("nan")
      row[f"{name}_std"] = float(finite.std()) if finite.size else float("nan")
    row["seeds"] = len(group)
    row["nonfinite"] = nonfinite
    rows.append(row)
  return rows


def or_inf(value: Any) -> float:
  """A metric for a "lower is better" comparison: missing or NaN (diverged, never reached) counts as ``inf``."""
  return float("inf") if value is None or math.isnan(float(value)) else float(value)


def _num(value: Any) -> float:
  return float("nan") if value is None else float(value)


def render(repro: Reproduction, rows: list[dict[str, Any]], claims: list[dict[str, Any]]) -> str:
  """The results table and the claims, as plain text for the terminal."""
  lines = [f"\n{repro.name}: {repro.paper}", repro.description, ""]
  columns = list(repro.columns)
  if not columns and rows:
    columns = [k for k in rows[0] if not k.endswith("_std")]
  paper_cols = sorted({c for v in repro.paper_numbers.values() for c in v})
  header = columns + [f"paper {c}" for c in paper_cols]
  table = [[_fmt(r.get(c), r.get(f"{c}_std")) for c in columns]
           + [_fmt(repro.paper_numbers.get(r["key"], {}).get(c)) for c in paper_cols] for r in rows]
  widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(header)]
  lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
  lines.append("  ".join("-" * w for w in widths))
  lines += ["  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
  lines.append("\nclaims (checked on this run's numbers):")
  for c in claims:
    verdict = {True: "HELD", False: "NOT HELD", None: "n/a"}[c["held"]]
    lines.append(f"  [{verdict:>8}] {c['claim']}: {c['statement']}\n             {c['figures']}")
  return "\n".join(lines)


def _fmt(value: Any, std: Any = None) -> str:
  if value is None:
    return "-"
  if isinstance(value, (float, np.floating)):
    if not math.isfinite(value):
      return "nan"
    text = f"{value:.4g}"
    if std is not None and isinstance(std, float) and math.isfinite(std) and std > 0:
      text += f" ±{std:.2g}"
    return text
  return str(value)


def load_results(out: str) -> dict[str, Any]:
  """Reads ``results.json`` written by :func:`finish`."""
  path = os.path.join(out, "results.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{out} holds no results.json; run a reproduction with --out {out} first.")
  with open(path) as f:
    return json.load(f)


def load_records(out: str) -> list[dict[str, Any]]:
  """Every finished run record under ``OUT/runs`` (sorted by file name)."""
  directory = os.path.join(out, "runs")
  if not os.path.isdir(directory):
    return []
  records = []
  for name in sorted(os.listdir(directory)):
    if name.endswith(".json") and not name.startswith("."):
      with open(os.path.join(directory, name)) as f:
        records.append(json.load(f))
  return records
