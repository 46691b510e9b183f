"""The tokenizer built from SmolLM2's GGUF metadata behaves like Hugging Face's for the same file.

The reference is transformers' own GGUF tokenizer (AutoTokenizer with gguf_file=), loaded
offline once per module.
"""

from __future__ import annotations

import json

import pytest
from gguf import GGUFReader
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from kvbridge.engine.loader import DEFAULT_MODEL, resolve_model
from kvbridge.engine.loader.gguf import read_vocab
from kvbridge.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing  ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "naïve café — “quotes” «guillemets» Ünïcödé",
    "日本語のテキストと中文，한국어 텍스트",
    "emoji 🤖👍🏽🇺🇸❤️ mixed",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12345))\n",
    "numbers 1234567 3.14159 2024-01-01 $1,000.00",
    "I'm sure they'll say it's fine; we've SEEN it.",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def gguf_reader(gguf_path) -> GGUFReader:
    return GGUFReader(gguf_path)  # parsing the 49k-token vocabulary takes seconds: once per module


@pytest.fixture(scope="module")
def tokenizer(gguf_reader) -> Tokenizer:
    return Tokenizer.from_gguf_vocab(read_vocab(gguf_reader))


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path, gguf_reader, gguf_parsed_once):
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once(gguf_reader):  # transformers reads the same parse of the file (read-only)
        return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    state = json.loads(tokenizer.to_json())
    state["chat_template"] = template
    return Tokenizer.from_json(json.dumps(state))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_add_special_tokens_follows_the_gguf_add_bos_flag(tokenizer, hf_tokenizer):
    # SmolLM2's GGUF says add_bos_token = false, so nothing is prepended either way.
    assert tokenizer.encode("hi", add_special_tokens=True) == hf_tokenizer.encode("hi") == tokenizer.encode("hi")


def test_special_tokens_written_in_text_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"


def test_non_ascii_numerals_split_like_the_smollm2_hub_tokenizer(tokenizer, hf_tokenizer):
    # tokenizer.ggml.pre = "smollm": llama.cpp and the model's own tokenizer.json split every
    # numeric character off first (Digits, then ByteLevel). transformers' GGUF path ignores the
    # pre type, which only shows on numerals such as "²" after a space; we follow the model.
    hub = BackendTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    hub.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in [" ² ³ ½", "x² + y² = r²", "Ⅻ ① ٣ 42", *TEXTS]:
        assert tokenizer.encode(text) == hub.encode(text, add_special_tokens=False).ids


def test_special_ids_and_stop_tokens(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1  # <|im_start|>
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2  # <|im_end|>
    assert tokenizer.stop_token_ids == frozenset({0, 2})  # <|endoftext|> also ends generation
    assert tokenizer.vocab_size == 49152


def test_token_text_is_the_decoded_text_of_one_token(tokenizer):
    assert tokenizer.token_text(2) == "<|im_end|>"
    (world,) = tokenizer.encode(" world")
    assert tokenizer.token_text(world) == " world"
    first_byte = tokenizer.encode("🤖")[0]
    assert tokenizer.token_text(first_byte) == "\ufffd"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_rejects_unknown_roles_and_non_text_content(tokenizer):
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="content"):
        tokenizer.apply_chat_template([{"role": "user", "content": None}])  # type: ignore[dict-item]


def test_chat_template_errors_become_value_errors(tokenizer):
    raising = with_template(tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat template"):
        with_template(tokenizer, "{% for %}").apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        with_template(tokenizer, None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sees_bos_and_eos_tokens_and_hf_extensions(tokenizer):
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content | tojson }}"
                "{% endgeneration %}{% endfor %}{{ eos_token }}")
    rendered = with_template(tokenizer, template).apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '<|im_start|>"é"<|im_end|>'


def test_sandbox_blocks_attribute_escapes(tokenizer):
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError):
        with_template(tokenizer, template).apply_chat_template([{"role": "user", "content": "x"}])


def test_json_round_trip_keeps_everything(tokenizer):
    copy = Tokenizer.from_json(tokenizer.to_json())
    assert (copy.bos_token_id, copy.eos_token_id, copy.stop_token_ids, copy.vocab_size) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.stop_token_ids, tokenizer.vocab_size)
    for text in TEXTS:
        assert copy.encode(text) == tokenizer.encode(text)
    assert copy.apply_chat_template(CONVERSATIONS[1]) == tokenizer.apply_chat_template(CONVERSATIONS[1])


def test_hf_folder_saved_by_transformers_gives_the_same_tokenizer(tokenizer, hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.stop_token_ids) == (1, 2, frozenset({0, 2}))
    for text in TEXTS:
        assert loaded.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_hf_folder_eos_list_in_generation_config_adds_stop_ids(tokenizer, tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.loads(tokenizer.to_json())["backend"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages[0].content }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.stop_token_ids == frozenset({0, 2, 5})
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_hf_folder_without_tokenizer_json_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS + ["🤖🤖🤖 ok 👍🏽", "∑ é 中 𝔘𝔫𝔦"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_deltas_join_to_the_full_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was held back at the end of complete text


def test_incremental_holds_back_a_partial_character_until_complete(tokenizer):
    ids = tokenizer.encode("a🤖")
    assert len(ids) > 2  # the emoji is several byte tokens
    deltas = stream(tokenizer, ids)
    assert deltas[0] == "a"
    assert deltas[1:-2] == [""] * (len(ids) - 2)
    assert deltas[-2] == "🤖"


def test_incremental_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok🤖")[:-1]  # generation stopped inside the emoji
    deltas = stream(tokenizer, ids)
    assert "".join(deltas[:-1]) == "ok"
    assert "".join(deltas) == tokenizer.decode(ids) == "ok\ufffd"
