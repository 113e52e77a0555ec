"""The one model spec of every command (stabkit/harness/models/spec.py): its forms, its options and the
one-line errors for bad input."""

from __future__ import annotations

import pytest

from stabkit.harness.models.spec import ModelSpecError, parse_model_spec, parse_option, parse_options


@pytest.mark.parametrize(
    ("text", "kind", "target"),
    [
        ("tiny", "preset", "tiny"),
        (" 1b ", "preset", "1b"),
        ("hf:llama", "hf", "llama"),
        ("hf:qwen3_moe", "hf", "qwen3_moe"),
        ("my_pkg.models:build", "callable", "my_pkg.models:build"),
        ("models/mine.py:make_model", "callable", "models/mine.py:make_model"),
    ],
)
def test_each_form_is_recognised(text: str, kind: str, target: str) -> None:
    spec = parse_model_spec(text)
    assert (spec.kind, spec.target) == (kind, target)
    assert spec.is_reference == (kind == "preset")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty model spec"),
        ("gpt3", "unknown model spec 'gpt3'"),
        ("hf:", "hf: needs a model_type"),
        ("hf:ll ama", "hf: needs a model_type"),
        ("pkg:", "unknown model spec"),
        ("pkg:not-an-identifier", "unknown model spec"),
    ],
)
def test_bad_specs_name_the_problem_and_the_accepted_forms(text: str, needle: str) -> None:
    with pytest.raises(ModelSpecError) as info:
        parse_model_spec(text)
    message = str(info.value)
    assert needle in message and "\n" not in message
    if "unknown" in needle or "empty" in needle:
        assert "hf:<model_type>" in message and "module:callable" in message


def test_a_preset_takes_no_options() -> None:
    with pytest.raises(ModelSpecError, match="takes no --model-option"):
        parse_model_spec("tiny", {"d_model": 32})


def test_options_are_read_as_python_literals_else_strings() -> None:
    assert parse_option("num_local_experts=4") == ("num_local_experts", 4)
    assert parse_option("rope_theta = 1e4") == ("rope_theta", 1e4)
    assert parse_option("hidden_act=silu") == ("hidden_act", "silu")
    assert parse_option("tie_word_embeddings=false") == ("tie_word_embeddings", False)
    assert parse_option("layer_types=['full_attention', 'sliding_attention']")[1] == [
        "full_attention",
        "sliding_attention",
    ]
    assert parse_options(["a=1", "b=2", "a=3"]) == {"a": 3, "b": 2}  # the last wins
    for bad in ("novalue", "=3", "not a key=1"):
        with pytest.raises(ModelSpecError, match="key=value"):
            parse_option(bad)


def test_describe_shows_the_options() -> None:
    spec = parse_model_spec("hf:mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1})
    assert spec.describe() == "hf:mixtral (num_experts_per_tok=1, num_local_experts=4)"
    assert spec.to_dict() == {
        "spec": "hf:mixtral",
        "kind": "hf",
        "options": {"num_local_experts": 4, "num_experts_per_tok": 1},
    }
