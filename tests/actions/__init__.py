"""Tests of the detectors' actions (skip, rollback, raise, dump): stabkit.detectors.actions."""
