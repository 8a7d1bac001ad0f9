"""Structured output backend plugins."""
