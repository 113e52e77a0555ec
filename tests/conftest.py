"""Test set-up: one thread per process (tiny CPU models are many times faster), tests/ importable."""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
