"""raystream.autoscaler."""
