"""A model's sampling defaults, as vLLM's `--generation-config auto|vllm|FOLDER` gives them.

A request that omits a sampling field gets the model's default for it; a request's own value
always wins. The defaults come from:

    auto    the model's Hugging Face folder's generation_config.json (none there: none); for the
            packaged default model, the sampling its authors publish (default_model.py); a GGUF
            file has none
    vllm    none: OpenAI's defaults (temperature 1, top_p 1, no top-k, min-p or penalty)
    FOLDER  FOLDER/generation_config.json (the file must be there)

Like vLLM, only the sampling fields are read: temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (a request's default max_tokens); null means unset and
everything else (do_sample, token ids) is ignored. A value of the wrong type or out of range is
a GenerationConfigError (a ValueError) naming the file, the field and the value, at start-up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbridge.engine.setup.default_model import PUBLISHED_SAMPLING, PUBLISHED_SAMPLING_SOURCE, names_default_model

GENERATION_CONFIG_FILE = "generation_config.json"
MODES = ("auto", "vllm")
_SHOWN_CHARS = 60  # of a bad value, in its error message


class GenerationConfigError(ValueError):
    """The --generation-config option or the file it names cannot be used."""


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults of a request's sampling fields; None: the OpenAI default. `source` says
    where they came from (empty when there are none)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = ""

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set, under vLLM's request names (its log line's dict)."""
        return {k: v for k, v in asdict(self).items() if k != "source" and v is not None}


NO_DEFAULTS = SamplingDefaults()


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# generation_config.json's field -> (SamplingDefaults' field, check, what the check requires)
_FIELDS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "temperature": ("temperature", lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "top_p": ("top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: _integer(v) and v >= -1, "an integer >= -1 (0 or -1: no top-k)"),
    "min_p": ("min_p", lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", lambda v: _number(v) and v > 0, "a finite number > 0"),
    "max_new_tokens": ("max_tokens", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
}


def parse_generation_config(values: Any, source: str) -> SamplingDefaults:
    """The sampling defaults in a generation config's JSON object; `source` names it in errors."""
    if not isinstance(values, dict):
        raise GenerationConfigError(f"{source} must hold a JSON object, not {type(values).__name__}")
    picked: dict[str, Any] = {}
    for key, (name, check, wanted) in _FIELDS.items():
        value = values.get(key)
        if value is None:
            continue
        if not check(value):
            raise GenerationConfigError(f"{source}: {key} must be {wanted}, got {_shown(value)}")
        picked[name] = value if name in ("top_k", "max_tokens") else float(value)
    return SamplingDefaults(**picked, source=source) if picked else NO_DEFAULTS


def read_generation_config(folder: Path) -> SamplingDefaults:
    path = folder / GENERATION_CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from None
    try:
        values = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # the parser recurses once per level
        raise GenerationConfigError(f"{path} is not valid JSON: it nests too deeply") from None
    except ValueError as exc:
        raise GenerationConfigError(f"{path} is not valid JSON: {exc}") from None
    return parse_generation_config(values, str(path))


def _shown(value: Any) -> str:
    """A bad value for its error message: a scalar as JSON (shortened), a list or object by its kind
    (it may be huge or nested deeper than json.dumps recurses)."""
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    text = json.dumps(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def sampling_defaults(mode: str, model: str) -> SamplingDefaults:
    """The sampling defaults `--generation-config mode` gives `model` (a name, GGUF file or
    folder, as `kvbridge serve` takes it). Raises GenerationConfigError."""
    if mode == "vllm":
        return NO_DEFAULTS
    if mode == "auto":
        if names_default_model(model):
            return SamplingDefaults(temperature=PUBLISHED_SAMPLING["temperature"], top_p=PUBLISHED_SAMPLING["top_p"],
                                    source=PUBLISHED_SAMPLING_SOURCE)
        folder = Path(model).expanduser()
        if folder.is_dir() and (folder / GENERATION_CONFIG_FILE).is_file():
            return read_generation_config(folder)
        return NO_DEFAULTS
    folder = Path(mode).expanduser()
    if not folder.is_dir():
        raise GenerationConfigError(f"--generation-config {mode}: not auto, vllm or a folder")
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        raise GenerationConfigError(f"--generation-config {mode}: the folder has no {GENERATION_CONFIG_FILE}")
    return read_generation_config(folder)


def startup_lines(defaults: SamplingDefaults) -> list[str]:
    """What the server states at start-up, as vLLM logs it (a warning, then the defaults of chat
    and completion requests); nothing without defaults."""
    if defaults == NO_DEFAULTS:
        return []
    return ["Default sampling parameters have been overridden by the model's generation config "
            f"({defaults.source}). If this is not intended, please relaunch kvbridge with "
            "`--generation-config vllm`.",
            f"Using default chat sampling params from model: {defaults.as_dict()}",
            f"Using default completion sampling params from model: {defaults.as_dict()}"]
