"""Tests of the stress-test harness: stabkit.harness.{models,data,training,recipes} (stabkit.models, ... before the move)."""
