"""Tests of stabkit.bench."""
