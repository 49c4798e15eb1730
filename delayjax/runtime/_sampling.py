"""Minibatch sampling: a pure function of (seed, update, worker, draw), or of (seed, update) for the server.

The indices of a minibatch depend only on the seed and on which contribution
they belong to, never on how the runtime groups gradients into waves, chunks
or devices, so a run is reproducible and a slow reference can draw the very
same minibatches by calling :func:`minibatch_indices` (the workers') and
:func:`server_minibatch_indices` (the one the server draws for an update's
runtime inputs). The two use disjoint key streams, derived from the seed
like the delays of a delay model (stream 0), so none of them share a key.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SAMPLINGS = ("iid", "epoch", "shard")
# Key streams folded into the seed's key: 0 is a delay model's delays.
_WORKER_STREAM = 1
_SERVER_STREAM = 2
_PLUGIN_STREAM = 3


def shard_table(shards: Sequence[Any] | None, num_examples: int, num_workers: int,
                num_lanes: int) -> tuple[np.ndarray, np.ndarray]:
  """Pads per-worker index shards into an int32 ``[num_lanes, L]`` table and their sizes (``L``: the widest
  shard's size rounded up to a power of two, at most the larger of it and ``num_examples``).

  Without ``shards``, worker ``m`` gets the ``m``-th of ``num_workers``
  contiguous, near-equal pieces of ``range(num_examples)``. Lanes beyond
  ``num_workers`` (device padding) never draw and get a dummy shard.

  Raises:
    ValueError: if ``shards`` has the wrong length, an empty shard, or an
      index outside ``0 .. num_examples - 1``.
  """
  if shards is None:
    if num_examples < num_workers:
      raise ValueError(
          f"sampling='shard' splits the data into one shard per worker, but there are "
          f"{num_workers} workers and only {num_examples} examples.")
    pieces = np.array_split(np.arange(num_examples), num_workers)
  else:
    pieces = [np.asarray(s) for s in shards]
    if len(pieces) != num_workers:
      raise ValueError(f"shards must hold one index array per worker ({num_workers}), got {len(pieces)}.")
    for m, piece in enumerate(pieces):
      if piece.ndim != 1 or piece.size == 0 or not np.issubdtype(piece.dtype, np.integer):
        raise ValueError(f"shards[{m}] must be a non-empty 1-D array of integer indices, got {piece!r}.")
      if piece.min() < 0 or piece.max() >= num_examples:
        raise ValueError(
            f"shards[{m}] holds indices outside 0..{num_examples - 1} "
            f"(min {piece.min()}, max {piece.max()}).")
  # The width rounded up to a power of two (at most the larger of the widest shard and the data set): runs whose
  # shards differ a little in size (a seed's own split) then share one compiled program. Padding is never drawn.
  widest = max(p.size for p in pieces)
  width = min(1 << max(widest - 1, 0).bit_length(), max(widest, num_examples))
  table = np.zeros((num_lanes, width), np.int32)
  sizes = np.ones(num_lanes, np.int32)
  for m, piece in enumerate(pieces):
    table[m, :piece.size] = piece
    sizes[m] = piece.size
  return table, sizes


def minibatch_indices(seed: int, update: Any, worker: Any, draw: Any, *, num_examples: int,
                      batch_size: int, sampling: str = "iid", shard: Any = None,
                      shard_size: Any = None) -> jax.Array:
  """The example indices (int32 ``[batch_size]``) of one minibatch.

  Args:
    seed: the run's seed.
    update: the update the minibatch's gradient is applied at.
    worker: the worker that computes it.
    draw: how many minibatches this worker drew before this one (counting
      every minibatch of multi-batch contributions and of every local step).
    num_examples: the data set size ``N``.
    batch_size: ``B``.
    sampling: ``"iid"``: ``B`` indices uniform on ``0..N-1`` with replacement,
      from the key ``fold_in(fold_in(fold_in(k, update), worker), draw)``;
      ``"epoch"``: the worker reads its own stream of shuffled epochs (epoch
      ``e`` is ``permutation(fold_in(fold_in(k, worker), e), N)``), positions
      ``draw * B .. draw * B + B - 1`` of it; ``"shard"``: ``B`` indices
      drawn with replacement from the worker's shard, keyed like ``"iid"``.
      ``k = fold_in(key(seed), 1)``.
    shard: for ``"shard"``, the worker's padded index row.
    shard_size: for ``"shard"``, how many entries of ``shard`` are real.

  Returns:
    int32 ``[batch_size]`` indices into the data's leading axis.
  """
  base = jax.random.fold_in(jax.random.key(seed), _WORKER_STREAM)
  update = jnp.asarray(update, jnp.int32)
  worker = jnp.asarray(worker, jnp.int32)
  draw = jnp.asarray(draw, jnp.int32)
  if sampling == "epoch":
    stream = jax.random.fold_in(base, worker)
    first = draw * batch_size
    epoch, offset = first // num_examples, first % num_examples
    this = jax.random.permutation(jax.random.fold_in(stream, epoch), num_examples)
    following = jax.random.permutation(jax.random.fold_in(stream, epoch + 1), num_examples)
    position = offset + jnp.arange(batch_size, dtype=jnp.int32)
    wrapped = position >= num_examples
    return jnp.where(wrapped, following[jnp.where(wrapped, position - num_examples, 0)],
                     this[jnp.minimum(position, num_examples - 1)]).astype(jnp.int32)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, update), worker), draw)
  if sampling == "iid":
    return jax.random.randint(key, (batch_size,), 0, num_examples, dtype=jnp.int32)
  if sampling == "shard":
    picks = jax.random.randint(key, (batch_size,), 0, jnp.asarray(shard_size, jnp.int32), dtype=jnp.int32)
    return jnp.asarray(shard, jnp.int32)[picks]
  raise ValueError(f"sampling must be one of {', '.join(map(repr, SAMPLINGS))}; got {sampling!r}.")


def server_minibatch_indices(seed: int, update: Any, *, num_examples: int, batch_size: int) -> jax.Array:
  """The example indices (int32 ``[batch_size]``) of update ``update``'s server minibatch.

  The server draws one minibatch per update for the runtime inputs of
  ``dj.simulate`` (e.g. ``zeno_grad``): ``batch_size`` indices uniform on
  ``0 .. num_examples - 1`` with replacement, from the key
  ``fold_in(fold_in(key(seed), 2), update)``, whatever the workers'
  ``sampling``. Its stream is disjoint from the workers' (whose base key is
  ``fold_in(key(seed), 1)``), so it never repeats a contribution's draw.
  """
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _SERVER_STREAM),
                           jnp.asarray(update, jnp.int32))
  return jax.random.randint(key, (batch_size,), 0, num_examples, dtype=jnp.int32)


def contribution_key(seed: Any, update: Any, worker: Any, draw: Any) -> jax.Array:
  """The PRNG key a worker plug-in gets for one contribution (``WorkerContext.key``).

  ``fold_in(fold_in(fold_in(fold_in(key(seed), 3), update), worker), draw)``:
  a pure function of which contribution it is, like the minibatches, and
  from a stream of its own, so a plug-in's own randomness (rollouts, noise)
  never repeats a minibatch's key.
  """
  base = jax.random.fold_in(jax.random.key(seed), _PLUGIN_STREAM)
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
      base, jnp.asarray(update, jnp.int32)), jnp.asarray(worker, jnp.int32)), jnp.asarray(draw, jnp.int32))
