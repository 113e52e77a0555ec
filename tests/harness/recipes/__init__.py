"""Tests of stabkit.harness.recipes (stabkit.recipes before the harness move)."""
