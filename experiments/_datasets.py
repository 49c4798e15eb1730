"""Data sets beyond the bundled digits: CIFAR-10 and MNIST for paper scale, a procedurally generated corpus.

CIFAR-10 and MNIST are read from a local directory in their standard formats
(the python-pickle batches of ``cifar-10-python.tar.gz``; MNIST's idx files,
gzipped or not), or through ``tensorflow_datasets`` when it is installed (as
in Colab). The directory is ``data_dir`` or the ``DELAYJAX_DATA`` environment
variable (a ``cifar-10-batches-py`` or ``mnist`` folder inside it is found too).
Nothing here downloads anything by itself.

A data directory is read as data, never run: CIFAR-10's pickled batches are
unpickled by :class:`_DataUnpickler`, which builds only dicts, lists, tuples,
strings, bytes, numbers and NumPy arrays, and refuses a file that asks for
anything else (a crafted pickle names a function to call, such as
``os.system``) with a :class:`DataFileError` naming the file, without calling it.
"""

from __future__ import annotations

import gzip
import importlib
import io
import os
import pickle
import struct
from typing import Any

import numpy as np

from .data import Split

ENV = "DELAYJAX_DATA"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte",
}


class DataUnavailable(RuntimeError):
  """A paper-scale data set is neither in a local directory nor loadable with tensorflow_datasets."""


class DataFileError(ValueError):
  """A data file that is not what its name says: a malformed idx file, a CIFAR-10 batch that is not one
  (or that would run code); the message names the file."""


def _roots(data_dir: str | os.PathLike[str] | None, subdirs: tuple[str, ...]) -> list[str]:
  bases = [os.fspath(data_dir)] if data_dir is not None else []
  if os.environ.get(ENV):
    bases.append(os.environ[ENV])
  return [os.path.join(b, s) for b in bases for s in ("",) + subdirs]


def cifar10(data_dir: str | os.PathLike[str] | None = None) -> Split:
  """CIFAR-10 as float32 NHWC images in [0, 1], standardized per channel with the training set's statistics.

  Raises:
    DataUnavailable: with the commands that fix it, when neither a local copy
      nor ``tensorflow_datasets`` is available.
  """
  for root in _roots(data_dir, ("cifar-10-batches-py",)):
    if os.path.exists(os.path.join(root, "data_batch_1")) and os.path.exists(os.path.join(root, "test_batch")):
      return _standardize(*_cifar_from_pickles(root))
  arrays = _from_tfds("cifar10")
  if arrays is not None:
    return _standardize(*arrays)
  raise DataUnavailable(
      "CIFAR-10 was not found: no data_batch_1 .. data_batch_5 and test_batch in "
      f"{_where(data_dir)}, and tensorflow_datasets is not installed. Fix: download {CIFAR_URL}, "
      f"extract it (tar xzf cifar-10-python.tar.gz) and pass --data-dir DIR or set {ENV}=DIR "
      "(DIR holding cifar-10-batches-py/); or pip install tensorflow-datasets.")


def mnist(data_dir: str | os.PathLike[str] | None = None) -> Split:
  """MNIST as float32 images ``[N, 28, 28, 1]`` in [0, 1].

  Raises:
    DataUnavailable: when neither the four idx files nor ``tensorflow_datasets`` are available.
  """
  for root in _roots(data_dir, ("mnist", "MNIST/raw")):
    paths = {k: _idx_path(root, name) for k, name in MNIST_FILES.items()}
    if all(p is not None for p in paths.values()):
      x_train, x_test = (read_idx(paths[k]).astype(np.float32)[..., None] / 255.0 for k in ("x_train", "x_test"))
      y_train, y_test = (read_idx(paths[k]).astype(np.int32) for k in ("y_train", "y_test"))
      return Split(x_train, y_train, x_test, y_test)
  arrays = _from_tfds("mnist")
  if arrays is not None:
    x_train, y_train, x_test, y_test = arrays
    return Split(x_train.astype(np.float32) / 255.0, y_train, x_test.astype(np.float32) / 255.0, y_test)
  raise DataUnavailable(
      f"MNIST was not found: no {', '.join(MNIST_FILES.values())} (optionally .gz) in {_where(data_dir)}, "
      f"and tensorflow_datasets is not installed. Fix: put the four idx files in DIR and pass --data-dir DIR "
      f"or set {ENV}=DIR; or pip install tensorflow-datasets.")


def _where(data_dir: Any) -> str:
  places = [str(data_dir)] if data_dir is not None else []
  if os.environ.get(ENV):
    places.append(f"${ENV}={os.environ[ENV]}")
  return " or ".join(places) if places else f"any directory (none given: pass --data-dir or set {ENV})"


class _Refused(pickle.UnpicklingError):
  """A pickle asks for something a data file has no use for; the message says what."""


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
  """``_codecs.encode`` as pickles of protocol 2 call it to rebuild bytes (``encode(str, "latin1")``), only."""
  if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
    raise _Refused(f"it calls _codecs.encode with {type(text).__name__} and {encoding!r}, not (str, 'latin1')")
  return text.encode("latin1")


