"""Paper-scale loaders on small files written here in the real formats; the procedurally generated corpus."""

import builtins
import gzip
import pickle

import numpy as np
import pytest

from experiments import _datasets


@pytest.fixture
def no_tfds(monkeypatch):
  """Makes ``import tensorflow_datasets`` fail, as on a machine without it."""
  real_import = builtins.__import__

  def fake_import(name, *args, **kwargs):
    if name.startswith("tensorflow_datasets"):
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", fake_import)
  monkeypatch.delenv(_datasets.ENV, raising=False)


def _write_cifar(root, rng, per_batch=4, train_batches=5):
  root.mkdir(parents=True)
  batches = {}
  for name in [f"data_batch_{i}" for i in range(1, train_batches + 1)] + ["test_batch"]:
    data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, per_batch).tolist()
    with open(root / name, "wb") as f:
      pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
    batches[name] = (data, labels)
  return batches


def test_cifar10_from_local_pickles(tmp_path, no_tfds):
  rng = np.random.default_rng(0)
  batches = _write_cifar(tmp_path / "cifar-10-batches-py", rng)
  split = _datasets.cifar10(tmp_path)
  assert split.x_train.shape == (20, 32, 32, 3) and split.x_test.shape == (4, 32, 32, 3)
  assert split.x_train.dtype == np.float32 and split.y_train.dtype == np.int32
  assert split.y_train.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
  # Channel-major rows become NHWC images: pixel (row 1, col 2) of channel c is at c * 1024 + 1 * 32 + 2.
  raw = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)]).astype(np.float32) / 255
  images = raw.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  mean, std = images.mean(axis=(0, 1, 2)), images.std(axis=(0, 1, 2)) + 1e-6
  np.testing.assert_allclose(split.x_train, (images - mean) / std, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(split.x_train.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)


class _RunsCode:
  """Pickles as a call of ``function(argument)``: what a crafted data file does when it is unpickled."""

  def __init__(self, function, argument):
    self.function, self.argument = function, argument

  def __reduce__(self):
    return self.function, (self.argument,)


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("how", ["exec", "os.system", "inside a batch"])
def test_a_crafted_cifar10_batch_is_refused_and_its_code_never_runs(tmp_path, no_tfds, protocol, how):
  import os

  root = tmp_path / "cifar-10-batches-py"
  _write_cifar(root, np.random.default_rng(5), per_batch=2)
  marker = tmp_path / "ran"
  code = {"exec": _RunsCode(exec, f"open({str(marker)!r}, 'w').write('ran')"),
          "os.system": _RunsCode(os.system, f"touch '{marker}'"),
          "inside a batch": {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1],
                             b"batch_label": _RunsCode(exec, f"open({str(marker)!r}, 'w').write('ran')")}}[how]
  crafted = pickle.dumps(code, protocol=protocol)
  # The file is what the test says it is: plain pickle would run its code.
  pickle.loads(crafted)
  assert marker.exists()
  marker.unlink()
  (root / "data_batch_1").write_bytes(crafted)
  # Named as the pickle names it: builtins.exec (__builtin__.exec at protocol 2), os.system as posix.system.
  function = "system" if how == "os.system" else "exec"
  with pytest.raises(_datasets.DataFileError, match=f"{root / 'data_batch_1'} was refused: it asks for the global "
                     rf"\w+\.{function},.*nothing in it was run"):
    _datasets.cifar10(tmp_path)
  assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_cifar10_batch_written_with_pickle_still_loads(tmp_path, no_tfds, protocol):
  root = tmp_path / "cifar-10-batches-py"
  rng = np.random.default_rng(6)
  _write_cifar(root, rng, per_batch=3)
  # One batch as other tools write one: NumPy integer labels, an array of file names, a nested tuple.
  data = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
  labels = [np.int64(v) for v in (4, 0, 9)]
  with open(root / "data_batch_2", "wb") as f:
    pickle.dump({b"data": data, b"labels": labels, b"filenames": np.array([b"a.png", b"b.png", b"c.png"]),
                 b"batch_label": "training batch 2 of 5", b"meta": (1, 2.5, None, True)}, f, protocol=protocol)
  split = _datasets.cifar10(tmp_path)
  assert split.y_train[3:6].tolist() == [4, 0, 9]
  raw = np.concatenate([pickle.loads((root / f"data_batch_{i}").read_bytes())[b"data"] for i in range(1, 6)])
  images = raw.astype(np.float32).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1) / 255
  mean, std = images.mean(axis=(0, 1, 2)), images.std(axis=(0, 1, 2)) + 1e-6
  np.testing.assert_allclose(split.x_train, (images - mean) / std, rtol=1e-5, atol=1e-5)


