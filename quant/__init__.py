"""Quantization method plugins."""
