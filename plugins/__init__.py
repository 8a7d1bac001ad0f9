"""Built-in plugins (attention backends, models, frontends), loaded through entry points."""
