"""benchmarks/vllm_peer.export_hf_folder: the folder vLLM and kvbridge both serve in
benchmarks/vs_vllm.py must hold exactly kvbridge's weights and tokenizer, readable by
transformers (what vLLM's loader reads) and by kvbridge's own Hugging Face loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import write_synthetic_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from vllm_peer import export_hf_folder, shown, vllm_cli  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def source_and_export(tmp_path_factory):
    tokenizer = load_model("SmolLM2-135M-Instruct").tokenizer
    source = write_synthetic_folder(tmp_path_factory.mktemp("src") / "tiny", tokenizer, seed=3, **TINY)
    exported = export_hf_folder(str(source), tmp_path_factory.mktemp("out") / "exported")
    return load_model(str(source)), exported


def test_export_round_trips_weights_tokenizer_and_template(source_and_export):
    original, exported = source_and_export
    again = load_model(str(exported))
    assert again.arch == original.arch
    assert again.weights.keys() == original.weights.keys()
    for name, tensor in original.weights.items():
        assert torch.equal(again.weights[name], tensor), name
    text = "<|im_start|>user\nHello, world! 1234<|im_end|>"
    assert again.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert again.tokenizer.chat_template == original.tokenizer.chat_template
    assert again.tokenizer.eos_token_id == original.tokenizer.eos_token_id


def test_transformers_reads_the_export_as_the_same_model(source_and_export):
    transformers = pytest.importorskip("transformers")
    original, exported = source_and_export
    config = json.loads((exported / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in original.weights.items():
        assert torch.equal(state[name], tensor), name
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.encode("Hello, world!", add_special_tokens=False) == original.tokenizer.encode("Hello, world!")
    assert tok.eos_token_id == original.tokenizer.eos_token_id


def test_vllm_cli_shim_is_shown_as_the_vllm_command(tmp_path):
    command = [*vllm_cli(tmp_path / "venv"), "bench", "serve", "--seed", "1"]
    assert shown(command) == f"{tmp_path / 'venv' / 'bin' / 'vllm'} bench serve --seed 1"
