"""Keyed state: specs users declare, handles operators use, the RocksDB backend and its layout."""
