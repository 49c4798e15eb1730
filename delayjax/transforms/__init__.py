"""What to do with a stale gradient: Optax gradient transformations."""
