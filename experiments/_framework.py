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
import gc
import hashlib
import itertools
import json
import math
import numbers
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

Progress = Callable[[int, int], None]  # (done, total) of the current run, for the inner progress bar

# Seconds of a run between two of its checkpoint writes (--checkpoint-every). A write costs about 0.15 s on a
# CPU, more than a quick-scale run's chunk: after every chunk, writes took 0.55-0.7 s of dc_asgd's 0.8-1.6 s
# runs. An interrupted run loses at most this much work; its results do not depend on it.
CHECKPOINT_EVERY = 10.0


class RunProgress:
  """What one run gets from the framework: a progress callback and a folder for mid-run checkpoints.

  Call it with ``(done, total)`` to move the run's progress bar. A run that
  can checkpoint (``dj.simulate``'s ``checkpoint``) writes to
  ``checkpoint_dir``, which is unique to the run's configuration and seed, so
  an interrupted run continues where it stopped; the framework deletes it
  once the run's record is written. It writes at most once every
  ``checkpoint_every`` seconds (``dj.Checkpoint``'s ``min_interval``; ``0``:
  after every chunk).
  """

  def __init__(self, bar: Any, checkpoint_dir: str | None, checkpoint_every: float = CHECKPOINT_EVERY):
    self.bar = bar
    self.checkpoint_dir = checkpoint_dir
    self.checkpoint_every = checkpoint_every

  def __call__(self, done: int, total: int) -> None:
    self.bar.total = total
    self.bar.n = done
    self.bar.refresh()


def remembered(store: dict[Any, Any], key: Any, make: Callable[[], Any], kept: int | None = None) -> Any:
  """``store[key]``, made by ``make()`` the first time it is asked for; with ``kept``, the oldest entries are
  dropped so that at most ``kept`` remain.

  What a run builds once per process and its neighbours reuse: a reproduction's schedules, which are each run's
  own and the ``dj.Execution(like=...)`` of the others.
  """
  if key not in store:
    while kept is not None and len(store) >= kept:
      store.pop(next(iter(store)))
    store[key] = make()
  return store[key]


Summary = Mapping[str, Mapping[str, Any]]  # row key -> that row's numbers (means over seeds)


class UsageError(ValueError):
  """A bad setting, option or file given to the experiments; the CLI prints its message, not a traceback."""


# ---------------------------------------------------------------- statistics: claims decided over seeds

VERDICTS = ("held", "not held", "inconclusive", "not evaluated")
CONFIDENCE = 0.95  # two-sided level of every interval; a verdict needs the whole interval on one side


def t_quantile(confidence: float, df: int) -> float:
  """The ``t`` with ``P(|T| <= t) = confidence`` for Student's t with ``df`` degrees of freedom (e.g. 2.776 for
  0.95 and 4), from ``scipy.stats.t``."""
  from scipy import stats

  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
  if isinstance(df, bool) or not isinstance(df, int) or df < 1:
    raise ValueError(f"df must be a positive integer, got {df!r}.")
  return float(stats.t.ppf(0.5 + confidence / 2.0, df))


def binomial_tail(k: int, n: int) -> float:
  """``P(X >= k)`` for ``X ~ Binomial(n, 1/2)``: the one-sided p-value of ``k`` of ``n`` signs (sign test)."""
  from scipy import stats

  # sf(k - 1) = P(X > k - 1) = P(X >= k); 1 for k <= 0.
  return float(stats.binom.sf(k - 1, n, 0.5))


@dataclasses.dataclass(frozen=True)
class Comparison:
  """The per-seed difference ``a - b`` (or the values ``a`` alone) against a claimed side of ``margin``.

  ``verdict``: ``"held"`` when the whole confidence interval of the mean
  lies on the claimed side, ``"not held"`` when it lies on the opposite side
  (the opposite is significant), ``"inconclusive"`` otherwise (within the
  noise: any tie, and any comparison of a single seed), ``"not evaluated"``
  when no seed has both values.
  """

  verdict: str
  what: str  # what the difference is, e.g. "error of dc-asgd-a-M4 - asgd-M4 (points)"
  n: int  # seeds compared
  mean: float  # mean over the seeds (NaN when a sign test decided)
  low: float  # the confidence interval of the mean (NaN when a sign test decided)
  high: float
  test: str  # "paired t", "sign" or "none"
  note: str = ""  # the sign test's count and p-value, or why there is no interval

  def text(self) -> str:
    if self.test == "paired t":
      return (f"{self.what}: {self.mean:+.4g} [{self.low:+.4g}, {self.high:+.4g}] "
              f"({CONFIDENCE:.0%} interval, {self.n} seed{'s' if self.n != 1 else ''})")
    return f"{self.what}: {self.note}"


def compare(a: Mapping[Any, Any] | Sequence[Any], b: Mapping[Any, Any] | Sequence[Any] | None = None, *,
            claim: str = "less", margin: float = 0.0, what: str = "difference", censor: float | None = None,
            confidence: float = CONFIDENCE) -> Comparison:
  """Decides a claim on per-seed values: a paired t interval of ``a - b`` (or of ``a``), or a sign test.

  Args:
    a, b: per-seed values, ``{seed: value}`` (paired on the seeds both have)
      or equal-length sequences (paired by position); ``b=None`` compares
      ``a`` itself with ``margin``. ``None`` and NaN mean missing (that seed
      is left out); ``inf`` means infinitely bad (never reached, diverged).
    claim: ``"less"`` (the claim is ``a - b < margin``), ``"greater"``
      (``a - b > margin``) or ``"within"`` (``|a - b| < margin``).
    censor: a finite value that replaces ``+inf`` (and ``-censor`` for
      ``-inf``) before the t interval, e.g. the run's budget for a target
      never reached within it: a lower bound of the true value, so the
      difference it gives is conservative. Without it, infinite values are
      decided by an exact sign test on the signs of ``a - b - margin`` (ties
      left out), held or not held when its one-sided p-value is at most
      ``(1 - confidence) / 2``, which takes at least 6 seeds at 95%.
    confidence: the two-sided level of the interval.
  """
  if claim not in ("less", "greater", "within"):
    raise ValueError(f"claim must be 'less', 'greater' or 'within', got {claim!r}.")
  pairs = _paired_values(a, b)
  if censor is not None:
    pairs = [(_censored(x, censor), _censored(y, censor)) for x, y in pairs]
  pairs = [(x, y) for x, y in pairs if not (math.isnan(x) or math.isnan(y))]
  n = len(pairs)
  if n == 0:
    return Comparison("not evaluated", what, 0, math.nan, math.nan, math.nan, "none", "no seed has both values")
  diffs = [x - y for x, y in pairs]
  if all(math.isfinite(d) for d in diffs):
    mean = sum(diffs) / n
    if n < 2:
      return Comparison("inconclusive", what, n, mean, -math.inf, math.inf, "paired t",
                        "one seed: no interval")
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    if claim == "less":
      verdict = "held" if high < margin else "not held" if low > margin else "inconclusive"
    elif claim == "greater":
      verdict = "held" if low > margin else "not held" if high < margin else "inconclusive"
    else:
      verdict = ("held" if -margin < low and high < margin else
                 "not held" if low > margin or high < -margin else "inconclusive")
    return Comparison(verdict, what, n, mean, low, high, "paired t")
  if claim == "within":  # an infinite difference is outside any band
    favour = sum(1 for d in diffs if abs(d) < margin)
    outside = sum(1 for d in diffs if abs(d) >= margin)
  else:
    shifted = [d - margin for d in diffs if not math.isnan(d) and d != margin]
    favour = sum(1 for d in shifted if (d < 0) == (claim == "less"))
    outside = len(shifted) - favour
  m = favour + outside
  alpha = (1.0 - confidence) / 2.0
  p_held, p_not = binomial_tail(favour, m), binomial_tail(outside, m)
  verdict = "held" if m and p_held <= alpha else "not held" if m and p_not <= alpha else "inconclusive"
  note = (f"{favour} of {m} seeds on the claimed side (sign test, one-sided p = {min(p_held, 1.0):.3g}; "
          f"{n - m} ties)") if m else f"all {n} seeds tie"
  return Comparison(verdict, what, n, math.nan, math.nan, math.nan, "sign", note)


