"""Tests of stabkit.sinks."""
