"""Flax linen support: pass delayjax's extra arguments through a ``TrainState``."""

from __future__ import annotations

from typing import Any

import optax


def apply_gradients(state: Any, *, grads: Any, **extra_args: Any) -> Any:
  """``TrainState.apply_gradients`` that forwards extra arguments to the optimizer.

  Flax linen's ``TrainState.apply_gradients(grads=..., **kwargs)`` treats its
  keyword arguments as fields to replace, so ``staleness=``, ``stale_params=``
  or ``worker=`` never reach the transformation. This one-line replacement
  calls ``state.tx.update(grads, state.opt_state, state.params, **extra_args)``
  and returns the new state with ``step`` incremented, exactly like the
  built-in otherwise::

    state = dj.apply_gradients(state, grads=grads, worker=m)

  ``dj.delayed`` itself needs no extra arguments, so the built-in
  ``state.apply_gradients(grads=grads)`` already works with it.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or any struct with
      ``step``, ``params``, ``opt_state``, ``tx`` and ``replace``).
    grads: gradients with the structure of ``state.params``.
    **extra_args: forwarded to ``state.tx.update``.

  Returns:
    The updated state.
  """
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **extra_args)
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       opt_state=opt_state)
