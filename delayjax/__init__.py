"""delayjax: delayed-gradient optimization in JAX.

Optax transformations that decide what to do with a stale gradient, models and
cluster simulations that say where delays come from, and runtimes that train
under them exactly.
"""

from delayjax import cluster as cluster
from delayjax import delays as delays

__version__ = "0.1.0"
