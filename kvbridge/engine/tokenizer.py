"""Text <-> token ids, chat templates and streaming detokenization for the engine.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) plus the few facts the engine
needs beside it: bos/eos ids, the ids that end a turn, and the Jinja chat template. It is built
either from a GGUF file's `tokenizer.*` metadata (see `GGUFVocab`) or from a Hugging Face model
folder (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`), and can be
serialised to one JSON string so the weight cache can restore it without re-reading the GGUF.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas whose concatenation
equals `Tokenizer.decode` of all ids, never emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# Texts of tokens that end a turn or a document, after llama.cpp's end-of-generation list; a
# special token with one of these texts stops generation even when it is not the eos id.
_END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>",
})
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before BPE (llama.cpp's llama-vocab.cpp).
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizer types that are GPT-2's regex, possibly after splitting digits one by one.
_GPT2_STYLE_PRE = {"default": False, "gpt2": False, "gpt-2": False,
                   "smollm": True, "starcoder": True, "refact": True}


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file, as plain values (read by the GGUF loader)."""

    model: str  # tokenizer.ggml.model; only "gpt2" (byte-level BPE) is supported
    pre: str | None  # tokenizer.ggml.pre, e.g. "smollm"
    tokens: Sequence[str]
    merges: Sequence[str]  # "left right" pairs, best first
    token_types: Sequence[int]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2_STYLE_PRE and pre is not None:
        logger.warning("unknown GGUF pre-tokenizer %s; using GPT-2's split", pre)
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _GPT2_STYLE_PRE.get(pre or "default", False):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge rule, "left right", as the BPE model takes it."""
    left, _, right = merge.partition(" ")
    return left, right


def _backend_from_gguf(vocab: GGUFVocab) -> BackendTokenizer:
    """A byte-level BPE tokenizer equal to what Hugging Face ships for GPT-2-style vocabularies."""
    if vocab.model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {vocab.model!r} (only 'gpt2' byte-level BPE)")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    types = list(vocab.token_types) or [0] * len(vocab.tokens)
    # Added tokens (control, user-defined) are matched literally, so they keep their text, e.g.
    # "<｜end▁of▁sentence｜>"; a normal token spelled outside the byte alphabet (a rare conversion
    # slip) is respelled byte-wise, as transformers does.
    spelled = [t if set(t) <= alphabet or k in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
               else "".join(spelling[b] for b in t.encode()) for t, k in zip(vocab.tokens, types)]
    merges = [_merge_pair(m) for m in vocab.merges]
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges,
                                          fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(spelled, types) if k == _TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(spelled, types) if k == _TOKEN_TYPE_USER_DEFINED])
    if vocab.add_bos_token and vocab.bos_token_id is not None:
        bos = spelled[vocab.bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_token_id)])
    return backend


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (assistant-mask marker) and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compiled the way transformers does it, so templates from the Hub render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _ids(value: object) -> list[int]:
    """generation_config.json's eos_token_id is an int or a list of ints."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model.

    Thread-safety: encode/decode may be called from several threads (the backend is immutable).
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None, extra_stop_token_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
        stops = {i for i, text in special.items() if text in _END_OF_TURN_TEXTS}
        stops.update(extra_stop_token_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._template: jinja2.Template | None = None
        self._token_texts: dict[int, str] = {}

    @property
    def backend(self) -> BackendTokenizer:
        """The `tokenizers` tokenizer underneath (its vocabulary and JSON form: engine/structured.py)."""
        return self._backend

    # construction ----------------------------------------------------------------------------

    @classmethod
    def from_gguf_vocab(cls, vocab: GGUFVocab) -> Tokenizer:
        """Raises ValueError for tokenizer models other than GPT-2-style byte-level BPE."""
        return cls(_backend_from_gguf(vocab), bos_token_id=vocab.bos_token_id,
                   eos_token_id=vocab.eos_token_id, chat_template=vocab.chat_template)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """From tokenizer.json, with specials and template from tokenizer_config.json,
        chat_template.jinja and generation_config.json when present. Raises ValueError if the folder
        has no readable tokenizer.json."""
        folder = Path(folder)
        try:
            backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception for missing or malformed files
            raise ValueError(f"cannot load {folder / 'tokenizer.json'}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        def special_id(name: str) -> int | None:
            text = _token_content(config.get(name))
            token_id = backend.token_to_id(text) if text is not None else None
            fallback = _ids(generation.get(f"{name}_id"))
            return token_id if token_id is not None else (fallback[0] if fallback else None)

        return cls(backend, bos_token_id=special_id("bos_token"), eos_token_id=special_id("eos_token"),
                   chat_template=template if isinstance(template, str) else None,
                   extra_stop_token_ids=_ids(generation.get("eos_token_id")))

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer with `from_json` (used by the weight cache)."""
        return json.dumps({"backend": self._backend.to_str(), "bos_token_id": self.bos_token_id,
                           "eos_token_id": self.eos_token_id, "chat_template": self.chat_template,
                           "stop_token_ids": sorted(self.stop_token_ids)})

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        state = json.loads(text)
        return cls(BackendTokenizer.from_str(state["backend"]), bos_token_id=state["bos_token_id"],
                   eos_token_id=state["eos_token_id"], chat_template=state["chat_template"],
                   extra_stop_token_ids=state["stop_token_ids"])

    # text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in `text` (e.g. `<|im_start|>`) become their ids. With
        add_special_tokens the model's own additions (a bos, if it wants one) are made too;
        chat-template output already contains them, hence the default False.

        Other Python threads run meanwhile: `encode_batch` releases the GIL (`encode` holds
        it, so tokenising a long prompt on a worker thread would still stall the event loop)."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_bytes_per_token(self) -> int:
        """No token stands for more UTF-8 bytes of the text given to `encode` than this, so a
        text of more than n * max_bytes_per_token bytes has more than n tokens.

        Without a normalizer, every byte of the text ends up in exactly one token, and a
        token's vocabulary entry is at least as long as the bytes it stands for: byte-level
        BPE spells each byte as one or two characters, SentencePiece a space as the 3-byte
        "▁" and a fallback byte as "<0xNN>"; added tokens are their text. A normalizer runs
        first and may shrink the text: NFC/NFKC at most 4 to 1 (a 4-byte character mapped to
        a 1-byte one), hence 4x. (The tokenizers of the supported model families have no
        normalizer or pre-tokenizer that deletes text.)"""
        longest = max(len(token.encode("utf-8")) for token in self._backend.get_vocab(with_added_tokens=True))
        return longest if self._backend.normalizer is None else 4 * longest

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token, specials included (U+FFFD for a partial UTF-8 character)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # chat ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, rendered like transformers' apply_chat_template.

        Raises ValueError when the model has no template, a message is malformed or has an unknown
        role, or the template fails (including its own raise_exception calls).
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
                raise ValueError(f"message {index}: role must be one of {sorted(CHAT_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"message {index}: content must be a string")
        try:
            if self._template is None:
                self._template = _compile_chat_template(self.chat_template)
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.bos_token_id),
                eos_token=self._special_text(self.eos_token_id))
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")


class IncrementalDetokenizer:
    """Text deltas for a stream of generated ids; one per request, not thread-safe.

    Each push decodes a short window: the ids after the last emitted boundary, with the previous
    emitted chunk in front as context (decoders such as SentencePiece's strip a leading space at
    the start of a decode, which the context cancels out). Text ending in U+FFFD is an incomplete
    UTF-8 character and is held back until the next id completes it; `flush` releases it at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        """Append one id; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix, full = self._window()
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is held back (a trailing partial character decodes as U+FFFD); call at the end
        so that all deltas joined equal `Tokenizer.decode` of every pushed id."""
        prefix, full = self._window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]

    def _window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        context = self._ids[self._prefix_offset:self._read_offset]
        return (decode(context, skip_special_tokens=self._skip),
                decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip))
