"""Tests of stabkit.attention."""
