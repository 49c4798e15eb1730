"""The CLI under faults: Ctrl-C at any moment of a run, and a paper-scale data set that is not there."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments import _datasets
from experiments.__main__ import main
from tests import fast_compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# `python -m experiments`, with markers on stdout that the test times its Ctrl-C by, each with the time:
# "writing K" as the checkpoint of chunk K starts being written, "done N" once a chunk's checkpoint is written
# and its progress reported (N updates done), "lowered F" as XLA starts compiling the program F and "compiled F
# SECONDS" once it has (JAX's compile events). With SLOW_FIRST_SAVE=S each thread that the process's first
# checkpoint write starts begins S seconds late, as on slow storage: Orbax writes in threads of its own, and a
# checkpoint this small is otherwise written in milliseconds, so that a Ctrl-C would rarely find them at work.
RUNNER = textwrap.dedent("""
    import os
    import runpy
    import signal
    import threading
    import time

    # Ctrl-C raises KeyboardInterrupt, as in a terminal's foreground process, however pytest was started: a
    # process started in the background by a shell without job control (`pytest ... &` in a script) ignores
    # SIGINT, and so do its children, which Python then leaves ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    import jax
    import orbax.checkpoint as ocp

    from experiments import _framework

    report = _framework.RunProgress.__call__
    save = ocp.CheckpointManager.save
    start = threading.Thread.start
    slow = [float(os.environ.get("SLOW_FIRST_SAVE", "0"))]
    saving = []

    def reported(self, done, total):
      print(f"done {done} {time.monotonic()}", flush=True)
      report(self, done, total)

    def writing(self, step, *args, **kwargs):
      print(f"writing {step} {time.monotonic()}", flush=True)
      saving.append(step)
      try:
        return save(self, step, *args, **kwargs)
      finally:
        saving.clear()
        slow[0] = 0.0

    def started(self):
      if slow[0] and saving:
        run, delay = self.run, slow[0]
        self.run = lambda: (time.sleep(delay), run())
      start(self)

    def compiling(event, seconds, fun_name="?", **kwargs):
      name = fun_name.replace(" ", "_")
      if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        print(f"lowered {name} {time.monotonic()}", flush=True)
      elif event == "/jax/core/compile/backend_compile_duration":
        print(f"compiled {name} {time.monotonic()} {seconds}", flush=True)

    _framework.RunProgress.__call__ = reported
    ocp.CheckpointManager.save = writing
    threading.Thread.start = started
    jax.monitoring.register_event_duration_secs_listener(compiling)
    runpy.run_module("experiments", run_name="__main__", alter_sys=True)  # as `python -m experiments` runs
