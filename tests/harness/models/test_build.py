"""Building any model at a recipe's size (stabkit/harness/models/build.py, hf_build.py, factory.py): the
shape lands in the config's own fields, options go over it, a factory gets the arguments it takes, and
whatever the model returns becomes logits."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from stabkit.harness.models import GPT, GPTConfig
from stabkit.harness.models.adapter import TokensToLogits, logits_of
from stabkit.harness.models.build import build
from stabkit.harness.models.spec import ModelSpecError, parse_model_spec

TINY = GPTConfig(d_model=64, n_layers=2, n_heads=4, context=64)


def config_of(model: nn.Module):  # type: ignore[no-untyped-def]
    assert isinstance(model, TokensToLogits)
    return model.model.config


def test_a_preset_spec_builds_the_reference_gpt_itself() -> None:
    assert type(build(parse_model_spec("tiny"), TINY)) is GPT and type(build(None, TINY)) is GPT


@pytest.mark.parametrize(
    ("model_type", "kv", "ffn_default", "width_default"),
    [
        ("llama", 4, 11008, 4096),  # MHA stays MHA
        ("qwen2", 4, 22016, 4096),  # Qwen2Config's defaults are MHA (32 / 32)
        ("mixtral", 1, 14336, 4096),  # 32 / 8
        ("gemma2", 2, 9216, 2304),  # 8 / 4: GQA by 2 stays GQA by 2
    ],
)
def test_hf_models_take_the_recipes_shape_in_their_own_fields(
    model_type: str, kv: int, ffn_default: int, width_default: int
) -> None:
    from transformers import CONFIG_MAPPING

    default = CONFIG_MAPPING[model_type]()
    assert (default.intermediate_size, default.hidden_size) == (
        ffn_default,
        width_default,
    )  # the defaults read
    model = build(parse_model_spec(f"hf:{model_type}"), TINY)
    cfg = config_of(model)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.num_key_value_heads == kv and cfg.vocab_size == 256 and cfg.max_position_embeddings == 64
    assert cfg.intermediate_size == 8 * math.ceil(ffn_default * 64 / width_default / 8)
    if getattr(default, "head_dim", None) is not None:
        assert cfg.head_dim == 16
    logits = model(torch.randint(0, 256, (2, 64)))
    assert logits.shape == (2, 64, 256)


def test_hf_options_go_over_the_size_and_unknown_fields_are_named() -> None:
    model = build(parse_model_spec("hf:mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1}), TINY)
    cfg = config_of(model)
    assert cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 1 and cfg.hidden_size == 64
    gqa = config_of(build(parse_model_spec("hf:qwen2", {"num_key_value_heads": 2}), TINY))
    assert gqa.num_key_value_heads == 2 and gqa.num_attention_heads == 4
    one_head = GPTConfig(d_model=64, n_layers=1, n_heads=1)  # low-precision's tiny size: one head of 64
    with pytest.raises(ModelSpecError, match="num_key_value_heads=2 must divide num_attention_heads=1"):
        build(parse_model_spec("hf:qwen2", {"num_key_value_heads": 2}), one_head)
    with pytest.raises(ModelSpecError, match="not_a_field: not a field of MixtralConfig"):
        build(parse_model_spec("hf:mixtral", {"not_a_field": 1}), TINY)
    with pytest.raises(ModelSpecError, match="hf:lama is not known .*hf:llama"):
        build(parse_model_spec("hf:lama"), TINY)


def test_eager_attention_is_asked_of_hf_models_when_the_recipe_asks_it() -> None:
    eager = build(
        parse_model_spec("hf:llama"), GPTConfig(d_model=64, n_layers=1, n_heads=4, attention="eager")
    )
    assert config_of(eager)._attn_implementation == "eager"


FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    CALLS = []

    class Net(nn.Module):
        def __init__(self, vocab_size, width):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, width)
            self.head = nn.Linear(width, vocab_size)

        def forward(self, tokens):
            h = self.emb(tokens)
            return self.head(h), h  # a tuple: the logits first

    def only_vocab(vocab_size, width=8):
        CALLS.append(dict(vocab_size=vocab_size, width=width))
        return Net(vocab_size, width)

    def everything(**kwargs):
        CALLS.append(kwargs)
        return Net(kwargs["vocab_size"], kwargs["d_model"])

    def not_a_module(vocab_size):
        return "hello"
    """
)


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_models.py"
    path.write_text(FACTORY)
    return path


def test_a_factory_gets_the_arguments_it_takes_and_its_tuple_becomes_logits(factory_file: Path) -> None:
    from stabkit.harness.models.factory import load_file

    module = load_file(factory_file)
    module.CALLS.clear()
    model = build(parse_model_spec(f"{factory_file}:only_vocab", {"width": 12}), TINY)
    assert module.CALLS == [{"vocab_size": 256, "width": 12}]
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)
    build(parse_model_spec(f"{factory_file}:everything"), TINY)
    assert module.CALLS[-1] == {
        "vocab_size": 256, "context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 4, "d_ff": 256, "dropout": 0.0,
    }  # fmt: skip


def test_bad_factories_get_one_line(factory_file: Path, tmp_path: Path) -> None:
    cases = [
        (f"{factory_file}:missing", "has no callable 'missing'"),
        (f"{factory_file}:not_a_module", "returned str, not a torch.nn.Module"),
        (f"{tmp_path / 'nope.py'}:f", "does not exist"),
        ("stabkit_no_such_module:f", "cannot import 'stabkit_no_such_module' (ModuleNotFoundError"),
    ]
    for text, needle in cases:
        with pytest.raises(ModelSpecError) as info:
            build(parse_model_spec(text), TINY)
        assert needle in str(info.value) and "\n" not in str(info.value)


def test_logits_are_read_from_an_output_object_a_tuple_or_a_tensor() -> None:
    t = torch.zeros(1, 2, 3)

    class Out:
        logits = t

    assert logits_of(Out()) is t and logits_of((t, 1)) is t and logits_of(t) is t
    with pytest.raises(TypeError, match="returned dict; a recipe needs logits"):
        logits_of({"x": t})