def _paired_values(a: Any, b: Any) -> list[tuple[float, float]]:
  if isinstance(a, Mapping):
    if b is None:
      return [(_num(a[s]), 0.0) for s in sorted(a, key=str)]
    if not isinstance(b, Mapping):
      raise TypeError("a and b must both be {seed: value} mappings or both sequences.")
    return [(_num(a[s]), _num(b[s])) for s in sorted(set(a) & set(b), key=str)]
  a = list(a)
  if b is None:
    return [(_num(x), 0.0) for x in a]
  if isinstance(b, Mapping):
    raise TypeError("a and b must both be {seed: value} mappings or both sequences.")
  b = list(b)
  if len(a) != len(b):
    raise ValueError(f"a and b must have the same length, got {len(a)} and {len(b)}.")
  return [(_num(x), _num(y)) for x, y in zip(a, b)]


def _censored(value: float, censor: float) -> float:
  return censor if value == math.inf else -censor if value == -math.inf else value


def combined_verdict(comparisons: Sequence[Comparison]) -> str:
  """The verdict of "all of these": not held if any is, then not evaluated, inconclusive, held."""
  verdicts = [c.verdict for c in comparisons]
  for verdict in ("not held", "not evaluated", "inconclusive"):
    if verdict in verdicts:
      return verdict
  return "held" if verdicts else "not evaluated"


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  """A claim checked on a run's own numbers: its verdict and the figures that decided it.

  Build it with :meth:`decide` from :class:`Comparison` s; ``ClaimResult(held,
  figures)`` (a verdict without statistics) is kept for claims that are
  decided without seeds, such as a missing result (``held=None``).
  """

  held: bool | None  # True: held, False: not held, None: inconclusive or not evaluated (see verdict)
  figures: str
  verdict: str = ""  # one of VERDICTS; derived from held when empty
  comparison: Comparison | None = None  # the comparison that decided the verdict (its interval is shown)

  def __post_init__(self):
    if not self.verdict:
      object.__setattr__(self, "verdict", {True: "held", False: "not held", None: "not evaluated"}[self.held])
    if self.verdict not in VERDICTS:
      raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}.")

  @classmethod
  def decide(cls, comparisons: Comparison | Sequence[Comparison], figures: str = "") -> "ClaimResult":
    """The claim holds if every comparison holds; it is not held if any is significantly the opposite.

    The comparison shown is the one that decided: the first opposite one, else
    the first undecided one, else the held one whose interval is nearest its margin.
    """
    comparisons = [comparisons] if isinstance(comparisons, Comparison) else list(comparisons)
    if not comparisons:
      # e.g. a trend over M when the grid (a smoke run, --only) kept one M.
      return cls(None, f"not evaluated: this grid leaves nothing to compare{'; ' if figures else ''}{figures}")
    verdict = combined_verdict(comparisons)
    deciding = [c for c in comparisons if c.verdict == verdict]
    if verdict == "held":
      deciding.sort(key=lambda c: c.high - c.low if c.test == "paired t" else math.inf)
    shown = deciding[0] if deciding else None
    text = "; ".join(c.text() for c in comparisons)
    return cls({"held": True, "not held": False}.get(verdict), f"{text}{'; ' if figures and text else ''}{figures}",
               verdict, shown)


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim of a paper and the check that decides it from the summary of a reproduction.

  ``check`` receives the summary (row key -> row: the means over seeds and,
  under ``"per_seed"``, each metric's ``{seed: value}``) and returns a
  :class:`ClaimResult`, normally ``ClaimResult.decide`` of :func:`compare` s
  of per-seed values (:func:`paired` reads them from the summary).
  """

  name: str
  statement: str
  check: Callable[[Summary], ClaimResult]

  def evaluate(self, summary: Summary) -> ClaimResult:
    try:
      return self.check(summary)
    except KeyError as missing:
      return ClaimResult(None, f"not evaluated: no result for {missing}")
    except (IndexError, StopIteration, ValueError) as e:  # e.g. an empty grid (--only left its runs out)
      return ClaimResult(None, f"not evaluated: the runs it needs are missing ({type(e).__name__}: {e})")


def seed_values(summary: Summary, key: str, metric: str, *, scale: float = 1.0,
                missing: float = math.inf) -> dict[Any, float]:
  """``{seed: value * scale}`` of ``metric`` for the row ``key``; a missing value (``None``: diverged, never
  reached) becomes ``missing`` (default ``inf``: infinitely bad when lower is better)."""
  per_seed = summary[key].get("per_seed", {})
  if metric not in per_seed:
    raise KeyError(f"{key}: {metric} per seed")
  return {s: missing if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) * scale
          for s, v in per_seed[metric].items()}


def across_seeds(fn: Callable[..., float], *values: Mapping[Any, float]) -> dict[Any, float]:
  """``{seed: fn(v1, v2, ...)}`` over the seeds every mapping of ``values`` has (a per-seed statistic of rows)."""
  seeds = set(values[0]).intersection(*values[1:]) if values else set()
  return {s: float(fn(*(v[s] for v in values))) for s in sorted(seeds, key=str)}


def log_or_inf(value: float) -> float:
  """``log(value)``, with ``inf`` (never reached, diverged) kept as ``inf``: for ratios compared on a log scale."""
  return math.inf if value == math.inf else math.log(value) if value > 0 else -math.inf


def paired(summary: Summary, key_a: str, key_b: str | None, metric: str, *, claim: str = "less",
           margin: float = 0.0, scale: float = 1.0, missing: float = math.inf, censor: float | None = None,
           what: str | None = None) -> Comparison:
  """:func:`compare` of ``metric`` between the rows ``key_a`` and ``key_b`` (or ``key_a`` alone), seed by seed."""
  a = seed_values(summary, key_a, metric, scale=scale, missing=missing)
  b = None if key_b is None else seed_values(summary, key_b, metric, scale=scale, missing=missing)
  label = what or (f"{metric} {key_a} - {key_b}" if key_b is not None else f"{metric} {key_a}")
  return compare(a, b, claim=claim, margin=margin, what=label, censor=censor)


@dataclasses.dataclass(frozen=True)
class Range:
  """The allowed values of a numeric setting (of each number, for a list or a mapping of numbers)."""

  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  integer: bool = False

  def __contains__(self, value: float) -> bool:
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

  def __str__(self) -> str:
    kind = "an integer" if self.integer else "a number"
    if self.low is not None and self.high is not None:
      return (f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
              f"{')' if self.high_open else ']'}")
    if self.low is not None:
      return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
    if self.high is not None:
      return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
    return kind


POSITIVE = Range(0.0, low_open=True)
COUNT = Range(1, integer=True)  # a number of things (workers, steps, seeds, ...)
NON_NEGATIVE_INT = Range(0, integer=True)
FRACTION = Range(0.0, 1.0, low_open=True)
# Ranges of the settings that several reproductions share (by name); a reproduction adds its own in ``limits``.
COMMON_LIMITS: Mapping[str, Range | tuple[str, ...]] = {
    **{k: POSITIVE for k in ("lr", "client_lr", "inner_lr", "outer_lr", "server_lr", "max_step", "step_budget",
                             "time_budget", "step_scale", "speeds", "trace_slow", "dc_lambda0", "target",
                             "sgd_floor", "mild_factor", "optimizers", "lam_logreg", "lam_lsq", "label_noise")},
    **{k: COUNT for k in ("batch", "seeds", "eval_every", "eval_points", "epochs", "workers", "learners", "clients",
                          "hidden", "width", "depth", "depths", "heads", "ks", "ns", "local_steps", "sums", "buffer",
                          "trace_workers", "classes_per_client", "vocab", "seq_len", "corpus_tokens", "lsq_n",
                          "lsq_d", "adasync_k0", "adasync_chunk")},
    **{k: NON_NEGATIVE_INT for k in ("steps", "staleness", "taus", "s_lower", "s_upper")},
    "momentum": Range(-1.0, 1.0, low_open=True, high_open=True),
    "momenta": Range(-1.0, 1.0, low_open=True, high_open=True),
    "outer_momentum": Range(0.0, 1.0, high_open=True),
    "dc_mu": Range(0.0, 1.0, high_open=True),
    "dc_lambda": Range(0.0),
    "poly_a": Range(0.0),
    "lsq_noise": Range(0.0),
    "mixing": FRACTION,
    "target_accuracy": FRACTION,
    "data": ("digits", "mnist", "cifar10"),
    "model": ("mlp", "resnet20"),
    "compute": ("constant", "uniform", "exponential", "gamma", "lognormal"),
}


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
      list), ``"staleness_hist"`` and ``"diverged"`` (True when the run's
      loss or parameters stopped being finite)).
    summarize: ``(config, records) -> rows`` (dicts with a ``"key"``), the
      results table, averaged over seeds; :func:`mean_rows` does the usual.
    claims: the paper's claims.
    plots: ``(config, records, rows, out_dir) -> paths`` of the PNG files written.
    paper_numbers: the paper's own figures, row key -> {column: value}, shown
      side by side with the reproduction's.
    columns: the table's columns (default: every column of the rows).
    smoke: config overrides for ``--smoke`` (a seconds-long run of the whole
      pipeline, for tests): fewer steps, seeds and grid points.
    limits: setting -> its allowed values (a :class:`Range` for numbers, a
      tuple for strings), added to :data:`COMMON_LIMITS`; ``--set`` values are
      checked against them and against the type of the scale's own value.
    batch: ``batch(config, spec, seed) -> key`` (hashable), for a
      reproduction whose runs are computed several at a time (one
      ``dj.simulate`` of ``seed=dj.Runs(sources=...)``): the pending runs of
      one key are computed together by ``run_batch``. A batch is whatever
      runs of its key are pending (their number depends on ``--seeds``,
      ``--only`` and what is finished), so ``run_batch`` must give each run
      the record ``run`` gives it alone, bit for bit: a record depends only on
      its config, spec and seed (:func:`run_fingerprint`). Runs of
      ``dj.Runs(sources=...)`` are (``dj.Runs`` of one schedule are not: its
      runs share a ``vmap``, which rounds otherwise). ``None`` (default): each
      run is computed alone by ``run``.
    run_batch: ``run_batch(config, [(spec, seed), ...], progress) ->
      [record, ...]``, with ``batch``: computes the runs of one batch and
      returns their records (as ``run`` returns one) in their order.
      ``progress`` is a :class:`RunProgress` without a checkpoint folder: an
      interrupted batch is computed again whole.
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
  limits: Mapping[str, Range | tuple[str, ...]] = dataclasses.field(default_factory=dict)
  batch: Callable[[Mapping[str, Any], Mapping[str, Any], int], Hashable] | None = None
  run_batch: Callable[[Mapping[str, Any], list[tuple[dict[str, Any], int]], Progress],
                      list[dict[str, Any]]] | None = None

  def __post_init__(self):
    if (self.batch is None) != (self.run_batch is None):
      given, missing = ("batch", "run_batch") if self.run_batch is None else ("run_batch", "batch")
      raise ValueError(f"{self.name}: batch and run_batch go together (batch names the runs computed together, "
                       f"run_batch computes them); {given} is given but {missing} is None: give both or neither.")
    for field in ("batch", "run_batch"):
      if getattr(self, field) is not None and not callable(getattr(self, field)):
        raise TypeError(f"{self.name}: {field} must be a function, got {getattr(self, field)!r}.")


def config_for(repro: Reproduction, scale: str, steps: int | None = None, seeds: int | None = None,
               overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The config of ``scale`` with the ``--set``, ``--steps`` and ``--seeds`` overrides applied and checked.

  A ``--set`` value must name a setting of the scale, have the type of the
  scale's own value (an integer where it is an integer; a list of such where
  it is a list) and lie in the setting's range (:data:`COMMON_LIMITS`,
  ``repro.limits``); otherwise a ``ValueError`` names the setting, the value
  and what is allowed.
  """
  if scale not in repro.scales:
    raise UsageError(f"--scale must be one of {sorted(repro.scales)} for {repro.name}, got {scale!r}.")
  config = dict(repro.scales[scale])
  limits = {**COMMON_LIMITS, **repro.limits}
  for key, value in (overrides or {}).items():
    if key not in config:
      raise UsageError(f"--set {key}=...: {repro.name} ({scale}) has no setting {key!r}; it has "
                       f"{', '.join(sorted(config))}.")
    config[key] = checked_setting(key, value, config[key], limits.get(key))
  config["scale"] = scale
  if steps is not None:
    config["steps"] = checked_setting("--steps", steps, 1, COUNT)
  if seeds is not None:
    config["seeds"] = checked_setting("--seeds", seeds, 1, COUNT)
  return config


def checked_setting(name: str, value: Any, default: Any, limit: Range | tuple[str, ...] | None, *,
                    where: str | None = None) -> Any:
  """``value`` if it has the type of ``default`` and lies in ``limit``; a ``ValueError`` naming ``name`` otherwise.

  The message starts with ``where`` followed by ``name`` (default: the option that gave it, ``--set NAME``).
  """
  prefix = where
  where = f"{prefix}{name}" if prefix is not None else name if name.startswith("--") else f"--set {name}"
  shown = json.dumps(value) if _jsonable(value) else repr(value)

  def fail(allowed: str) -> UsageError:
    return UsageError(f"{where}={shown}: {name.lstrip('-')} must be {allowed}, got {shown}.")

  if default is None:
    return value  # an optional setting (e.g. a file name): any value; the run checks it
  if isinstance(default, bool):
    if not isinstance(value, bool):
      raise fail("true or false")
    return value
  if isinstance(default, (int, float)):
    integer = isinstance(default, int) or (isinstance(limit, Range) and limit.integer)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
      raise fail(str(limit) if isinstance(limit, Range) else "an integer" if integer else "a number")
    if not math.isfinite(value) or (isinstance(limit, Range) and value not in limit):
      raise fail(str(limit) if isinstance(limit, Range) else "finite")
    return value
  if isinstance(default, str):
    if not isinstance(value, str) or (isinstance(limit, tuple) and value not in limit):
      raise fail("one of " + ", ".join(map(repr, limit)) if isinstance(limit, tuple) else "a string")
    return value
  if isinstance(default, (list, tuple)):
    if not isinstance(value, list) or (default and not value):
      raise fail(f"a non-empty list like {json.dumps(default)}")
    if default:
      return [checked_setting(f"{name}[{i}]", v, default[0], limit, where=prefix) for i, v in enumerate(value)]
    return value
  if isinstance(default, Mapping):
    if not isinstance(value, Mapping) or not value:
      raise fail(f"a non-empty mapping like {json.dumps(default)}")
    unknown = sorted(set(value) - set(default))
    if unknown:
      raise fail(f"a mapping with keys among {sorted(default)} (unknown: {unknown})")
    return {k: checked_setting(f"{name}.{k}", v, default[k], limit, where=prefix) for k, v in value.items()}
  return value


# Settings a config has beyond its scale's: the scale's name, and those the CLI adds (--steps and --seeds where
# the scale names none, --data-dir).
_ADDED_SETTINGS: Mapping[str, Any] = {"scale": "quick", "steps": 1, "seeds": 1, "data_dir": ""}


def saved_config(repro: Reproduction, config: Any, path: str) -> dict[str, Any]:
  """``config`` as read back from ``path`` (a results.json), if it is one that ``config_for`` could have made.

  Its scale must be one of the reproduction's, its settings those of the scale (each present, nothing
  else but ``steps``, ``seeds`` and ``data_dir``), each of the scale's type and within its range, as a
  ``--set`` would be checked; otherwise a :class:`UsageError` names the file, the setting, the value and
  what is allowed.
  """
  if not isinstance(config, Mapping):
    raise UsageError(f"{path}: config must be a mapping of settings, got {type(config).__name__}.")
  scale = config.get("scale")
  if not isinstance(scale, str) or scale not in repro.scales:
    raise UsageError(f"{path}: config scale={json.dumps(scale) if _jsonable(scale) else repr(scale)}: scale must "
                     f"be one of {sorted(repro.scales)} ({repro.name}'s scales).")
  own = repro.scales[scale]
  allowed = sorted(set(own) | set(_ADDED_SETTINGS))
  missing = sorted(set(own) - set(config))
  if missing:
    raise UsageError(f"{path}: config has no {', '.join(map(repr, missing))}, which every {repro.name} ({scale}) "
                     f"config has; its settings are {', '.join(allowed)}.")
  unknown = sorted(set(config) - set(allowed), key=str)
  if unknown:
    raise UsageError(f"{path}: config has {', '.join(map(repr, unknown))}, which no {repro.name} ({scale}) config "
                     f"has; its settings are {', '.join(allowed)}.")
  limits = {**COMMON_LIMITS, **repro.limits}
  checked = {}
  for key, value in config.items():
    default = own.get(key, _ADDED_SETTINGS.get(key))
    limit = limits.get(key, COUNT if key in ("steps", "seeds") else None)
    checked[key] = checked_setting(key, value, default, limit, where=f"{path}: config ")
  return checked


def _jsonable(value: Any) -> bool:
  try:
    json.dumps(value)
  except (TypeError, ValueError):
    return False
  return True


def fingerprint(*parts: Any) -> str:
  """A short hash of JSON-serializable parts: a finished run is reused only if it matches."""
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_fingerprint(config: Mapping[str, Any], spec: Mapping[str, Any], seed: int) -> str:
  """What identifies a finished run: the config (less the number of seeds, so that adding seeds reuses the
  ones already run), the spec and the seed."""
  return fingerprint({k: v for k, v in config.items() if k != "seeds"}, spec, seed)


def _file_mode() -> int:
  """The mode ``open`` would give a new file under the user's umask (``mkstemp`` alone gives 0600)."""
  umask = os.umask(0)
  os.umask(umask)
  return 0o666 & ~umask


def write_text(path: str, text: str) -> None:
  """Writes ``text`` atomically (a temporary file renamed over ``path``), with the user's umask."""
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.splitext(path)[1])
  try:
    with os.fdopen(fd, "w", newline="") as f:
      f.write(text)
    os.chmod(tmp, _file_mode())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: str, value: Any) -> None:
  """Writes ``value`` as JSON atomically: an interrupted run never leaves a truncated file."""
  write_text(path, json.dumps(to_json(value), indent=1))


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


