"""How it runs: the drop-in ``delayed`` wrapper and the wave-parallel simulator."""
