"""Tests of stabkit.probes."""
