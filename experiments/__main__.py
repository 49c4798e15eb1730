"""The experiments CLI: list the reproductions, run one (resumably), report on results.

    python -m experiments list
    python -m experiments run NAME [--scale quick|paper|smoke] [--seed N] [--seeds N] [--set KEY=VALUE ...]
    python -m experiments run all --jobs 2        # every reproduction at quick scale, two runs at a time
    python -m experiments run NAME NAME ...       # several reproductions in one process (outputs in --out/NAME)
    python -m experiments report DIR              # tables, claims and plots again from DIR's finished runs

A run writes ``DIR/runs/<run>__seed<N>.json`` as each run finishes; run it
again after an interruption (Ctrl-C says so) and the finished runs are read
back, not redone; more seeds added later join the earlier ones. Every claim
is decided over the seeds (see ``experiments._framework.compare``): held,
not held, inconclusive or not evaluated. Bad options, settings and files are
refused with a message naming them, before anything is computed.

Exit status: 0 done; 2 the command cannot be carried out as given (a bad
option, setting or file, a data set that is not where it was said to be: the
message says what to change, as argparse's errors do); 1 a run failed (e.g. the
disk filled while writing a checkpoint); 130 interrupted (Ctrl-C), resumable.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from typing import Any

from . import _datasets, _framework, _registry


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("list", help="list the reproductions")
  run = sub.add_parser("run", help="run a reproduction (several, or 'all')")
  run.add_argument("name", nargs="+", help="names from 'list', or 'all'")
  run.add_argument("--scale", default="quick", choices=["quick", "paper", "smoke"],
                   help="quick: 2-core CPU, bundled data; paper: the paper's model and data (GPU); smoke: the "
                        "quick scale cut to seconds (as --smoke), for CI")
  run.add_argument("--seed", type=int, default=0, help="first seed (a scale runs `seeds` consecutive seeds)")
  run.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the scale's)")
  run.add_argument("--steps", type=int, default=None, help="override the length of every run (smoke tests)")
  run.add_argument("--out", default=None, help="output directory (default: results/NAME/SCALE)")
  run.add_argument("--smoke", action="store_true",
                   help="a seconds-long run of the whole pipeline (the reproduction's smoke settings)")
  run.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config settings, VALUE in JSON (e.g. --set workers=[4] lr=0.05)")
  run.add_argument("--only", nargs="+", default=None, help="run only the specs whose key contains one of these")
  run.add_argument("--data-dir", default=None, help="where paper-scale data sets are (see experiments/_datasets.py)")
  run.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
  run.add_argument("--jobs", type=int, default=1,
                   help="runs performed at a time, each in a process of its own (on CPUs: about the number of "
                        "cores; the results are the same for any value)")
  run.add_argument("--checkpoint-every", type=float, default=_framework.CHECKPOINT_EVERY, metavar="SECONDS",
                   help="seconds of a run between two of its checkpoint writes (default "
                        f"{_framework.CHECKPOINT_EVERY:g}; 0: after every chunk): an interrupted run loses at most "
                        "about that much; the results are the same for any value")
  report = sub.add_parser("report", help="rebuild tables, claims and plots from finished runs")
  report.add_argument("dir", help="an output directory of 'run' (or a folder holding several)")
  report.add_argument("--no-plot", action="store_true")
  return parser


def main(argv: list[str] | None = None) -> int:
  status = _main(argv)
  if status == 130 and _is_the_program():
    _leave_now(status)
  return status


def _main(argv: list[str] | None) -> int:
  args = _parser().parse_args(argv)
  try:
    with _interrupts_are_not_lost():
      if args.command == "list":
        return _list()
      if args.command == "run":
        return _run(args)
      return _report(args.dir, plots=not args.no_plot)
  except KeyboardInterrupt:
    print("\ninterrupted; nothing was lost that a rerun of the same command would not redo.", file=sys.stderr)
    return 130
  except Exception as e:
    status = _exit_status(e)
    if status is None:
      raise
    print(f"error: {e}", file=sys.stderr)
    return status


def _is_the_program() -> bool:
  """Whether this process is ``python -m experiments`` or ``python -m experiments.NAME`` (not a caller of
  :func:`main`, such as a test or a notebook)."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  return spec is not None and (spec.name or "").startswith(f"{__package__}.")


