"""Tests of stabkit.discovery."""
