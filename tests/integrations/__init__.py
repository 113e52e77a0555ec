"""Tests of stabkit.integrations."""