def _array_globals() -> dict[tuple[str, str], Any]:
  """The globals a pickle of NumPy arrays and scalars names, by (module, name), under NumPy 1's and 2's names."""
  try:
    multiarray, numeric = (importlib.import_module(f"numpy._core.{m}") for m in ("multiarray", "numeric"))
  except ImportError:  # NumPy 1
    multiarray, numeric = (importlib.import_module(f"numpy.core.{m}") for m in ("multiarray", "numeric"))
  allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                                         ("_codecs", "encode"): _latin1}
  for core in ("numpy.core", "numpy._core"):
    allowed[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct
    allowed[(f"{core}.multiarray", "scalar")] = multiarray.scalar
    allowed[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer
  return allowed


class _DataUnpickler(pickle.Unpickler):
  """Unpickles data only: containers, strings, numbers and NumPy arrays; any other global is refused.

  A pickle builds objects by calling the globals it names; this one resolves exactly those that pickles
  of NumPy arrays and scalars name (``_reconstruct``, ``ndarray``, ``dtype``, ``scalar``,
  ``_frombuffer``, and ``_codecs.encode`` restricted to the latin-1 bytes of protocol 2), and refuses
  every other name before anything is called.
  """

  _allowed = _array_globals()

  def find_class(self, module: str, name: str) -> Any:
    found = self._allowed.get((module, name))
    if found is None:
      raise _Refused(f"it asks for the global {module}.{name}")
    return found


def load_pickled_data(path: str) -> Any:
  """The data pickled in ``path`` (dicts, lists, tuples, strings, bytes, numbers, NumPy arrays), read as
  Python 2's pickles are (byte strings stay bytes); a :class:`DataFileError` naming it for anything else."""
  with open(path, "rb") as f:
    raw = f.read()
  try:
    return _DataUnpickler(io.BytesIO(raw), encoding="bytes").load()
  except _Refused as e:
    raise DataFileError(
        f"{path} was refused: {e}, which a data file has no use for (a CIFAR-10 batch holds only dicts, lists, "
        "strings, numbers and NumPy arrays); nothing in it was run. A --data-dir is read as data, never run: "
        f"replace the file with the one from {CIFAR_URL}.") from None
  except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
          MemoryError) as e:
    raise DataFileError(f"{path} is not a readable pickle ({type(e).__name__}: {e}); replace it with the one "
                        f"from {CIFAR_URL}.") from None


def _cifar_from_pickles(root: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  def load(name: str) -> tuple[np.ndarray, np.ndarray]:
    path = os.path.join(root, name)
    batch = load_pickled_data(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
      keys = sorted(map(repr, batch)) if isinstance(batch, dict) else type(batch).__name__
      raise DataFileError(f"{path} is not a CIFAR-10 batch: it holds {keys}, where a batch is a dict with "
                          "b'data' (uint8 rows of 3072 values) and b'labels'.")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
      raise DataFileError(f"{path} is not a CIFAR-10 batch: b'data' is {data.dtype} {data.shape} and b'labels' has "
                          f"shape {labels.shape}, where a batch is uint8 (N, 3072) and N labels.")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels.astype(np.int32)

  names = sorted(n for n in os.listdir(root) if n.startswith("data_batch_"))
  train = [load(n) for n in names]
  x_test, y_test = load("test_batch")
  return (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]), x_test, y_test)


def _standardize(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> Split:
  x_train = x_train.astype(np.float32) / 255.0
  x_test = x_test.astype(np.float32) / 255.0
  mean = x_train.mean(axis=(0, 1, 2))
  std = x_train.std(axis=(0, 1, 2)) + 1e-6
  return Split((x_train - mean) / std, y_train.astype(np.int32), (x_test - mean) / std, y_test.astype(np.int32))


def _idx_path(root: str, name: str) -> str | None:
  for candidate in (name, name + ".gz", name.replace("-idx", ".idx")):
    path = os.path.join(root, candidate)
    if os.path.exists(path):
      return path
  return None


def read_idx(path: str) -> np.ndarray:
  """Reads an idx file (MNIST's format: big-endian header, dtype code, dimensions, data), gzipped or not."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  zero, code, ndim = struct.unpack(">HBB", raw[:4])
  dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
  if zero != 0 or code not in dtypes:
    raise DataFileError(f"{path} is not an idx file (magic bytes {raw[:4].hex()}).")
  shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
  data = np.frombuffer(raw, dtype=dtypes[code], offset=4 + 4 * ndim)
  if data.size != int(np.prod(shape)):
    raise DataFileError(f"{path}: header says shape {shape} but holds {data.size} values.")
  return data.reshape(shape)


def write_idx(path: str, array: np.ndarray) -> None:
  """Writes a uint8 array as an idx file (the inverse of :func:`read_idx`, for tests and small fixtures)."""
  array = np.ascontiguousarray(array, np.uint8)
  header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "wb") as f:
    f.write(header + array.tobytes())


def _from_tfds(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    return None
  train = tfds.as_numpy(tfds.load(name, split="train", batch_size=-1, as_supervised=True))
  test = tfds.as_numpy(tfds.load(name, split="test", batch_size=-1, as_supervised=True))
  return train[0], np.asarray(train[1], np.int32), test[0], np.asarray(test[1], np.int32)


def markov_corpus(num_tokens: int, vocab: int = 32, seed: int = 0, order_strength: float = 4.0) -> np.ndarray:
  """A procedurally generated token stream: a sparse random second-order Markov chain (no download).

  Each pair of previous tokens has a few likely successors (logits scaled by
  ``order_strength``), so a model that learns the context beats the unigram
  entropy by a wide margin, and the achievable loss is known to be well
  below ``log(vocab)``.
  """
  rng = np.random.default_rng(seed)
  logits = order_strength * rng.standard_normal((vocab, vocab, vocab))
  probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
  probs /= probs.sum(axis=-1, keepdims=True)
  cdf = np.cumsum(probs, axis=-1)
  tokens = np.empty(num_tokens, np.int32)
  tokens[:2] = rng.integers(0, vocab, 2)
  u = rng.random(num_tokens)
  for t in range(2, num_tokens):
    tokens[t] = min(int(np.searchsorted(cdf[tokens[t - 2], tokens[t - 1]], u[t])), vocab - 1)
  return tokens
