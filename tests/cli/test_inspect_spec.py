"""`stabkit inspect SPEC`'s glue (stabkit/cli/inspect_spec.py): building a model from a spec string
and the text or JSON the command prints."""

from __future__ import annotations

import json
import time

import pytest

from stabkit.cli.inspect_spec import build_from_spec, inspect_device, run_inspect_cli, spec_names


def test_spec_names_are_the_presets_and_the_hf_configs() -> None:
    assert spec_names() == ["tiny", "small", "gpt2", "1b", "hf:gpt2", "hf:llama", "hf:mistral", "hf:qwen2"]
    assert inspect_device("tiny") == "cpu" and inspect_device("hf:gpt2") == "meta"


def test_build_from_spec_presets_and_hf_on_meta() -> None:
    tiny = build_from_spec("tiny")
    assert type(tiny).__name__ == "GPT" and tiny.config.d_model == 64
    assert all(p.is_meta for p in tiny.parameters())
    llama = build_from_spec("hf:llama")
    assert type(llama).__name__ == "LlamaForCausalLM" and all(p.is_meta for p in llama.parameters())
    for bad in ("nope", "hf:nope", ""):
        with pytest.raises(ValueError, match="use one of"):
            build_from_spec(bad)


def test_run_inspect_cli_hf_llama() -> None:
    from transformers import LlamaConfig

    start = time.perf_counter()
    text = run_inspect_cli("hf:llama", audit=True, as_json=False)
    print(f"run_inspect_cli('hf:llama', audit=True): {time.perf_counter() - start:.2f} s")
    assert "model.layers.31.self_attn" in text and "attn_softmax_unguarded" in text
    assert "model.layers.{0..31}.self_attn" in text and "KV cache (MHA" in text
    assert "stabkit audit" not in run_inspect_cli("hf:llama", audit=False, as_json=False)
    data = json.loads(run_inspect_cli("hf:llama", audit=True, as_json=True))
    cfg = LlamaConfig()
    hand = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    assert data["audit"]["memory"]["kv_cache"]["bytes_per_token"] == hand
    assert data["model_map"]["family"] == "hf-llama"
    assert {f["rule"] for f in data["audit"]["findings"]} == {
        "attn_softmax_unguarded",
        "output_softmax_unguarded",
    }
