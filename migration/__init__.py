"""raystream.migration."""