def check_writable(out: str, argument: str = "--out") -> None:
  """Creates ``out`` and writes a file there, so that an unwritable folder fails before any compute."""
  try:
    os.makedirs(out, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-")
    os.close(fd)
    os.remove(tmp)
  except OSError as e:
    raise UsageError(f"{argument} {out}: cannot write there ({e.strerror or e}).") from None


def execute(repro: Reproduction, config: Mapping[str, Any], out: str, *, first_seed: int = 0,
            only: Sequence[str] | None = None, plots: bool = True, verbose: bool = True,
            jobs: int = 1, checkpoint_every: float = CHECKPOINT_EVERY) -> dict[str, Any]:
  """Runs every (spec, seed) not already finished in ``out``, then writes the table, claims and plots.

  The outputs cover every finished run of this config in ``out``, whatever
  seeds or ``only`` this call asked for, so ``run`` and ``report`` agree.
  ``jobs > 1`` runs that many runs at a time in processes of their own (see
  :func:`execute_many`). ``checkpoint_every``: seconds of a run between two
  of its checkpoint writes (``0``: after every chunk).

  Returns:
    ``{"config", "rows", "claims", "records", "ran", "reused", "seconds", "files"}``;
    ``ran`` and ``reused`` count the runs performed now and read back.
  """
  return execute_many([(repro, config, out)], first_seed=first_seed, only=only, plots=plots, verbose=verbose,
                      jobs=jobs, checkpoint_every=checkpoint_every)[0]


class _Job(NamedTuple):
  """One run to perform: reproduction ``index`` of the plan, its spec and seed, and where its files go."""
  index: int
  spec: Mapping[str, Any]
  seed: int
  path: str
  stamp: str
  checkpoints: str


def pending_runs(repro: Reproduction, config: Mapping[str, Any], out: str, index: int, first_seed: int,
                 only: Sequence[str] | None) -> tuple[list[_Job], int]:
  """The runs of one reproduction still to perform (each with its checkpoint folder), and how many are
  finished already."""
  specs = repro.specs(config)
  keys = [s["key"] for s in specs]
  if len(set(keys)) != len(keys):
    raise ValueError(f"{repro.name}: run spec keys must be unique, got {keys}.")
  if only:
    specs = [s for s in specs if any(o in s["key"] for o in only)]
    if not specs:
      raise UsageError(f"--only {' '.join(only)}: no run of {repro.name} matches; its runs are "
                       f"{', '.join(keys)}.")
  check_writable(out)
  seeds = range(first_seed, first_seed + int(config.get("seeds", 1)))
  jobs, reused = [], 0
  for spec in specs:
    for seed in seeds:
      path = run_path(out, spec["key"], seed)
      stamp = run_fingerprint(config, spec, seed)
      if _finished(path, stamp):
        reused += 1
      else:
        checkpoints = os.path.join(out, "checkpoints", os.path.basename(path)[:-len(".json")] + f"__{stamp}")
        jobs.append(_Job(index, spec, seed, path, stamp, checkpoints))
  return jobs, reused


def _perform(run: Callable[..., dict[str, Any]], config: Mapping[str, Any], job: _Job, bar: Any,
             checkpoint_every: float) -> dict[str, Any]:
  """Performs one run and returns its record (with its key, seed, fingerprint and seconds)."""
  from delayjax.runtime._checkpoint import CheckpointError

  t0 = time.perf_counter()
  try:
    record = dict(run(config, job.spec, job.seed, RunProgress(bar, job.checkpoints, checkpoint_every)))
  except CheckpointError as e:
    # Its advice names dj.simulate's arguments; here the checkpoint is the framework's, one folder per run.
    raise UsageError(f"{e} (It is the checkpoint of run {job.spec['key']}, seed {job.seed}: delete "
                     f"{job.checkpoints} to start that run over.)") from None
  record.update(key=job.spec["key"], spec=job.spec, seed=job.seed, fingerprint=job.stamp,
                seconds=time.perf_counter() - t0)
  return record


def _save(job: _Job, record: dict[str, Any]) -> None:
  write_json(job.path, record)
  shutil.rmtree(job.checkpoints, ignore_errors=True)


def freeze_imports() -> None:
  """Leaves every object alive now out of the cyclic garbage collector's later collections (``gc.freeze``): called
  by a process that exists to run reproductions (``python -m experiments``, a ``--jobs`` worker) once its modules
  are imported, before any run; not by a caller of the CLI's ``main`` (a test, a notebook), whose heap is its own.

  A collection of the oldest generation walks every tracked object, and with JAX, SciPy and scikit-learn
  loaded those are mostly the modules' functions, classes and tables, which live as long as the process;
  tracing a program allocates enough to set one off, twice in ``gossip_adpsgd`` at one seed (0.05 and 0.07 s
  of 0.9 s of runs; frozen, one of 0.01 s). What is frozen is never collected: cycles among it that are already
  garbage (an import leaves few) stay until the process ends, as its modules do.
  """
  gc.freeze()


_worker_frozen = False  # whether this worker process has frozen its imports (_perform_tasks_in_child)


def _ignore_interrupts() -> None:
  # The parent handles Ctrl-C and terminates the pool; a child's own KeyboardInterrupt would only add tracebacks.
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def _perform_in_child(task: tuple[Callable[..., dict[str, Any]], Mapping[str, Any], _Job, float]
                      ) -> tuple[_Job, dict[str, Any]]:
  from tqdm.auto import tqdm

  run, config, job, checkpoint_every = task
  return job, _perform(run, config, job, tqdm(total=1, disable=True), checkpoint_every)


class _Batch(NamedTuple):
  """One batch to perform: reproduction ``index`` of the plan (named ``name``) and its pending runs, in the
  order they were pending."""
  index: int
  name: str
  jobs: tuple[_Job, ...]


def _tasks(plan: Sequence[tuple[Reproduction, Mapping[str, Any], str]], pending: Sequence[_Job]
           ) -> list[_Job | _Batch]:
  """The pending runs as the tasks that perform them, in the order of ``pending``: a run of a reproduction
  without ``batch`` alone; those of a reproduction with ``batch`` together with the pending runs of their key,
  each batch placed at its first run."""
  tasks: list[_Job | tuple[int, Any]] = []
  batches: dict[tuple[int, Any], list[_Job]] = {}
  for job in pending:
    repro, config, _ = plan[job.index]
    if repro.batch is None:
      tasks.append(job)
      continue
    key = repro.batch(config, job.spec, job.seed)
    try:
      group = (job.index, key)
      hash(group)
    except TypeError:
      raise ValueError(f"{repro.name}: batch gave run {job.spec['key']!r} seed {job.seed} the key {key!r}, which "
                       "is not hashable; a batch's key names the runs computed together.") from None
    if group not in batches:
      batches[group] = []
      tasks.append(group)
    batches[group].append(job)
  return [task if isinstance(task, _Job) else _Batch(task[0], plan[task[0]][0].name, tuple(batches[task]))
          for task in tasks]


def _perform_batch(run_batch: Callable[..., list[dict[str, Any]]], config: Mapping[str, Any], batch: _Batch,
                   bar: Any, checkpoint_every: float) -> list[tuple[_Job, dict[str, Any]]]:
  """Performs one batch; returns its runs with their records (each with its key, seed, fingerprint and seconds:
  the batch's wall seconds divided by its number of runs)."""
  t0 = time.perf_counter()
  records = run_batch(config, [(job.spec, job.seed) for job in batch.jobs], RunProgress(bar, None, checkpoint_every))
  seconds = (time.perf_counter() - t0) / len(batch.jobs)
  members = [(job.spec["key"], job.seed) for job in batch.jobs]
  if not isinstance(records, (list, tuple)) or len(records) != len(members):
    count = f"{len(records)} records" if isinstance(records, (list, tuple)) else repr(records)
    raise ValueError(f"{batch.name}: run_batch returned {count} for the batch {members} of {len(members)} runs; "
                     "it must return a list of one record per run, in the batch's order.")
  done = []
  for job, given in zip(batch.jobs, records):
    if not isinstance(given, Mapping):
      raise ValueError(f"{batch.name}: run_batch returned {given!r} as the record of run {job.spec['key']!r} seed "
                       f"{job.seed}; a record is a dict.")
    record = dict(given)
    record.update(key=job.spec["key"], spec=job.spec, seed=job.seed, fingerprint=job.stamp, seconds=seconds)
    done.append((job, record))
  return done


def _perform_task_in_child(task: tuple[Callable[..., Any], Mapping[str, Any], _Job | _Batch, float]
                           ) -> list[tuple[_Job, dict[str, Any]]]:
  """A task of the pool: one run or one batch; its pending runs with their records."""
  from tqdm.auto import tqdm

  if not isinstance(task[2], _Batch):
    return [_perform_in_child(task)]
  run_batch, config, batch, checkpoint_every = task
  return _perform_batch(run_batch, config, batch, tqdm(total=len(batch.jobs), disable=True), checkpoint_every)


def _first_job(unit: _Job | _Batch) -> _Job:
  return unit if isinstance(unit, _Job) else unit.jobs[0]


def _perform_tasks_in_child(task: tuple[Callable[..., Any], Mapping[str, Any], Sequence[_Job | _Batch], float]
                            ) -> list[tuple[_Job, dict[str, Any]]]:
  """A task of the pool: runs or batches of one spec, one after the other; their runs with their records, each
  saved here as soon as it is done, so that a worker stopped later (Ctrl-C, another run failing) loses none."""
  function, config, units, checkpoint_every = task
  global _worker_frozen
  if not _worker_frozen:
    # The first task's function has been unpickled: its reproduction, delayjax and JAX are imported.
    freeze_imports()
    _worker_frozen = True
  done = []
  for unit in units:
    finished = _perform_task_in_child((function, config, unit, checkpoint_every))
    for job, record in finished:
      _save(job, record)
    done += finished
  return done


def execute_many(plan: Sequence[tuple[Reproduction, Mapping[str, Any], str]], *, first_seed: int = 0,
                 only: Sequence[str] | None = None, plots: bool = True, verbose: bool = True,
                 jobs: int = 1, checkpoint_every: float = CHECKPOINT_EVERY) -> list[dict[str, Any]]:
  """:func:`execute` for several ``(reproduction, config, out)``, the runs of all of them in one queue.

  With ``jobs == 1`` the runs are performed here, one after the other, each
  reproduction finished (table, claims, plots) as soon as its runs are done.
  With ``jobs > 1`` they are performed ``jobs`` at a time, each in a worker
  process of its own (spawned, so JAX starts fresh there), and a
  reproduction is finished once its runs and those of the reproductions
  before it are done. A worker takes the pending runs of a spec together,
  which share compiled programs, and performs them one after the other,
  saving each record as it is done. A run's record depends only on its
  config, spec and seed, so the results are the same either way, bit for
  bit; what parallelism buys is the CPU cores a single small-model run
  leaves idle.
  Use it on CPUs: on one GPU the processes would compete for the device's
  memory. A worker receives the reproduction's ``run`` by reference, so
  ``run`` must be a module-level function. A run writes its checkpoint at
  most once every ``checkpoint_every`` seconds (``0``: after every chunk);
  the results do not depend on it.

  A reproduction with ``batch`` (see :class:`Reproduction`) has its pending
  runs grouped by their batch's key, and each batch is performed once by
  ``run_batch``; its records are saved as single runs' would be (their
  ``seconds``: the batch's wall seconds divided by its number of runs). A
  batch is performed as one (here in the order of its first run; with
  ``jobs > 1`` by the worker that takes its first run's spec), so
  ``run_batch`` must then be a module-level function. It has no checkpoint:
  an interrupted batch is computed again whole. A key that is not hashable,
  and a ``run_batch`` that returns a wrong number of records, raise a
  ``ValueError`` naming the reproduction.
  """
  from tqdm.auto import tqdm

  jobs = int(jobs)
  if jobs < 1:
    raise UsageError(f"--jobs must be a whole number >= 1, got {jobs}.")
  checkpoint_every = check_checkpoint_every(checkpoint_every)
  pending, reused = [], []
  for index, (repro, config, out) in enumerate(plan):
    todo, done = pending_runs(repro, config, out, index, first_seed, only)
    pending += todo
    reused.append(done)
  units = _tasks(plan, pending)  # the runs, and the batches of batched reproductions, each performed once
  remaining = [0] * len(plan)
  ran = [0] * len(plan)
  for job in pending:
    remaining[job.index] += 1
  results: list[dict[str, Any]] = []
  start = time.perf_counter()

  def finish_ready() -> None:
    while len(results) < len(plan) and remaining[len(results)] == 0:
      repro, config, out = plan[len(results)]
      results.append(finish(repro, config, finished_records(repro, config, out, damaged="skip"), out,
                            ran=ran[len(results)], reused=reused[len(results)],
                            seconds=time.perf_counter() - start, plots=plots, verbose=verbose))

  def saved(job: _Job, record: dict[str, Any], written: bool = False) -> None:
    if not written:
      _save(job, record)
    ran[job.index] += 1
    remaining[job.index] -= 1
    finish_ready()

  desc = plan[0][0].name if len(plan) == 1 else "runs"
  bar = tqdm(total=len(pending), desc=desc, unit="run", file=sys.stderr, disable=not verbose)
  try:
    finish_ready()
    if jobs == 1 or len(units) <= 1:
      for unit in units:
        repro, config, _ = plan[unit.index]
        if isinstance(unit, _Batch):
          first = unit.jobs[0]
          bar.set_postfix_str(f"{repro.name} batch of {len(unit.jobs)} runs from {first.spec['key']} seed "
                              f"{first.seed}")
          inner = tqdm(total=len(unit.jobs), desc="  batch", unit="run", file=sys.stderr, leave=False,
                       disable=not verbose)
          try:
            done = _perform_batch(repro.run_batch, config, unit, inner, checkpoint_every)
          finally:
            inner.close()
          bar.update(len(done))
          for job, record in done:
            saved(job, record)
          continue
        job = unit
        bar.set_postfix_str(f"{repro.name} {job.spec['key']} seed {job.seed}")
        inner = tqdm(total=1, desc="  updates", file=sys.stderr, leave=False, disable=not verbose)
        try:
          record = _perform(repro.run, config, job, inner, checkpoint_every)
        finally:
          inner.close()
        bar.update()
        saved(job, record)
    else:
      import multiprocessing

      # The pending runs of a spec are one task, performed one after the other by one worker: the seeds of a spec
      # share compiled programs, which that worker then compiles, or reads from the compilation cache (see
      # __main__), once. As runs of their own, a spec's seeds went to both workers, which each traced and read
      # every program again: `run all --jobs 2` read 404 programs from the cache, by spec 19 (every record the
      # same). The specs in spread_firsts' order: the compilation cache hands a program on only once it is written.
      # A batch goes with its first run.
      groups: dict[tuple[int, str], list[_Job | _Batch]] = {}
      for unit in units:
        job = _first_job(unit)
        groups.setdefault((job.index, job.spec["key"]), []).append(unit)
      tasks = []
      for job in spread_firsts([_first_job(members[0]) for members in groups.values()]):
        repro, config, _ = plan[job.index]
        members = groups[job.index, job.spec["key"]]
        tasks.append((repro.run_batch if isinstance(members[0], _Batch) else repro.run, config, members,
                      checkpoint_every))
      for repro, _, _ in plan:
        what = "run" if repro.batch is None else "run_batch"
        try:
          pickle.dumps(getattr(repro, what))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
          raise UsageError(f"--jobs {jobs}: {repro.name}'s {what} function cannot be sent to a worker process "
                           f"({e}); define it at module level, or use --jobs 1.") from None
      pool = multiprocessing.get_context("spawn").Pool(min(jobs, len(tasks)), initializer=_ignore_interrupts)
      try:
        for done in pool.imap_unordered(_perform_tasks_in_child, tasks):
          job = done[0][0]
          bar.update(len(done))
          more = f" and {len(done) - 1} more" if len(done) > 1 else ""
          bar.set_postfix_str(f"{plan[job.index][0].name} {job.spec['key']} seed {job.seed}{more} done")
          for member, record in done:
            saved(member, record, written=True)
        pool.close()
      except BaseException:
        pool.terminate()  # Ctrl-C or a failed run: the other runs stop now; their checkpoints stay for a rerun
        raise
      finally:
        pool.join()
  finally:
    bar.close()
  return results


def spread_firsts(firsts: Sequence[_Job]) -> list[_Job]:
  """The first run of every spec, ordered so that runs started together rarely compile the same program.

  Neighbouring specs of a reproduction often share one program (a sweep over a setting the program does not
  depend on, or ``dj.Execution(like=...)``), and two workers that take them at once would both compile it:
  the compilation cache hands a program on only once it is written. So within each reproduction the first half
  of its specs alternates with the second half (``[s0, s4, s1, s5, ...]`` for eight specs). The reproductions
  keep their order: a worker keeps only its few most recent programs (``dj.runtime`` compiles each once among
  them), which taking turns across reproductions would evict before a reproduction's next spec needs them. The
  order changes only when runs are performed, never a record.
  """
  by_repro: dict[int, list[_Job]] = {}
  for job in firsts:
    by_repro.setdefault(job.index, []).append(job)
  out = []
  for jobs in by_repro.values():
    half = -(-len(jobs) // 2)
    out += [job for pair in itertools.zip_longest(jobs[:half], jobs[half:]) for job in pair if job is not None]
  return out


def check_checkpoint_every(seconds: Any) -> float:
  """``seconds`` (``--checkpoint-every``) as a float, or a :class:`UsageError` unless it is finite and ``>= 0``."""
  if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= seconds < math.inf:
    raise UsageError(f"--checkpoint-every must be a number of seconds >= 0 (0: a checkpoint after every chunk), "
                     f"got {seconds!r}.")
  return float(seconds)


def _finished(path: str, stamp: str) -> bool:
  """Whether ``path`` holds a readable record with fingerprint ``stamp`` (a damaged one is redone)."""
  if not os.path.exists(path):
    return False
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):  # ValueError: not JSON, or not text (UnicodeDecodeError)
    return False
  return isinstance(record, dict) and record.get("fingerprint") == stamp


def finished_records(repro: Reproduction, config: Mapping[str, Any], out: str, *,
                     damaged: str = "raise") -> list[dict[str, Any]]:
  """Every finished run of ``config`` in ``out`` (any seed), in spec order then by seed.

  Records are read back from their JSON files, so a fresh run and a resumed
  one summarize exactly the same numbers.
  """
  order = {s["key"]: i for i, s in enumerate(repro.specs(config))}
  found = [r for r in load_records(out, damaged=damaged)
           if r.get("key") in order and r.get("fingerprint") == run_fingerprint(config, r["spec"], r["seed"])]
  return sorted(found, key=lambda r: (order[r["key"]], r["seed"]))


def finish(repro: Reproduction, config: Mapping[str, Any], records: list[dict[str, Any]], out: str, *,
           ran: int = 0, reused: int = 0, seconds: float = 0.0, plots: bool = True,
           verbose: bool = True) -> dict[str, Any]:
  """Summarizes records into the table, checks the claims, writes the outputs, prints the table."""
  rows = repro.summarize(config, records)
  summary = {r["key"]: r for r in rows}
  diverged = sum(1 for r in records if r.get("diverged"))
  claims = []
  for claim in repro.claims:
    if records and diverged == len(records):
      result = ClaimResult(None, f"not evaluated: every one of the {diverged} runs diverged (non-finite loss or "
                           "parameters), so the settings are outside the range the claim is about")
    else:
      result = claim.evaluate(summary)
      if result.comparison is None and result.verdict in ("held", "not held"):
        result = dataclasses.replace(result, figures=f"{result.figures} [decided on the means, without a per-seed "
                                     "interval]")
    c = result.comparison
    claims.append({"claim": claim.name, "statement": claim.statement, "verdict": result.verdict,
                   "held": result.held, "seeds": c.n if c else None, "mean": c.mean if c else None,
                   "low": c.low if c else None, "high": c.high if c else None, "test": c.test if c else None,
                   "figures": result.figures})
  os.makedirs(out, exist_ok=True)
  files = [os.path.join(out, "results.json"), os.path.join(out, "results.csv"), os.path.join(out, "claims.csv")]
  write_json(files[0], {"reproduction": repro.name, "paper": repro.paper, "config": dict(config),
                        "seeds": sorted({r["seed"] for r in records}), "rows": rows, "claims": claims,
                        "paper_numbers": dict(repro.paper_numbers), "diverged_runs": diverged,
                        "run_seconds": sum(float(r.get("seconds") or 0.0) for r in records)})
  write_csv(files[1], rows)
  write_csv(files[2], claims)
  if plots and records:
    files += repro.plots(config, records, rows, out)
  result = {"config": dict(config), "rows": rows, "claims": claims, "records": records, "ran": ran,
            "reused": reused, "seconds": seconds, "files": files}
  if verbose:
    print(render(repro, rows, claims))
    print(f"\n{ran} runs performed, {reused} reused from {os.path.join(out, 'runs')}, {seconds:.2f} s; "
          f"{len(records)} runs summarized ({len({r['seed'] for r in records})} seeds); "
          f"wrote {', '.join(os.path.basename(f) for f in files)} to {out}")
  return result


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
  """Writes rows (dicts) as CSV with the union of their keys as columns, atomically."""
  import io

  columns: list[str] = []
  for r in rows:
    columns += [k for k in r if k not in columns and not isinstance(r[k], (list, dict))]
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
  writer.writeheader()
  for r in rows:
    writer.writerow({k: _cell(r.get(k)) for k in columns})
  write_text(path, text.getvalue())


def _cell(value: Any) -> Any:
  if isinstance(value, float):
    return f"{value:.6g}"
  return "" if value is None else value


def mean_rows(records: list[dict[str, Any]], *, fields: Sequence[str] = ()) -> list[dict[str, Any]]:
  """One row per spec key (in first-seen order): the spec's ``fields`` and each metric's mean and std over seeds.

  A run whose record says ``diverged`` is left out of every mean and std and
  counted in ``diverged_seeds`` instead, which the table and the plots show
  ("diverged on 1 of 5 seeds"): its numbers (a test error of 90%, say) are
  not averaged with the others'. Over the other seeds, a metric ``m``
  becomes ``m`` (their mean: NaN if any of their values is missing or NaN,
  e.g. a target never reached, so that nothing is read off the lucky seeds
  alone) and ``m_std`` (over the finite values); ``seeds`` counts the
  records, ``nonfinite`` the most seeds any one metric was not finite for,
  and ``per_seed[m]`` is ``{seed: value}`` of every seed, the diverged ones
  included (``None`` where not finite), which the claims compare.
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
    per_seed: dict[str, dict[Any, float | None]] = {}
    kept = np.array([not g.get("diverged") for g in group])
    for name in names:
      raw = [g["metrics"].get(name) for g in group]
      values = np.array([_num(v) for v in raw], dtype=np.float64)
      nonfinite = max(nonfinite, int(np.sum(~np.isfinite(values))))
      own = values[kept]
      finite = own[np.isfinite(own)]
      row[name] = float(own.mean()) if own.size and finite.size == own.size else float("nan")
      row[f"{name}_std"] = float(finite.std()) if finite.size else float("nan")
      per_seed[name] = {g.get("seed", i): None if not math.isfinite(v) else float(v)
                        for i, (g, v) in enumerate(zip(group, values))}
    row["seeds"] = len(group)
    row["diverged_seeds"] = int(np.sum(~kept))
    row["nonfinite"] = nonfinite
    row["per_seed"] = per_seed
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
    columns = [k for k in rows[0] if not k.endswith("_std") and not isinstance(rows[0][k], (dict, list))]
  paper_cols = sorted({c for v in repro.paper_numbers.values() for c in v})
  header = columns + [f"paper {c}" for c in paper_cols]
  table = [[_fmt(r.get(c), r.get(f"{c}_std")) for c in columns]
           + [_fmt(repro.paper_numbers.get(r["key"], {}).get(c)) for c in paper_cols] for r in rows]
  if any(r.get("diverged_seeds") for r in rows):
    # The means leave the diverged runs out; this column says how many there were.
    header.append("diverged on")
    for r, t in zip(rows, table):
      t.append(diverged_text(r) or "-")
  widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(header)]
  lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
  lines.append("  ".join("-" * w for w in widths))
  lines += ["  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
  seeds = max((r.get("seeds", 0) for r in rows), default=0)
  lines.append(f"(mean ± std over {seeds} seeds)" if seeds > 1 else "")
  lines.append(f"\nclaims (checked on this run's numbers; {CONFIDENCE:.0%} intervals of the mean over seeds):")
  for c in claims:
    lines.append(f"  [{c['verdict'].upper():>13}] {c['claim']}: {c['statement']}\n{'':18}{c['figures']}")
  return "\n".join(lines)


def diverged_text(row: Mapping[str, Any]) -> str:
  """``"1 of 5 seeds"`` for a row with diverged runs (left out of its means), ``""`` for none."""
  count = int(row.get("diverged_seeds") or 0)
  return f"{count} of {row.get('seeds', count)} seed{'s' if row.get('seeds', count) != 1 else ''}" if count else ""


def claim_summary(claim: Mapping[str, Any]) -> str:
  """The deciding comparison of a claim row: ``mean [low, high], n seeds`` (or the test used)."""
  if claim.get("test") == "paired t" and claim.get("mean") is not None:
    low = "-inf" if claim.get("low") is None else f"{claim['low']:+.3g}"
    high = "inf" if claim.get("high") is None else f"{claim['high']:+.3g}"
    return f"{claim['mean']:+.3g} [{low}, {high}], {claim['seeds']} seeds"
  if claim.get("test") == "sign":
    return f"sign test, {claim['seeds']} seeds"
  return "-"


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
  """Reads ``results.json`` written by :func:`finish`; a damaged file is a ``ValueError`` naming it."""
  path = os.path.join(out, "results.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{out} holds no results.json; run a reproduction with --out {out} first.")
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except UnicodeDecodeError as e:
    raise UsageError(f"{path} is damaged (not text: byte {e.start} is not UTF-8); rerun the reproduction with --out "
                     f"{out} to rewrite it (its finished runs are reused).") from None
  except json.JSONDecodeError as e:
    raise UsageError(f"{path} is damaged (not valid JSON: {e}); rerun the reproduction with --out {out} to "
                     "rewrite it (its finished runs are reused).") from None
  if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) or "reproduction" not in saved:
    raise UsageError(f"{path} is not a results file of python -m experiments (no reproduction and config).")
  return saved


def load_records(out: str, *, damaged: str = "raise") -> list[dict[str, Any]]:
  """Every finished run record under ``OUT/runs`` (sorted by file name).

  A file that is not a valid record raises a :class:`UsageError` naming it
  (``damaged="raise"``) or is skipped with a warning (``damaged="skip"``).
  """
  directory = os.path.join(out, "runs")
  if not os.path.isdir(directory):
    return []
  records = []
  for name in sorted(os.listdir(directory)):
    if name.endswith(".json") and not name.startswith("."):
      path = os.path.join(directory, name)
      try:
        with open(path, encoding="utf-8") as f:
          record = json.load(f)  # a ValueError if it is not JSON, or not text (UnicodeDecodeError)
        if not isinstance(record, dict) or not {"key", "spec", "seed", "fingerprint", "metrics"} <= set(record):
          raise ValueError("not a run record")
      except ValueError as e:
        message = f"{path} is damaged ({e}); delete it to redo that run."
        if damaged == "raise":
          raise UsageError(message) from None
        print(f"warning: {message}", file=sys.stderr)
        continue
      records.append(record)
  return records
