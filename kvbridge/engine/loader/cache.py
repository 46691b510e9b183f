"""A model in converted form (`ModelParts`) and the on-disk cache of converted GGUF models.

Converting a GGUF (dequantising, permuting, building the tokenizer) costs seconds; the result is
stored as one safetensors file whose header metadata also holds the architecture and the
tokenizer, so a cached load reads nothing else. The file name is keyed by the source's resolved
path, size and mtime: replacing the GGUF makes a new key, so stale entries are never read.
Files are written to a temporary name and renamed, so a crash never leaves a half-written entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvbridge.engine.models import build_model
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = "1"  # bump when the conversion changes, to invalidate old entries


def expected_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every HF parameter a model of `arch` has, with its shape (lm_head only when untied): what
    the model class itself loads, asked of a copy built on the meta device (no memory)."""
    return build_model(arch, torch.float32, "meta").checkpoint_shapes()


@dataclass(frozen=True)
class ModelParts:
    """Architecture, weights and tokenizer of one model, whatever format it came from.

    Invariant (checked on construction, ValueError otherwise): `weights` holds exactly the
    parameters of `expected_weight_shapes(arch)`, each fp32 on CPU with the expected shape.
    """

    arch: ModelArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        expected = expected_weight_shapes(self.arch)
        missing = sorted(expected.keys() - self.weights.keys())
        unexpected = sorted(self.weights.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(f"weights do not match the architecture: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{'...' if len(unexpected) > 5 else ''}")
        for name, shape in expected.items():
            tensor = self.weights[name]
            if tuple(tensor.shape) != shape or tensor.dtype != torch.float32 or tensor.device.type != "cpu":
                raise ValueError(f"{name}: expected fp32 CPU tensor of shape {shape}, "
                                 f"got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")


def cache_path(source: Path, cache_dir: Path) -> Path:
    """Where the converted form of `source` lives; changes whenever the file is replaced."""
    resolved = source.resolve()
    stat = resolved.stat()
    key = f"{CACHE_FORMAT_VERSION}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"{resolved.stem}-{digest}.safetensors"


def _arch_to_json(arch: ModelArchConfig) -> str:
    return json.dumps({**dataclasses.asdict(arch), "family": arch.family.value})


def _arch_from_json(text: str) -> ModelArchConfig:
    fields = json.loads(text)
    return ModelArchConfig(**{**fields, "family": ModelFamily(fields["family"])})


def load_cached(source: Path, cache_dir: Path) -> ModelParts | None:
    """The cached conversion of `source`, or None when there is none or it is unreadable."""
    path = cache_path(source, cache_dir)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format_version") != CACHE_FORMAT_VERSION:
                return None
            weights = {name: f.get_tensor(name) for name in f.keys()}
        return ModelParts(arch=_arch_from_json(metadata["arch"]), weights=weights,
                          tokenizer=Tokenizer.from_json(metadata["tokenizer"]))
    except Exception as e:  # a damaged entry is rebuilt, never fatal
        logger.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None


def store(source: Path, cache_dir: Path, parts: ModelParts) -> Path | None:
    """Write `parts` as the cache entry of `source`; returns its path, or None if the directory
    is not writable (the load still succeeds, only uncached)."""
    path = cache_path(source, cache_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    metadata = {"format_version": CACHE_FORMAT_VERSION, "source": str(source.resolve()),
                "arch": _arch_to_json(parts.arch), "tokenizer": parts.tokenizer.to_json()}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_file(parts.weights, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot write cache entry %s: %s", path, e)
        tmp.unlink(missing_ok=True)
        return None
    return path
