"""Pure-PyTorch STAND-INS for GPU-only attention libraries, so stabkit's handling of them runs on CPU.

flash-attn 2 and 3, xformers and NVIDIA Transformer Engine only run on CUDA. The packages under
``tests/standins/packages/`` are *not* those libraries: each is a small pure-PyTorch re-implementation
that keeps the real library's Python API (module paths, function and class names, argument names and
defaults), its torch custom-op names and schemas (``flash_attn::_flash_attn_forward``,
``flash_attn::_flash_attn_varlen_forward``, ``flash_attn_3::_flash_attn_forward`` and their backward ops)
and its masking semantics, copied from the real sources cited in each module's docstring. Every stand-in
module has ``__standin__ = True`` and a version string ending in ``+standin``.

- ``flash_attn`` (2.8.4 layout: ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``)
- ``flash_attn_interface`` and ``flash_attn_3`` (flash-attn 3, "hopper")
- ``xformers.ops.memory_efficient_attention`` / ``xformers.ops.fmha`` / ``xformers.ops.fmha.attn_bias``
- ``transformer_engine.pytorch.DotProductAttention``
- ``_standin_attention_math`` (their shared math; not a real library)

``tests/standins/reference.py`` is an independent float64 reference of the attention statistics and
``tests/standins/hf.py`` runs Hugging Face's own flash-attention-2 code path on the flash-attn stand-in.

The packages directory is NOT on ``sys.path`` by default: libraries probe
``importlib.util.find_spec("flash_attn")`` and the like, and only tests that ask for the stand-ins may
see them. Use::

    from tests.standins import installed          # or `from standins import installed`
    with installed():                             # on sys.path + imported (ops registered) ...
        import flash_attn
        ...
                                                  # ... and gone again afterwards

or ``install()`` / ``uninstall()`` (idempotent). Uninstalling takes the directory off ``sys.path`` and the
stand-in modules out of ``sys.modules`` (kept aside and put back by the next ``install()``), so
``find_spec`` no longer finds them; the torch custom ops stay registered (torch cannot unregister them).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

PACKAGES_DIR = Path(__file__).resolve().parent / "packages"
STANDIN_PACKAGES = (
    "flash_attn",
    "flash_attn.bert_padding",
    "flash_attn_interface",
    "flash_attn_3",
    "flash_attn_3.flash_attn_interface",
    "xformers",
    "xformers.ops",
    "transformer_engine",
    "transformer_engine.pytorch",
)
_TOP_LEVEL = (
    "_standin_attention_math",
    "flash_attn",
    "flash_attn_interface",
    "flash_attn_3",
    "xformers",
    "transformer_engine",
)

# Modules taken out by uninstall(), put back by install(). tests/conftest.py puts tests/ on sys.path, so
# this package can be imported twice (as `tests.standins` and as `standins`); both copies share one dict,
# since importing the stand-ins afresh would register their torch ops a second time (an error).
_twin = sys.modules.get("standins" if __name__ == "tests.standins" else "tests.standins")
_saved: dict[str, ModuleType] = getattr(_twin, "_saved", {})


_PREFIX = str(PACKAGES_DIR) + os.sep


def _is_standin(module: ModuleType | None) -> bool:
    file = getattr(module, "__dict__", {}).get("__file__")  # no __getattr__ side effects (lazy modules)
    return isinstance(file, str) and file.startswith(_PREFIX)


def is_installed() -> bool:
    return str(PACKAGES_DIR) in sys.path


def install() -> None:
    """Put the stand-ins first on ``sys.path`` and import them (registering their torch ops). Idempotent.

    Raises RuntimeError if a real (non-stand-in) flash_attn / xformers / transformer_engine is already
    imported, since the stand-ins cannot share their module names or op names with it.
    """
    for name in _TOP_LEVEL:
        module = sys.modules.get(name)
        if module is not None and not _is_standin(module):
            raise RuntimeError(
                f"the real `{name}` is already imported ({module!r}); cannot install its stand-in"
            )
    path = str(PACKAGES_DIR)
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    sys.modules.update(_saved)
    _saved.clear()
    importlib.invalidate_caches()
    for name in STANDIN_PACKAGES:
        importlib.import_module(name)


def uninstall() -> None:
    """Take the stand-ins off ``sys.path`` and out of ``sys.modules`` (kept for the next ``install()``)."""
    path = str(PACKAGES_DIR)
    while path in sys.path:
        sys.path.remove(path)
    for name, module in list(sys.modules.items()):
        if _is_standin(module):
            _saved[name] = sys.modules.pop(name)
    importlib.invalidate_caches()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of the block; restores the previous state afterwards."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
