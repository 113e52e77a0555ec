"""Tests of stabkit.harness.training: the loop, its precision and evaluation."""
