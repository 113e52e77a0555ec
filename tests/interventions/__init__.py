"""Tests of stabkit.interventions."""
