"""Tests of stabkit.harness.models (stabkit.models before the harness move)."""
