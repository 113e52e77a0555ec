"""Test set-up: one thread per process (tiny CPU models are many times faster), the `stabkit_cli`
fixture for tests that run the command in a child process.

tests/ itself is on ``sys.path`` through pytest's ``pythonpath`` option (pyproject.toml), so test
modules import the shared helpers as ``from zoo import ...``, ``from zoo_models import ...``,
``from standins import ...``, ``from cli_process import ...``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cli_process import StabkitCLI

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def stabkit_cli() -> StabkitCLI:
    """Runs ``stabkit ARGS`` in a fresh interpreter (`cli_process.StabkitCLI`)."""
    return StabkitCLI()


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """No compiled code and empty Dynamo counters before and after the test (attach warns when it
    finds compiled code, and graph counts read the counters)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that runs the CLI in a child process starts a process: mark it ``multiprocess`` (before
    ``-m`` selects), whether or not it says so itself."""
    for item in items:
        if (
            "stabkit_cli" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("multiprocess") is None
        ):
            item.add_marker(pytest.mark.multiprocess)
