"""What a checkpoint says when it cannot be resumed or written, through the experiments CLI.

Each test leaves a checkpoint by interrupting ``python -m experiments run dc_asgd`` after its first chunk
(the sequential run of the smoke settings, 768 updates: 3 chunks of 256, a checkpoint after each), then
damages it, re-versions it or makes the next save fail.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import subprocess
import sys

import orbax.checkpoint as ocp
import pytest

from delayjax.runtime import _checkpoint
from experiments import _framework
from experiments.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A checkpoint after every chunk (--checkpoint-every 0): the tests damage, replace or fill the disk under the
# checkpoints of a short run, which the CLI's default interval of 10 s would not write.
ARGV = ["run", "dc_asgd", "--smoke", "--only", "sequential", "--steps", "768", "--set", "eval_every=256", "--no-plot",
        "--checkpoint-every", "0"]
CHUNK = 256

pytestmark = pytest.mark.standard_promotion  # the reproductions run optax code that mixes int and float


def _reports(monkeypatch, seen, stop_at=None):
  """Records each chunk's progress report (updates done) in ``seen``; Ctrl-C at ``stop_at`` updates done."""
  report = _framework.RunProgress.__call__

  def reported(self, done, total):
    seen.append(done)
    if done == stop_at:
      raise KeyboardInterrupt
    report(self, done, total)

  monkeypatch.setattr(_framework.RunProgress, "__call__", reported)


def _interrupted_after_one_chunk(out, monkeypatch, capsys):
  """The run stopped by Ctrl-C once its first chunk's checkpoint is written; its checkpoint folder."""
  with monkeypatch.context() as m:
    _reports(m, [], stop_at=CHUNK)
    assert main([*ARGV, "--out", str(out)]) == 130
  capsys.readouterr()
  (folder,) = glob.glob(os.path.join(out, "checkpoints", "*"))
  return folder


def _record(out):
  with open(os.path.join(out, "runs", "sequential__seed0.json")) as f:
    record = json.load(f)
  record.pop("seconds")
  return record


