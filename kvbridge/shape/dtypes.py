"""The dtype names a configuration may give (`EngineConfig.dtype`) and the torch dtypes they
stand for: the model runner allocates weights and the KV cache in one, and the connector sizes a
KV cache element by it."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
