"""Saving and loading schedules as ``.npz`` files: one format, a format tag and version, errors that say what."""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

_FORMAT, _VERSION, _EXTRAS = "format", "format_version", "extras/"


def save_npz(path: str | os.PathLike[str], kind: str, version: int, arrays: dict[str, Any],
             extras: dict[str, Any]) -> None:
  """Writes ``arrays`` and ``extras`` (under ``extras/``) to ``path``, uncompressed, tagged ``kind`` and ``version``.

  Exact: every array keeps its dtype and bits. No pickles, so :func:`load_npz` reads it with
  ``allow_pickle=False``.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}.")
  out = dict(arrays)
  out[_FORMAT] = np.asarray(kind)
  out[_VERSION] = np.asarray(version, np.int64)
  for key, value in extras.items():
    out[_EXTRAS + key] = value
  with open(path, "wb") as f:
    np.savez(f, **out)


def load_npz(path: str | os.PathLike[str], kind: str, version: int,
             required: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """``(fields, extras)`` of a file written by :func:`save_npz` as ``kind``, or by an untagged older save.

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: not an ``.npz`` file, a file of another kind (e.g. a ``GossipSchedule`` read as a
      ``Schedule``), a newer format version than ``version``, or a field in ``required`` missing; each
      names the file.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}.")
  name = os.fspath(path)
  unreadable = (zipfile.BadZipFile, EOFError, ValueError, OSError)
  try:
    data = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise
  except unreadable as e:
    raise ValueError(f"{name!r} is not a readable {kind} file (.npz written by {kind}.save): "
                     f"{type(e).__name__}: {e}") from e
  if not hasattr(data, "files"):
    raise ValueError(f"{name!r} holds one array, not a {kind} file (.npz written by {kind}.save).")
  with data:
    try:
      fields = {k: data[k] for k in data.files if not k.startswith(_EXTRAS)}
      extras = {k[len(_EXTRAS):]: data[k] for k in data.files if k.startswith(_EXTRAS)}
    except unreadable as e:
      # A damaged member (a truncated or altered file) fails here, when it is read.
      raise ValueError(f"{name!r} is damaged: {type(e).__name__}: {e}") from e
  found = str(fields.pop(_FORMAT, kind))
  found_version = int(fields.pop(_VERSION, 0))
  if found != kind:
    raise ValueError(f"{name!r} holds a {found}, not a {kind}; read it with {found}.load.")
  if found_version > version:
    raise ValueError(f"{name!r} was written in {kind} format version {found_version}; this delayjax "
                     f"reads versions up to {version}.")
  missing = [k for k in required if k not in fields]
  if missing:
    raise ValueError(f"{name!r} is not a complete {kind} file: it lacks {', '.join(missing)}.")
  return fields, extras
