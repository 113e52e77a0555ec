"""Tests of stabkit.detectors."""