def test_a_file_that_is_not_a_cifar10_batch_is_named(tmp_path, no_tfds):
  root = tmp_path / "cifar-10-batches-py"
  _write_cifar(root, np.random.default_rng(7), per_batch=2)
  (root / "test_batch").write_bytes(pickle.dumps([1, 2, 3]))
  with pytest.raises(_datasets.DataFileError, match=f"{root / 'test_batch'} is not a CIFAR-10 batch: it holds list"):
    _datasets.cifar10(tmp_path)
  (root / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}))
  with pytest.raises(_datasets.DataFileError, match=r"b'data' is uint8 \(2, 10\)"):
    _datasets.cifar10(tmp_path)
  (root / "test_batch").write_bytes(b"\x80\x04not a pickle")
  with pytest.raises(_datasets.DataFileError, match=f"{root / 'test_batch'} is not a readable pickle"):
    _datasets.cifar10(tmp_path)


def test_cifar10_from_the_environment_variable(tmp_path, no_tfds, monkeypatch):
  _write_cifar(tmp_path / "cifar-10-batches-py", np.random.default_rng(1), per_batch=2)
  monkeypatch.setenv(_datasets.ENV, str(tmp_path))
  assert _datasets.cifar10().x_train.shape == (10, 32, 32, 3)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, no_tfds, gz):
  rng = np.random.default_rng(2)
  arrays = {"x_train": rng.integers(0, 256, (6, 28, 28)), "y_train": rng.integers(0, 10, 6),
            "x_test": rng.integers(0, 256, (3, 28, 28)), "y_test": rng.integers(0, 10, 3)}
  for key, name in _datasets.MNIST_FILES.items():
    _datasets.write_idx(str(tmp_path / (name + (".gz" if gz else ""))), arrays[key])
  split = _datasets.mnist(tmp_path)
  assert split.x_train.shape == (6, 28, 28, 1) and split.x_train.dtype == np.float32
  np.testing.assert_allclose(split.x_train[..., 0], arrays["x_train"] / 255.0, rtol=1e-6)
  assert split.y_test.tolist() == arrays["y_test"].tolist()


def test_read_idx_checks_the_header(tmp_path):
  path = tmp_path / "bad-idx"
  path.write_bytes(b"\x01\x02\x08\x01" + b"\x00\x00\x00\x02" + b"ab")
  with pytest.raises(ValueError, match="not an idx file"):
    _datasets.read_idx(str(path))
  short = tmp_path / "short.gz"
  with gzip.open(short, "wb") as f:
    f.write(b"\x00\x00\x08\x01" + b"\x00\x00\x00\x05" + b"abc")
  with pytest.raises(ValueError, match="holds 3 values"):
    _datasets.read_idx(str(short))


def test_missing_data_names_the_fix(tmp_path, no_tfds):
  with pytest.raises(_datasets.DataUnavailable, match="cifar-10-python.tar.gz.*--data-dir.*tensorflow-datasets"):
    _datasets.cifar10(tmp_path)
  with pytest.raises(_datasets.DataUnavailable, match="train-images-idx3-ubyte.*tensorflow-datasets"):
    _datasets.mnist(tmp_path)


