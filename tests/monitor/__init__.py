"""Tests of the Monitor as a whole: stabkit.monitor, stabkit.lifecycle."""