def _leave_now(status: int) -> None:
  """Ends the process with ``status`` without Python's shutdown, once its output is flushed.

  A Ctrl-C can land while XLA compiles or runs a program in threads of its own (the main thread waits for
  them, and the KeyboardInterrupt leaves them going). Python's shutdown then destroys XLA's client under
  them, which crashed it (a segmentation fault in XLA's ``SingleDeviceSharding::Create`` as a compile
  finished: 3 of 10 Ctrl-Cs while dc_asgd's chunk program compiled). Nothing is left to write by then:
  checkpoints are written whole before a Ctrl-C takes effect (``delayjax.runtime._checkpoint``), run records
  and outputs are renamed into place whole, and a ``--jobs`` pool is terminated and joined.
  """
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(status)


def _exit_status(error: Exception) -> int | None:
  """The exit status of an error whose message says all (printed alone, no traceback); ``None`` for a bug."""
  if isinstance(error, (_framework.UsageError, FileNotFoundError, _datasets.DataUnavailable,
                        _datasets.DataFileError)):
    return 2  # what was given cannot be used: the message says what to change
  checkpoints = sys.modules.get("delayjax.runtime._checkpoint")  # loaded by any run that could raise one
  if checkpoints is not None and isinstance(error, checkpoints.CheckpointWriteError):
    return 1  # a run failed on the file system; its message says what is kept
  return None