def test_markov_corpus_is_learnable_and_deterministic():
  tokens = _datasets.markov_corpus(20_000, vocab=16, seed=3)
  assert tokens.dtype == np.int32 and tokens.min() >= 0 and tokens.max() < 16
  np.testing.assert_array_equal(tokens, _datasets.markov_corpus(20_000, vocab=16, seed=3))
  # The empirical conditional entropy given two previous tokens is far below the unigram entropy.
  counts = np.zeros((16, 16, 16))
  np.add.at(counts, (tokens[:-2], tokens[1:-1], tokens[2:]), 1)
  joint = counts / counts.sum()
  context = joint.sum(axis=-1, keepdims=True)
  conditional = -np.nansum(joint * np.log(np.where(joint > 0, joint / np.maximum(context, 1e-12), 1)))
  unigram = np.bincount(tokens, minlength=16) / tokens.size
  assert conditional < 0.6 * -np.sum(unigram * np.log(unigram))


@pytest.mark.slow
def test_paper_scale_tasks_build_from_local_files(tmp_path, no_tfds):
  import jax
  import jax.numpy as jnp

  from experiments._training import task_for

  rng = np.random.default_rng(4)
  _write_cifar(tmp_path / "cifar-10-batches-py", rng, per_batch=2)
  cifar = task_for({"data": "cifar10", "model": "resnet20", "data_dir": str(tmp_path)})
  params = cifar.init(0)
  # ResNet-20 with 1x1 projection shortcuts: about 0.27 M parameters.
  assert 0.26e6 < sum(x.size for x in jax.tree.leaves(params)) < 0.28e6
  batch = jax.tree.map(lambda x: jnp.asarray(x[:4]), cifar.data)
  # Compiling ResNet-20 is this test's cost; XLA's backend optimization changes its speed, not what it computes.
  quick = dict(compiler_options={"xla_backend_optimization_level": 0})
  loss, grads = jax.jit(jax.value_and_grad(cifar.loss_fn), **quick)(params, batch)
  assert np.isfinite(float(loss)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  metrics = jax.jit(cifar.eval_fn, **quick)(params)
  assert 0.0 <= float(metrics["test_error"]) <= 1.0

  for key, name in _datasets.MNIST_FILES.items():
    shape = (5, 28, 28) if key.startswith("x") else (5,)
    _datasets.write_idx(str(tmp_path / name), rng.integers(0, 10, shape))
  mnist = task_for({"data": "mnist", "model": "mlp", "hidden": [16], "data_dir": str(tmp_path)})
  assert mnist.data["x"].shape == (5, 784)
  assert np.isfinite(float(mnist.loss_fn(mnist.init(0), jax.tree.map(jnp.asarray, mnist.data))))


@pytest.mark.parametrize("eval_batch", [None, 10, 23, 5, 1])
def test_the_evaluation_counts_every_example_whatever_its_batches(eval_batch):
  # 23 training and 7 test examples: batches of 10 (or 5) leave a rest, which must be evaluated too; batches of 1
  # leave none.
  import jax

  from experiments._training import classification_task
  from experiments.data import Split

  rng = np.random.default_rng(5)
  split = Split(rng.normal(size=(23, 4)).astype(np.float32), rng.integers(0, 3, 23),
                rng.normal(size=(7, 4)).astype(np.float32), rng.integers(0, 3, 7))
  w = rng.normal(size=(4, 3)).astype(np.float32)
  task = classification_task(split, lambda p, x: x @ p, lambda key: w, eval_batch=eval_batch)
  metrics = jax.jit(task.eval_fn)(w)

  def logits(x):
    return x.astype(np.float64) @ w.astype(np.float64)

  z = logits(split.x_train)
  log_softmax = z - z.max(axis=1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
  np.testing.assert_allclose(float(metrics["train_loss"]), -log_softmax[np.arange(23), split.y_train].mean(),
                             rtol=1e-5)
  np.testing.assert_allclose(float(metrics["test_error"]), np.mean(logits(split.x_test).argmax(1) != split.y_test),
                             rtol=1e-6)
