"""Tests of stabkit.distributed."""
