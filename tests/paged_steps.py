"""A minimal paged model runner for the parity tests, and their shared constants.

Imports torch and kvbridge only (no `transformers`), so a spawned tensor-parallel rank process
that runs a scenario does not pay for importing transformers (several seconds of CPU per rank).
"""

from __future__ import annotations

import torch

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.models import CausalLM, kv_cache_shape
from kvbridge.shape.model_config import ModelArchConfig

VOCAB = 96
BLOCK_SIZE = 4
ATOL = 1e-4


class PagedSteps:
    """A minimal model runner: hands out shuffled blocks and runs steps of (seq -> new tokens)."""

    def __init__(self, model: CausalLM, arch: ModelArchConfig, num_blocks: int = 48, seed: int = 0,
                 num_kv_heads: int | None = None) -> None:
        self.model = model
        self.kv_cache = torch.zeros(kv_cache_shape(arch, num_blocks, BLOCK_SIZE, num_kv_heads))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.last_attn: AttentionMetadata | None = None

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Computes every sequence's new tokens in one forward; returns their logits per sequence."""
        query_lens, context_lens, tables, ids, positions = [], [], [], [], []
        for seq, toks in new_tokens.items():
            done = len(self.tokens.setdefault(seq, []))
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < done + len(toks):
                table.append(self.free.pop())
            self.tokens[seq].extend(toks)
            query_lens.append(len(toks))
            context_lens.append(done + len(toks))
            tables.append(table)
            ids.extend(toks)
            positions.extend(range(done, done + len(toks)))
        attn = self.last_attn = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE, "cpu")
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), attn, self.kv_cache)
        logits = self.model.compute_logits(hidden)
        bounds = attn.query_start_loc
        return {seq: logits[bounds[i]:bounds[i + 1]] for i, seq in enumerate(new_tokens)}


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
