"""Model architecture plugins."""
