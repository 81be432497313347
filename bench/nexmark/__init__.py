"""NEXMark on raystream: a vectorised generator, a DuckDB oracle, the queries as dataflows.

``python -m bench.nexmark --help`` runs one query; see :mod:`bench.nexmark.cli`.
"""
