"""delayjax experiments: paper reproductions and benchmarks (not part of the installed package)."""
