"""Argument checks every runtime front end shares (the server runtime, the replica runtime): one wording for all."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_choice, check_int
from delayjax.runtime._sampling import SAMPLINGS


def check_data(data: Any) -> int:
  """The number of examples in ``data``: a pytree of arrays sharing a leading example axis."""
  leaves = jax.tree.leaves(data)
  if not leaves:
    raise ValueError("data must be a pytree with at least one array leaf, got an empty tree.")
  sizes = [np.shape(x)[0] if np.ndim(x) else None for x in leaves]
  if any(s is None for s in sizes):
    raise ValueError("data leaves must be arrays with a leading example axis; got a scalar leaf.")
  if len(set(sizes)) != 1:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(data)[0]]
    raise ValueError(
        "data leaves must share their leading dimension (the number of examples); got "
        + ", ".join(f"{p or 'data'}: {s}" for p, s in zip(paths, sizes)) + ".")
  if sizes[0] < 1:
    raise ValueError("data must hold at least one example, got a leading dimension of 0.")
  return int(sizes[0])


def check_sampling(data: Any, batch_size: Any, sampling: Any, shards: Any) -> tuple[int, int]:
  """``(batch_size, num_examples)``, after checking how minibatches are drawn from ``data``."""
  batch_size = check_int("batch_size", batch_size, minimum=1)
  check_choice("sampling", sampling, SAMPLINGS)
  if shards is not None and sampling != "shard":
    raise ValueError(f"shards is only used with sampling='shard'; got sampling={sampling!r}.")
  num_examples = check_data(data)
  if sampling == "epoch" and batch_size > num_examples:
    raise ValueError(
        f"batch_size={batch_size} is larger than the data set ({num_examples} examples), which "
        f"sampling='epoch' does not allow.")
  return batch_size, num_examples


def check_not_traced(runtime: str, **trees: Any) -> None:
  """Refuses traced arguments (``jax.vmap`` or ``jax.jit`` around a runtime), which a runtime cannot take: it
  plans its run on the host from concrete values and compiles its own programs."""
  for name, tree in trees.items():
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
      raise TypeError(
          f"{runtime} got a traced {name} (is it called inside jax.vmap, jax.jit or jax.grad?). A runtime plans on "
          f"the host and compiles its own program: call it outside transformations; for many runs in one "
          f"program pass seed=dj.Runs(seeds=[...], hyperparams={{...}}).")


def check_params(params: Any, name: str = "params") -> None:
  """Refuses parameters with no array leaf (nothing to train), naming ``name``."""
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise ValueError(f"{name} must hold at least one array to train, got an empty pytree {params!r}.")
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not hasattr(x, "dtype") and not isinstance(x, (int, float, complex, np.number)):
      raise TypeError(
          f"{name}{jax.tree_util.keystr(path)} must be an array, got {type(x).__name__} {x!r}.")


def tree_like(tree: Any) -> Any:
  """The shapes and dtypes of ``tree``'s leaves (``jax.ShapeDtypeStruct`` leaves, dtypes as JAX would give them):
  what a function is traced on for a compile key or an abstract evaluation."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def batch_like(data: Any, batch_size: int) -> Any:
  """The shapes and dtypes of one minibatch of ``data`` (``jax.ShapeDtypeStruct`` leaves)."""
  # As the runtimes place them: a float64 NumPy array becomes float32 unless x64 is enabled.
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (batch_size,) + np.shape(x)[1:],
      jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))), data)


def loss_has_aux(loss_fn: Callable[..., Any], params: Any, data: Any, batch_size: int,
                 name: str = "loss_fn") -> bool:
  """Whether ``loss_fn(params, batch)`` returns ``(loss, aux)`` rather than a scalar loss, found from its
  output's structure (``jax.eval_shape``: nothing is computed), or a clear error naming ``name``.

  A loss is a real scalar; ``(scalar, aux)``, a tuple or list of two whose
  first entry is one, carries auxiliary output, which the runtimes discard.
  """
  try:
    out = jax.eval_shape(loss_fn, params, batch_like(data, batch_size))
  except (TypeError, ValueError) as e:
    raise type(e)(f"{name}(params, batch) fails on a minibatch of {batch_size} examples: {e}") from e

  def is_loss(x):
    return isinstance(x, jax.ShapeDtypeStruct) and x.shape == () and jnp.issubdtype(x.dtype, jnp.floating)

  if is_loss(out):
    return False
  if isinstance(out, (tuple, list)) and len(out) == 2 and is_loss(out[0]):
    return True
  shapes = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", out)
  raise ValueError(
      f"{name}(params, batch) must return a real scalar loss, or (loss, aux) with a scalar loss first; got "
      f"{shapes}.")
