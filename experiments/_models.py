"""Models of the paper-scale reproductions (Flax linen, used as pure functions of their parameters)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


class _Block(nn.Module):
  """A basic residual block: two 3x3 convolutions with batch norm, projection shortcut when the shape changes."""

  features: int
  stride: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    norm = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9)  # noqa: E731
    y = nn.Conv(self.features, (3, 3), (self.stride, self.stride), padding="SAME", use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(y)
    y = norm()(y)
    if x.shape[-1] != self.features or self.stride != 1:
      x = nn.Conv(self.features, (1, 1), (self.stride, self.stride), use_bias=False)(x)
      x = norm()(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """The CIFAR ResNet of He et al. (2016): 6n + 2 layers, widths 16-32-64; ``n = 3`` is ResNet-20."""

  blocks_per_stage: int = 3
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(16, (3, 3), padding="SAME", use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
    for stage, features in enumerate((16, 32, 64)):
      for block in range(self.blocks_per_stage):
        x = _Block(features, 2 if stage > 0 and block == 0 else 1)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def resnet20(num_classes: int = 10) -> tuple[Callable[[jax.Array], Any], Callable[[Any, jax.Array], jax.Array]]:
  """ResNet-20 as ``(init(key) -> params, apply(params, images) -> logits)`` for NHWC float images.

  Batch normalization always uses the statistics of the batch it is given
  (the running averages are not tracked): in an asynchronous simulation the
  workers' parameters are pure functions of the server's, so there is no
  per-worker state to keep. Evaluate in large batches (the task does, 500
  images at a time), which makes the batch statistics close to the data set's.
  """
  model = ResNet(3, num_classes)
  example = jnp.zeros((2, 32, 32, 3), jnp.float32)
  stats_shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), example))["batch_stats"]

  def init(key: jax.Array) -> Any:
    return model.init(key, example)["params"]

  def apply(params: Any, x: jax.Array) -> jax.Array:
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shapes)
    logits, _ = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    return logits

  return init, apply



class _DecoderBlock(nn.Module):
  """Pre-norm causal self-attention and MLP."""

  heads: int
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class TransformerLM(nn.Module):
  """A small decoder-only Transformer language model with learned positions."""

  vocab: int
  width: int = 64
  depth: int = 2
  heads: int = 4
  max_len: int = 64

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.width)(tokens)
    x = x + nn.Embed(self.max_len, self.width)(jnp.arange(tokens.shape[-1]))
    for _ in range(self.depth):
      x = _DecoderBlock(self.heads, self.width)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def transformer_lm(vocab: int, width: int, depth: int, heads: int, seq_len: int
                   ) -> tuple[Callable[[jax.Array], Any], Callable[[Any, jax.Array], jax.Array]]:
  """``(init(key) -> params, apply(params, tokens [B, T]) -> logits [B, T, vocab])``."""
  model = TransformerLM(vocab, width, depth, heads, seq_len)

  def init(key: jax.Array) -> Any:
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]

  def apply(params: Any, tokens: jax.Array) -> jax.Array:
    return model.apply({"params": params}, tokens)

  return init, apply