""")
SLOW = 0.1  # seconds each thread of a process's first checkpoint write starts late

CHUNK = 256  # dc_asgd's chunk length for a run of 4096 updates (shared_chunk_size)
# The sequential run of dc_asgd's smoke settings, 4096 updates: 16 chunks, a checkpoint after each
# (--checkpoint-every 0; by default the CLI writes at most every 10 s, which a run this short never reaches).
ARGV = ["run", "dc_asgd", "--smoke", "--only", "sequential", "--steps", str(16 * CHUNK), "--set", "eval_every=1024",
        "--no-plot", "--checkpoint-every", "0"]


def _env():
  # Compiled quickly, as the smoke runs of test_reproductions are (tests/fast_compile.py): the run is mostly
  # compilation and checkpoint writes, and the straight and the interrupted runs compile alike.
  return fast_compile.child_env(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def _start(runner, out, slow_first_save=0.0):
  return subprocess.Popen([sys.executable, str(runner), *ARGV, "--out", str(out)],
                          env=dict(_env(), SLOW_FIRST_SAVE=str(slow_first_save)), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _markers(lines, kinds=("writing", "done")):
  """The ``(kind, number, time)`` of each chunk's marker line (the others are compile markers and the CLI's
  own output)."""
  marks = [line.split() for line in lines]
  return [(m[0], int(m[1]), float(m[2])) for m in marks if len(m) == 3 and m[0] in kinds]


def _record(out):
  with open(os.path.join(out, "runs", "sequential__seed0.json")) as f:
    record = json.load(f)
  record.pop("seconds")  # wall-clock time: the only field a resumed run may differ in
  return record


@pytest.mark.slow
def test_ctrl_c_at_any_moment_exits_130_cleanly_and_the_run_resumes_bit_identically(tmp_path):
  runner = tmp_path / "runner.py"
  runner.write_text(RUNNER)
  straight = _start(runner, tmp_path / "straight", slow_first_save=SLOW)
  stdout, stderr = straight.communicate(timeout=600)
  assert straight.returncode == 0, stderr[-3000:]
  at = {(kind, n): t for kind, n, t in _markers(stdout.splitlines())}
  # How long the first (slowed) checkpoint write takes, a chunk's compute (from one chunk's progress report to
  # the start of the next one's checkpoint write), and which program takes longest to compile (the chunk's):
  # each trial's Ctrl-C lands within one of the three.
  first_write = at["done", CHUNK] - at["writing", 1]
  computes = sorted(at["writing", k] - at["done", (k - 1) * CHUNK] for k in range(2, 17))
  compute = computes[len(computes) // 2]
  compiles = [line.split() for line in stdout.splitlines() if line.startswith("compiled ")]
  _, longest, _, compile_seconds = max(compiles, key=lambda c: float(c[3]))
  compile_seconds = float(compile_seconds)

  out = tmp_path / "interrupted"
  rng = random.Random(0)
  resumes_at = 0  # the chunk the next process starts from: the last one whose checkpoint write began
  # Three Ctrl-Cs during the compile, where Python's shutdown once crashed under XLA (3 of 10 such Ctrl-Cs), two
  # during a checkpoint write, two during compute: each trial is a process that imports JAX and compiles. The
  # first writes a checkpoint, so that every trial has one to resume from.
  for trial, moment in enumerate(("write", "compile", "compute", "compile", "write", "compute", "compile")):
    proc = _start(runner, out, slow_first_save=SLOW if moment == "write" else 0.0)
    lines = []
    try:
      for line in proc.stdout:
        lines.append(line)
        kind, _, fields = line.partition(" ")
        if moment == "write" and kind == "writing":
          # In the first half of the write, where Orbax's threads write the arrays and metadata.
          time.sleep(rng.uniform(0.15, 0.45) * first_write)
          break
        if moment == "compute" and kind == "done":
          time.sleep(rng.uniform(0.1, 0.9) * compute)  # within the next chunk's compute
          break
        if moment == "compile" and kind == "lowered" and fields.split()[0] == longest:
          time.sleep(rng.uniform(0.1, 0.9) * compile_seconds)  # while XLA compiles it, in threads of its own
          break
      proc.send_signal(signal.SIGINT)
      rest, stderr = proc.communicate(timeout=120)
    finally:
      proc.kill()
    lines += rest.splitlines()
    assert proc.returncode == 130, (trial, moment, proc.returncode, stderr[-3000:])
    for noise in ("Traceback", "Event loop is closed", "cannot schedule new futures", "Exception ignored",
                  "Fatal Python error"):
      assert noise not in stderr, (trial, moment, stderr[-3000:])
    assert stderr.count("interrupted:") == 1 and "resumes from its last checkpoint in" in stderr, stderr[-3000:]
    # It continued from the last checkpoint the previous process began writing: that write was completed
    # (a Ctrl-C during a write waits for it), and none was lost or redone.
    writes = [n for kind, n, _ in _markers(lines, ("writing",))]
    if writes:
      assert writes[0] == resumes_at + 1, (trial, moment, writes, resumes_at)
      resumes_at = writes[-1]
  assert 0 < resumes_at < 16  # the interrupted processes left chunks for the last one

  last = _start(runner, out)
  stdout, stderr = last.communicate(timeout=600)
  assert last.returncode == 0, stderr[-3000:]
  assert _markers(stdout.splitlines())[0][:2] == ("writing", resumes_at + 1)
  assert _record(out) == _record(tmp_path / "straight")


def test_a_missing_paper_data_set_is_one_message_and_exit_2(tmp_path, capsys, monkeypatch):
  # As on a machine without tensorflow_datasets and without the data: the loader finds nothing anywhere.
  monkeypatch.setattr(_datasets, "_from_tfds", lambda name: None)
  monkeypatch.delenv(_datasets.ENV, raising=False)
  empty = tmp_path / "data"
  empty.mkdir()
  status = main(["run", "dc_asgd", "--scale", "paper", "--only", "sequential", "--data-dir", str(empty), "--out",
                 str(tmp_path / "out"), "--no-plot"])
  err = capsys.readouterr().err
  assert status == 2  # as argparse's errors: the command cannot be carried out as given
  assert "error: CIFAR-10 was not found" in err and str(empty) in err and "--data-dir" in err
  assert err.count("error:") == 1 and "Traceback" not in err
  assert not list((tmp_path / "out").glob("runs/*.json"))  # no run was recorded


@pytest.fixture
def interruptible():
  """SIGINT handled by Python (KeyboardInterrupt) in this process during the test, as in a terminal's foreground
  process: a pytest started in the background by a shell without job control ignores it."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("interruptible")
def test_a_ctrl_c_during_a_checkpoint_write_takes_effect_after_it_and_a_second_one_at_once():
  from delayjax.runtime import _checkpoint

  handler = signal.getsignal(signal.SIGINT)
  steps = []
  with pytest.raises(KeyboardInterrupt):
    with _checkpoint._uninterrupted():
      signal.raise_signal(signal.SIGINT)
      steps.append("write finished")  # the block runs to its end first
  assert steps == ["write finished"] and signal.getsignal(signal.SIGINT) is handler
  with pytest.raises(KeyboardInterrupt):
    with _checkpoint._uninterrupted():
      signal.raise_signal(signal.SIGINT)
      signal.raise_signal(signal.SIGINT)
      steps.append("not reached")
  assert steps == ["write finished"] and signal.getsignal(signal.SIGINT) is handler


@pytest.mark.usefixtures("interruptible")
def test_a_ctrl_c_that_python_would_drop_still_interrupts_the_command():
  import gc

  from experiments.__main__ import _interrupts_are_not_lost

  raised = []

  def callback(phase, info):
    # As a Ctrl-C landing in JAX's garbage-collection callback: Python reports it as unraisable and goes on.
    if not raised:
      raised.append(phase)
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    with _interrupts_are_not_lost():
      gc.callbacks.append(callback)
      try:
        gc.collect()
      finally:
        gc.callbacks.remove(callback)
      assert raised  # the first one was dropped: the command went on
      time.sleep(60)  # the interrupt delivered again ends this well before
  assert raised == ["start"]
