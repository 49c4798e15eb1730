"""How it runs: the drop-in ``delayed`` wrapper and the wave-parallel simulator."""

from delayjax.runtime._delayed import DelayedState as DelayedState
from delayjax.runtime._delayed import delayed as delayed
from delayjax.runtime._flax import apply_gradients as apply_gradients
