"""raystream.operators."""
