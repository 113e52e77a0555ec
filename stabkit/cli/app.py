"""The `stabkit` click group and its error policy: bad input exits 2 with one line, no traceback."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import click


class UserInputError(click.ClickException):
    """Bad input the user can fix: printed as one line, exit code 2."""

    exit_code = 2


class StabkitGroup(click.Group):
    """A click group whose errors are one line on stderr and exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("stabkit: aborted", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            click.echo(f"stabkit: error: {one_line(exc.format_message())}", err=True)
            sys.exit(2 if isinstance(exc, click.UsageError | UserInputError) else exc.exit_code)
        except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
            click.echo(f"stabkit: error: {one_line(str(exc))}", err=True)
            sys.exit(2)
        except OSError as exc:  # a path that cannot be read or written (permissions, read-only, full)
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"stabkit: error: {where}{one_line(exc.strerror or str(exc))}", err=True)
            sys.exit(2)


def writable_dir(path: str | Path, option: str) -> Path:
    """Before anything runs: create the output folder `path` (given as `option`) if needed and write a
    probe file in it; a folder that cannot be written is a UserInputError naming it (exit 2)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".stabkit-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserInputError(
            f"{option} {folder}: cannot write there ({exc.strerror or exc}); pick a writable folder"
        ) from None
    return folder


def one_line(text: str) -> str:
    """Collapse a message to one line."""
    return " ".join(text.split())


@click.group(cls=StabkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stabkit")
def main() -> None:
    """stabkit: find where and why Transformer training goes unstable, and switch on the fix."""
