"""Tests of cross-cutting robustness: what real training scripts, crashes, signals, full disks and odd inputs do."""
