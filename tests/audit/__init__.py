"""Tests of stabkit.audit."""