@contextlib.contextmanager
def _interrupts_are_not_lost():
  """A Ctrl-C that Python would drop is delivered again, so that it interrupts the command.

  Python raises KeyboardInterrupt in whatever the main thread is running. Inside a callback whose
  exceptions cannot propagate (JAX's garbage-collection callback, a ``__del__``) it is printed as
  "Exception ignored in ..." with a traceback, and the command carried on as if Ctrl-C had not been
  pressed (a run then finished with exit status 0). This hook sends the main thread SIGINT again instead,
  from another thread a moment later: sent from the hook itself, the KeyboardInterrupt would be raised in
  the hook, which Python drops the same way. Should it land in such a callback again, it comes back here.
  """
  previous = sys.unraisablehook
  main_thread = threading.main_thread().ident

  def again() -> None:
    if hasattr(signal, "pthread_kill"):
      signal.pthread_kill(main_thread, signal.SIGINT)  # a real signal: it also ends a sleep or a wait
    else:
      _thread.interrupt_main()

  def hook(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
      timer = threading.Timer(0.01, again)
      timer.daemon = True
      timer.start()
      return
    previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    # A hook installed on top of this one stays, with this one under it (a failed checkpoint read leaves one
    # that drops the late callbacks of Orbax's closed event loop, which may still come while Python exits).
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous


def run_one(name: str, argv: list[str] | None = None) -> int:
  """``python -m experiments run NAME ARGV...``: what ``python -m experiments.NAME ARGV...`` does."""
  return main(["run", name, *(sys.argv[1:] if argv is None else argv)])


def _list() -> int:
  for repro in _registry.all_reproductions():
    quick = _framework.config_for(repro, "quick")
    runs = len(repro.specs(quick)) * quick.get("seeds", 1)
    print(f"{repro.name:<22} {repro.paper}\n{'':<22} {repro.description}\n"
          f"{'':<22} scales: {', '.join(repro.scales)}; quick = {runs} runs; {len(repro.claims)} claims\n")
  return 0


def _run(args: argparse.Namespace) -> int:
  if args.scale == "smoke":
    args.scale, args.smoke = "quick", True
  names = _names(args.name)
  repros = [_registry.get(n) for n in names]
  if args.jobs < 1:
    raise _framework.UsageError(f"--jobs must be a whole number >= 1, got {args.jobs}.")
  _framework.check_checkpoint_every(args.checkpoint_every)
  if not 0 <= args.seed < 2 ** 32:
    raise _framework.UsageError(f"--seed must be an integer in [0, 2**32), got {args.seed}.")
  if args.seeds is not None and args.seed + args.seeds > 2 ** 32:
    raise _framework.UsageError(_seeds_past_the_last(args.seed, args.seeds, "--seeds"))
  overrides = _overrides(args.set)
  # Everything is checked before anything is computed: configs, --only, and that --out can be written.
  plan = []
  for repro in repros:
    if len(repros) > 1:
      # `run all --set k=v` sets k where a reproduction has it.
      own = {k: v for k, v in overrides.items() if k in repro.scales.get(args.scale, {})}
    else:
      own = overrides
    config = _framework.config_for(repro, args.scale, steps=args.steps, seeds=args.seeds,
                                   overrides={**(repro.smoke if args.smoke else {}), **own})
    seeds = int(config.get("seeds", 1))
    if args.seed + seeds > 2 ** 32:
      # The number of seeds is the scale's (or its smoke settings'): say where it came from.
      raise _framework.UsageError(_seeds_past_the_last(
          args.seed, seeds, f"the {'smoke' if args.smoke else args.scale} settings' seeds of {repro.name}, "
          "which --seeds overrides"))
    if args.data_dir is not None:
      config["data_dir"] = os.path.abspath(os.path.expanduser(args.data_dir))
    if args.out is None:
      out = os.path.join("results", repro.name, "smoke" if args.smoke else args.scale)
    else:
      out = os.path.join(args.out, repro.name) if len(repros) > 1 else args.out
    if args.only and not any(o in s["key"] for s in repro.specs(config) for o in args.only):
      if len(repros) == 1:
        keys = ", ".join(s["key"] for s in repro.specs(config))
        raise _framework.UsageError(f"--only {' '.join(args.only)}: no run of {repro.name} matches; its runs are "
                                    f"{keys}.")
      continue
    plan.append((repro, config, out))
  if len(repros) > 1:
    unknown = sorted(set(overrides) - {k for r in repros for k in r.scales.get(args.scale, {})})
    if unknown:
      raise _framework.UsageError(f"--set {unknown[0]}=...: no reproduction has a setting {unknown[0]!r}.")
    if not plan:
      raise _framework.UsageError(f"--only {' '.join(args.only)}: no run of any reproduction matches.")
  for _, _, out in plan:
    _framework.check_writable(out)
  if _is_the_program():
    # Not in a caller's process (a test, a notebook): its heap is its own.
    _framework.freeze_imports()
  try:
    with _shared_compilation_cache(args.jobs):
      _framework.execute_many(plan, first_seed=args.seed, only=args.only, plots=not args.no_plot, jobs=args.jobs,
                              checkpoint_every=args.checkpoint_every)
  except KeyboardInterrupt:
    print(f"\n{_interrupted(plan, args.seed, args.only)}", file=sys.stderr)
    return 130
  if len(repros) > 1:
    _report(args.out or "results", plots=False, tables=False, strict=False)
  return 0


def _names(given: list[str]) -> list[str]:
  """The reproductions ``run`` names: ``all`` alone, or names from ``list``, each once, in the order given.

  Several run in one process, one after the other as ``all`` does, so that they import JAX and the
  libraries once and share the programs they have in common.
  """
  if "all" in given:
    if len(given) > 1:
      raise _framework.UsageError(f"run all takes no other names, got {' '.join(given)}.")
    return list(_registry.NAMES)
  for name in given:
    if name not in _registry.NAMES:
      raise _framework.UsageError(f"unknown reproduction {name!r}; known: {', '.join(_registry.NAMES)} "
                                  "(python -m experiments list).")
  repeated = sorted({n for n in given if given.count(n) > 1})
  if repeated:
    raise _framework.UsageError(f"run: {', '.join(repeated)} named twice.")
  return list(given)


def _seeds_past_the_last(seed: int, seeds: int, count: str) -> str:
  return (f"--seed {seed} with {seeds} seeds ({count}): the seeds would run from {seed} to {seed + seeds - 1}, "
          f"past the last seed 2**32 - 1 = {2 ** 32 - 1}; give --seed at most {2 ** 32 - seeds} for {seeds} seeds, "
          "or fewer --seeds.")


def _interrupted(plan: list[tuple[Any, dict[str, Any], str]], first_seed: int, only: list[str] | None) -> str:
  """What Ctrl-C leaves: the finished runs, and the checkpoints the interrupted runs resume from."""
  parts, resumable = [], []
  for index, (repro, config, out) in enumerate(plan):
    finished = len(_framework.finished_records(repro, config, out, damaged="skip"))
    parts.append(f"{finished} finished runs of {repro.name} are saved in {os.path.join(out, 'runs')}")
    pending, _ = _framework.pending_runs(repro, config, out, index, first_seed, only)
    resumable += [job.checkpoints for job in pending if _holds_a_checkpoint(job.checkpoints)]
  if len(resumable) == 1:
    kept = f"the interrupted run resumes from its last checkpoint in {resumable[0]}"
  elif resumable:
    kept = f"the {len(resumable)} interrupted runs resume from their last checkpoints in {', '.join(resumable)}"
  else:
    kept = "no interrupted run had written a checkpoint yet, so those start over"
  return f"interrupted: {'; '.join(parts)}; {kept}; rerun the same command to resume."


def _holds_a_checkpoint(folder: str) -> bool:
  """Whether a run's checkpoint folder holds a checkpoint: more than the hidden lock file a run takes at its start
  (a run that writes every ``--checkpoint-every`` seconds may be interrupted before its first write)."""
  return os.path.isdir(folder) and any(not name.startswith(".") for name in os.listdir(folder))


@contextlib.contextmanager
def _shared_compilation_cache(jobs: int):
  """With ``jobs > 1``, the worker processes share their compiled programs through a JAX persistent
  compilation cache in a temporary folder, removed afterwards.

  Each worker is a fresh process, so without it every worker would compile every program the seeds of a
  spec share (``dj.simulate`` compiles once per program within a process). A cache of the user's own
  (``JAX_COMPILATION_CACHE_DIR`` set) is left as it is. A program read from the cache is the one the
  compiler made, so results do not change.
  """
  if jobs <= 1 or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    yield
    return
  names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
  before = {name: os.environ.get(name) for name in names}
  with tempfile.TemporaryDirectory(prefix="delayjax-xla-") as folder:
    # Spawned workers read these when they import JAX; this process has imported it already.
    os.environ.update({names[0]: folder, names[1]: "0"})
    try:
      yield
    finally:
      for name, value in before.items():
        if value is None:
          os.environ.pop(name, None)
        else:
          os.environ[name] = value


def _overrides(pairs: list[str]) -> dict[str, Any]:
  """``--set KEY=VALUE`` pairs as a dict, each VALUE read as JSON (a bare word is a string)."""
  out = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise _framework.UsageError(f"--set expects KEY=VALUE (VALUE in JSON, e.g. lr=0.05 or workers=[4,8]), got "
                                  f"{pair!r}.")
    if key in out:
      raise _framework.UsageError(f"--set {key}: given twice.")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value  # a bare string such as compute=exponential; the config's type check decides
  return out


def _result_dirs(root: str) -> list[str]:
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in ("runs", "checkpoints"))
    if "results.json" in files:
      found.append(directory)
  return found


