"""`python -m stabkit` runs the CLI."""

from .cli import main

main()
