"""`RecipeError`: a recipe that cannot be used, named by file, key and what is allowed."""

from __future__ import annotations

from ....tables import TableError


class RecipeError(TableError):
    """Bad recipe input; the message is one line: ``<key>: <what is wrong and what is allowed>``.

    Raised while a recipe is loaded (before anything trains). A ValueError, so the CLI prints it
    as one line and exits 2. A `stabkit.tables.TableError` from filling a config becomes one.
    """

    def __init__(self, key: str, problem: str, source: str | None = None) -> None:
        super().__init__(key, problem)
        self.source = source
        where = f"{source}: " if source else ""
        self.args = (f"recipe {where}{key}: {problem}",)

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def of(cls, exc: TableError, source: str | None = None) -> RecipeError:
        """`exc` as a RecipeError (naming the recipe file when given)."""
        return cls(exc.key, exc.problem, source)

    def in_file(self, source: str) -> RecipeError:
        """The same error, naming the recipe file."""
        return RecipeError(self.key, self.problem, source)
