"""How the tests that check what runs, not the bits a program rounds to, have XLA compile quickly.

Smoke runs, the reproductions' runs in child processes and the ``fast_compile`` test directories (see
conftest.py) are almost all compilation. Two compiler settings take a third to a half off it: LLVM at -O0
(``xla_backend_optimization_level=0``) and XLA's CPU code generator without its MLIR-based fusion emitters
(``xla_cpu_use_fusion_emitters=false``; a user's program gets them by default). Measured on this suite's
programs: transforms' tests 331 -> 213 CPU s, the streaming_diloco, weight_prediction and async_rl smoke runs
177 -> 109 CPU s. Both change the code XLA generates, and with it at times how a result rounds, never what is
computed; so the tests that pin bits across differently shaped programs compile as users' programs do, and
tests/sharding keeps the fusion emitters (``fast_compile(fusion_emitters=True)``).
"""

import os

# For a child process: its XLA_FLAGS, added to the caller's.
FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

# For a program compiled in this process: what jax_disable_most_optimizations does not already set.
OVERRIDES = (("xla_cpu_use_fusion_emitters", False),)


def child_env(**extra: str) -> dict[str, str]:
  """This process's environment for a child that compiles quickly: XLA_FLAGS extended by :data:`FLAGS`."""
  return dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAGS}".strip(), **extra)
