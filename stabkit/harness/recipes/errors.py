"""`RecipeError`: a recipe that cannot be used, named by file, key and what is allowed."""

from __future__ import annotations


class RecipeError(ValueError):
    """Bad recipe input; the message is one line: ``<key>: <what is wrong and what is allowed>``.

    Raised while a recipe is loaded (before anything trains). A ValueError, so the CLI prints it
    as one line and exits 2.
    """

    def __init__(self, key: str, problem: str, source: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"recipe {where}{key}: {problem}")

    def in_file(self, source: str) -> RecipeError:
        """The same error, naming the recipe file."""
        return RecipeError(self.key, self.problem, source)
