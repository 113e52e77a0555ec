"""One model spec for every command that builds a model (`run`, `sweep`, `lead-time`, `inspect`,
`bench`): a reference preset, a Hugging Face architecture, or a user's own factory.

Parsed once, when a command starts (`parse_model_spec`); built by `stabkit.harness.models.build`.
The accepted forms:

- ``tiny``, ``small``, ``gpt2``, ``1b``: the reference GPT at that preset size;
- ``hf:<model_type>``: any architecture the installed transformers knows (``hf:llama``, ``hf:mixtral``,
  ``hf:gemma2``...), built from its config class (never a download) at the recipe's size;
- ``module:callable`` (``my_pkg.models:build``, or ``path/to/file.py:build``): the user's factory,
  called with the keyword arguments it accepts among `FACTORY_ARGUMENTS`.

Options (``--model-option key=value``, or a recipe's ``[model.options]`` table) override fields of
the Hugging Face config (``num_local_experts=4``) or are passed to the factory as keyword arguments.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Literal

from .presets import PRESETS

SpecKind = Literal["preset", "hf", "callable"]

ACCEPTED_FORMS = "a preset (tiny, small, gpt2, 1b), hf:<model_type> (e.g. hf:llama) or module:callable"
"""The accepted forms, as the one-line error for a bad spec names them."""


class ModelSpecError(ValueError):
    """A model spec or option that cannot be used; the message is one line naming the problem."""


@dataclass(frozen=True)
class ModelSpec:
    """A model named on the command line or in a recipe; built per variant at the recipe's size."""

    text: str
    """As written (``hf:llama``)."""
    kind: SpecKind
    target: str
    """The preset name, the Hugging Face model_type, or ``module:callable``."""
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Config-field overrides (hf) or extra keyword arguments (callable)."""

    @property
    def is_reference(self) -> bool:
        """The reference GPT (a preset): every recipe switch applies as written."""
        return self.kind == "preset"

    def describe(self) -> str:
        """``hf:llama (num_local_experts=4)``: the spec with its options, for headers and summaries."""
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        return f"{self.text} ({opts})" if opts else self.text

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.text, "kind": self.kind, "options": dict(self.options)}


def parse_model_spec(text: str, options: dict[str, Any] | None = None) -> ModelSpec:
    """The `ModelSpec` for `text`; a bad spec raises ModelSpecError naming the accepted forms.

    Checks the form only (cheap, no import of transformers or of the user's module): whether the
    architecture or the callable exists is checked when it is built (`stabkit.harness.models.build`).
    """
    name = text.strip()
    opts = dict(options or {})
    if not name:
        raise ModelSpecError(f"empty model spec; use {ACCEPTED_FORMS}")
    if name in PRESETS:
        if opts:
            raise ModelSpecError(
                f"model spec {name!r} is a reference preset: it takes no --model-option "
                f"(got {', '.join(sorted(opts))}); use the recipe's [model] table"
            )
        return ModelSpec(name, "preset", name)
    if name.startswith("hf:"):
        model_type = name[3:].strip()
        if not model_type or not model_type.replace("_", "").replace("-", "").isalnum():
            raise ModelSpecError(f"model spec {text!r}: hf: needs a model_type, e.g. hf:llama")
        return ModelSpec(name, "hf", model_type, opts)
    module, sep, attr = name.rpartition(":")
    if sep and module and attr.isidentifier():
        return ModelSpec(name, "callable", name, opts)
    raise ModelSpecError(f"unknown model spec {text!r}; use {ACCEPTED_FORMS}")


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value), the value read as a Python literal where it is one
    (``4``, ``1e-3``, ``True``, ``'silu'``, ``[1, 2]``), else kept as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ModelSpecError(f"--model-option {text!r}: use key=value, e.g. num_local_experts=4")
    raw = raw.strip()
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        lowered = raw.lower()
        value = {"true": True, "false": False, "none": None}.get(lowered, raw)
    return key, value


def parse_options(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Every ``key=value`` of repeated ``--model-option`` flags (a key given twice: the last wins)."""
    return dict(parse_option(item) for item in items)
