"""Frontend plugins."""