@pytest.mark.fast_compile
@pytest.mark.slow
def test_a_checkpoint_of_another_format_version_names_both_versions(tmp_path, monkeypatch, capsys):
  folder = _interrupted_after_one_chunk(tmp_path / "out", monkeypatch, capsys)
  (meta_path,) = glob.glob(os.path.join(folder, "*", "1", "meta", "metadata"))
  with open(meta_path) as f:
    meta = json.load(f)
  # As a later delayjax would write it: intact (its checksum matches its content), another format number.
  meta["format"] = 4
  meta["sha256"] = _checkpoint._json_digest({k: v for k, v in meta.items() if k != "sha256"})
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  assert main([*ARGV, "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert "is in checkpoint format 4 (written by another version of delayjax); this version of delayjax reads " \
         "format 3" in err
  assert "damaged" not in err and "Traceback" not in err
  assert f"delete {folder} to start that run over" in err


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device", "state/d/0"),
    # What Orbax raised on a full tmpfs: tensorstore's error, the errno in its message.
    ValueError('RESOURCE_EXHAUSTED: Error writing "0/0" in OCDBT database at local file "state/": Failed to '
               "write 5626 bytes to file 12: No space left on device [os_error_code='28']"),
], ids=["oserror", "tensorstore"])
@pytest.mark.slow
def test_a_full_disk_names_checkpoint_dir_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch, capsys,
                                                                              failure):
  straight = tmp_path / "straight"
  assert main([*ARGV, "--out", str(straight)]) == 0
  out = tmp_path / "out"
  save = ocp.CheckpointManager.save
  calls = []

  def second_save_fails(self, step, *args, **kwargs):
    calls.append(step)
    if len(calls) == 2:
      # Raised from inside Orbax's save, chained as its threads chain it.
      try:
        raise failure
      except Exception as e:
        raise RuntimeError("a save thread failed") from e
    return save(self, step, *args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(ocp.CheckpointManager, "save", second_save_fails)
    capsys.readouterr()
    assert main([*ARGV, "--out", str(out)]) == 1
  err = capsys.readouterr().err
  (folder,) = glob.glob(os.path.join(out, "checkpoints", "*"))
  assert (f"error: checkpoint directory {folder}: the checkpoint after chunk 2 could not be written (No space left on "
          "device); the previous checkpoint (after chunk 1) is intact: free some space, then rerun to resume from "
          "it.") in err
  assert "Traceback" not in err and "RuntimeError" not in err
  # The rerun resumes from that checkpoint (its first report is the second chunk's) and ends where a run never
  # interrupted ends, bit for bit.
  seen = []
  with monkeypatch.context() as m:
    _reports(m, seen)
    assert main([*ARGV, "--out", str(out)]) == 0
  assert seen == [2 * CHUNK, 3 * CHUNK]
  assert _record(out) == _record(straight)


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_message_without_orbax_noise(tmp_path, monkeypatch, capsys):
  out = tmp_path / "out"
  folder = _interrupted_after_one_chunk(out, monkeypatch, capsys)
  shards = glob.glob(os.path.join(folder, "*", "1", "state", "d", "*"))
  largest = max(shards, key=os.path.getsize)
  raw = bytearray(open(largest, "rb").read())
  raw[len(raw) // 2] ^= 1
  with open(largest, "wb") as f:
    f.write(bytes(raw))
  # In a process of its own: what Orbax's threads and asyncio print goes to the real stderr there (here
  # pytest would catch the unraisable exceptions itself).
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, "-m", "experiments", *ARGV, "--out", str(out)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 2, done.stderr[-3000:]
  errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith("error: checkpoint "), done.stderr[-3000:]
  assert "/1/state is damaged or truncated (cannot be read: " in errors[0] and "tensorstore_spec" not in errors[0]
  assert f"delete {folder} to start that run over" in errors[0]
  for noise in ("Traceback", "Event loop is closed", "absl", "Exception ignored"):
    assert noise not in done.stderr, done.stderr[-3000:]


_SPEC = '{"context":{"cache_pool":{}},"driver":"zarr","kvstore":{"path":"13/"},"shape":[2,3]}'
_READ_FAILED = ValueError(f'DATA_LOSS: Error reading "13/.zarray" in OCDBT database: Error decoding b-tree node: '
                          f"CRC-32C checksum verification failed [tensorstore_spec='{_SPEC}'] "
                          f"[tensorstore_spec[1]='{_SPEC}']")


@pytest.mark.parametrize("error", [
    _READ_FAILED,
    # Another error's repr inside the message (its quotes escaped), over several lines.
    RuntimeError(f"reads failed:\n{_READ_FAILED!r}\n{_READ_FAILED!r}"),
], ids=["plain", "escaped_multiline"])
def test_a_read_error_is_named_on_one_line_without_tensorstore_specs(error):
  short = _checkpoint._short(error)
  assert "\n" not in short and "tensorstore_spec" not in short and "driver" not in short
  assert short.count("CRC-32C checksum verification failed") == str(error).count("CRC-32C")


def _never_retrieved(caplog):
  """The records asyncio logs for a failed tensorstore-like task whose exception nobody retrieved."""
  import asyncio
  import gc

  async def read():
    raise _READ_FAILED

  loop = asyncio.new_event_loop()
  try:
    task = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0))
  finally:
    loop.close()
  caplog.clear()
  del task
  gc.collect()
  return [r for r in caplog.records if r.name == "asyncio"]


def test_reads_that_failed_beside_the_raised_one_are_not_logged_once_a_call_failed(caplog):
  asyncio_logger = __import__("logging").getLogger("asyncio")
  before = list(asyncio_logger.filters)
  try:
    for f in before:
      asyncio_logger.removeFilter(f)
    # Outside any failed checkpoint call asyncio reports the task: what the filter is there to drop.
    assert [r.getMessage().splitlines()[0] for r in _never_retrieved(caplog)] == ["Task exception was never retrieved"]
    with _checkpoint._quiet_orbax():
      pass
    assert _never_retrieved(caplog), "a call that succeeded leaves asyncio's reports as they were"
    with pytest.raises(ValueError), _checkpoint._quiet_orbax():
      raise _READ_FAILED
    # After a failed call the process keeps dropping them: the tasks are collected after the call returned.
    assert _never_retrieved(caplog) == []
    with pytest.raises(ValueError), _checkpoint._quiet_orbax():
      raise _READ_FAILED
    assert sum(getattr(f, "drops_unretrieved_tensorstore_errors", False) for f in asyncio_logger.filters) == 1
  finally:
    for f in list(asyncio_logger.filters):
      asyncio_logger.removeFilter(f)
    for f in before:
      asyncio_logger.addFilter(f)