def _report(root: str, plots: bool = True, tables: bool = True, strict: bool = True) -> int:
  """Rebuilds the outputs of every results.json under ``root`` from its run records.

  Every folder is checked before anything is written: its results.json must be readable, its config one
  of the reproduction's (its settings, their types and ranges) and matched by at least one finished run
  record, or nothing is rewritten (``strict``: the command fails, naming the file; otherwise the folder is
  skipped with a warning, for the summary after ``run all``). An edited config would otherwise match no
  record and the outputs be rewritten empty.
  """
  if not os.path.isdir(root):
    raise FileNotFoundError(f"report {root}: no such folder.")
  dirs = _result_dirs(root)
  if not dirs:
    print(f"no results.json under {root}; run a reproduction with --out {root} first.", file=sys.stderr)
    return 1
  checked = []
  for directory in dirs:
    try:
      saved = _framework.load_results(directory)
      if saved.get("reproduction") not in _registry.NAMES:
        continue  # another tool's results.json (e.g. experiments.delayed_digits)
      repro = _registry.get(saved["reproduction"])
      path = os.path.join(directory, "results.json")
      config = _framework.saved_config(repro, saved["config"], path)
      records = _framework.finished_records(repro, config, directory)
      if not records:
        count = len(_framework.load_records(directory))
        runs = os.path.join(directory, "runs")
        if count:
          raise _framework.UsageError(
              f"{path}: its config matches none of the {count} run records in {runs} (a record counts for the "
              "config it was run with, and this one differs: was it edited?); nothing was rewritten. Restore "
              f"the config, or rerun the reproduction with --out {directory} to rebuild the outputs.")
        raise _framework.UsageError(f"{path}: {runs} holds no run records to report on; nothing was rewritten.")
    except _framework.UsageError as e:
      if strict:
        raise
      print(f"warning: {e} (left out of the summary)", file=sys.stderr)
      continue
    checked.append((directory, repro, config, records))
  lines = ["| reproduction | claim | verdict | mean [95% interval], seeds | figures |", "|---|---|---|---|---|"]
  for directory, repro, config, records in checked:
    result = _framework.finish(repro, config, records, directory, reused=len(records), plots=plots,
                               verbose=tables)
    for c in result["claims"]:
      verdict = c["verdict"] if c["verdict"] == "held" else f"**{c['verdict']}**"
      # A "|" in a cell (a norm, ||x - x*||) would end it: Markdown tables take it escaped.
      statement, figures = (str(c[k]).replace("|", "\\|") for k in ("statement", "figures"))
      lines.append(f"| {repro.name} ({config.get('scale')}) | {statement} | {verdict} | "
                   f"{_framework.claim_summary(c)} | {figures} |")
  table = "\n".join(lines)
  print("\nclaims\n" + table)
  _framework.write_text(os.path.join(root, "claims.md"), table + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
