"""``python -m bench.nexmark``: see :mod:`bench.nexmark.cli`."""

from bench.nexmark.cli import main

main()
