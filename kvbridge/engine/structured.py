"""Structured output (vLLM's `response_format`, `structured_outputs`, `guided_*`): a grammar that every
sampled token must keep satisfiable, through xgrammar, the library vLLM uses by default.

The engine process owns it, as vLLM's scheduler process owns its StructuredOutputManager: one
GrammarMatcher per request (on the Request), advanced by each token the request samples (and by tokens it continues
from: a prefill instance's first token). Before a step, each request that samples gets its next
token's bitmask (1 bit per vocabulary id, allowed or not), which travels with the scheduler output to
the rank that samples; the sampler sets the forbidden logits to -inf. Logprobs stay the model's.

xgrammar is imported on the first structured request (its import takes about 1.5 s); the compiled
grammars are cached by spec. Why xgrammar: README, Choices and why.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from kvbridge.engine.tokenizer import Tokenizer

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
COMPILED_CACHE = 64  # compiled grammars kept (by spec)


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must match: a JSON schema (`json`, its JSON text), any JSON object
    (`json_object`), a regular expression, one of a list of strings (`choice`, the list as JSON
    text), or an EBNF grammar (xgrammar's GBNF dialect). `field`: the request field that asked for
    it, named in errors."""

    kind: StructuredKind
    value: str = ""
    field: str = "response_format"


class StructuredOutputError(ValueError):
    """The spec cannot be compiled (a bad schema, regex or grammar): the request's fault, HTTP 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # installed by scripts/install.sh
        raise StructuredOutputError(f"structured output needs the xgrammar package ({exc}); "
                                    "scripts/install.sh installs it", "response_format") from None
    return xgrammar


class Grammars:
    """Compiles specs against one tokenizer's vocabulary (a model's logits width `vocab_size`) and
    makes each request's matcher (kept on the request: Request.grammar). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._width = vocab_size  # the grammar's vocabulary: the logits' width, or the tokenizer's if wider
        self._compiler: Any = None
        self._compiled: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _compiler_for_vocab(self) -> Any:
        if self._compiler is None:
            xgr = _xgrammar()
            backend = self._tokenizer.backend
            vocab = backend.get_vocab(with_added_tokens=True)
            encoded = [""] * (max(vocab.values()) + 1)  # ids without a token (holes) stay empty: never allowed
            for text, token_id in vocab.items():
                encoded[token_id] = text
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"],
                                     vocab_size=self._mask_width(len(encoded)),
                                     stop_token_ids=sorted(self._tokenizer.stop_token_ids),
                                     add_prefix_space=meta["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _mask_width(self, tokenizer_ids: int) -> int:
        self._width = max(self._vocab_size, tokenizer_ids)
        return self._width

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of `spec` (cached); StructuredOutputError names what is wrong."""
        with self._lock:
            cached = self._compiled.get(spec)
            if cached is not None:
                self._compiled.move_to_end(spec)
                return cached
            compiler = self._compiler_for_vocab()
            try:
                compiled = _compile(compiler, spec)
            except StructuredOutputError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
                raise StructuredOutputError(f"{spec.field}: cannot be compiled: {exc}", spec.field) from None
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, spec: StructuredSpec, continued: Sequence[int] = ()) -> Any:
        """A new request's matcher, advanced past `continued` (tokens another instance sampled under
        the same spec); StructuredOutputError when the spec or those tokens do not fit."""
        matcher = _xgrammar().GrammarMatcher(self.compile(spec))
        for token in continued:
            if not matcher.accept_token(token):
                raise StructuredOutputError(f"continue_from_token_ids: token {token} does not match "
                                            f"{spec.field}", "continue_from_token_ids")
        return matcher

    def bitmask(self, matcher: Any) -> torch.Tensor:
        """The next token's allowed ids under `matcher` (int32 words, 32 ids each)."""
        mask: torch.Tensor = _xgrammar().allocate_token_bitmask(1, self._width)
        matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]


def accept(matcher: Any, token: int) -> tuple[bool, bool]:
    """Advance a matcher by a sampled token: (accepted, the grammar is complete)."""
    accepted = bool(matcher.accept_token(token))
    return accepted, bool(matcher.is_terminated())


def _compile(compiler: Any, spec: StructuredSpec) -> Any:
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.value)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.value)
    choices = json.loads(spec.value)
    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))


def apply_bitmask(logits_row: torch.Tensor, mask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the ids `mask` (int32 words, bit i of word w: id 32w + i)
    forbids. A float32 CPU row; ids past the mask's width (none for a mask of the logits' width) are kept."""
    width = logits_row.shape[-1]
    bits = (mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(-1)[:width].bool()
    logits_row.masked_fill_(~allowed, float("-inf"))
