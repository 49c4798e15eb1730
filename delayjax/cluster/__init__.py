"""Where delays come from (2): workers, clocks and synchronization paradigms, simulated on the host in NumPy."""

from delayjax.cluster._schedule import Schedule as Schedule
