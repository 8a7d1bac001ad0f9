"""Building blocks that model plugins are made of (linear + quant method, norms, rotary, ...)."""
