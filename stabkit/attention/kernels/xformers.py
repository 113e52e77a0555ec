"""xformers (placeholder until the reader lands)."""
