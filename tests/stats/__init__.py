"""Tests of stabkit.stats."""
