"""Attention backend plugins."""
