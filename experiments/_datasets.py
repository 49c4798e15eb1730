"""Data sets beyond the bundled digits: CIFAR-10 and MNIST for paper scale, a procedurally generated corpus.

CIFAR-10 and MNIST are read from a local directory in their standard formats
(the python-pickle batches of ``cifar-10-python.tar.gz``; MNIST's idx files,
gzipped or not), or through ``tensorflow_datasets`` when it is installed (as
in Colab). The directory is ``data_dir`` or the ``DELAYJAX_DATA`` environment
variable (a ``cifar-10-batches-py`` or ``mnist`` folder inside it is found too).
Nothing here downloads anything by itself.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from typing import Any

import numpy as np

from experiments.data import Split

ENV = "DELAYJAX_DATA"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte",
}


class DataUnavailable(RuntimeError):
  """A paper-scale data set is neither in a local directory nor loadable with tensorflow_datasets."""


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


def _cifar_from_pickles(root: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  def load(name: str) -> tuple[np.ndarray, np.ndarray]:
    with open(os.path.join(root, name), "rb") as f:
      batch = pickle.load(f, encoding="bytes")
    images = np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[b"labels"], np.int32)

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
    raise ValueError(f"{path} is not an idx file (magic bytes {raw[:4].hex()}).")
  shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
  data = np.frombuffer(raw, dtype=dtypes[code], offset=4 + 4 * ndim)
  if data.size != int(np.prod(shape)):
    raise ValueError(f"{path}: header says shape {shape} but holds {data.size} values.")
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
