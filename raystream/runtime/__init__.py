"""raystream.runtime."""
