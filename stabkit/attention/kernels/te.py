"""Transformer Engine (placeholder until the reader lands)."""
