"""stabkit's tests; one folder per subpackage (see test_layout.py)."""
