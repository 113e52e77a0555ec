"""Tests of stabkit.cli."""
