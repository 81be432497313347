"""raystream benchmarks (not packaged). Run them from the repository root, e.g.
``python -m bench.keycount --help``."""
