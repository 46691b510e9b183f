"""Model runner: scheduler output -> input tensors -> forward -> sampling.

It owns the model, the KV cache tensor and the sampler, and drives its rank's KV transfer
agent (rank_agent.RankAgent) around each forward pass.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from kvbridge.config import EngineConfig
from kvbridge.engine.layers import cpu_kernels
from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.mamba2 import Mamba2Metadata
from kvbridge.engine.models import build_model
from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.setup.native_memory import HeapTrimmer, bound_onednn_caches
from kvbridge.engine.tier_file import TierFile
from kvbridge.engine.sampling import Sampler
from kvbridge.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvbridge.kv_transfer.connector.rank_agent import RankAgent, reads_start_together
from kvbridge.shape.dtypes import DTYPES
from kvbridge.shape.kv_cache_layout import rank_kv_cache_layout
from kvbridge.shape.kv_groups import KVCacheKind, layer_groups
from kvbridge.shape.model_config import ModelArchConfig
from kvbridge.shape.tp_split import RankShard

logger = logging.getLogger(__name__)
# Prompt logprobs are computed over at most this many rows at once (a [rows, vocab] float32 scratch).
PROMPT_LOGPROB_ROWS = 256

def configure_torch_threads(num_threads: int) -> None:
    """Process-wide settings for an engine's (or a TP rank's) torch work, before any model is built.

    Small ops are many times slower without a passive OpenMP wait policy where processes share
    cores (cli.py); the variable must be set before torch starts its thread pool. oneDNN's per-shape caches are
    bounded before its first primitive (setup/native_memory.py: without it memory grew with every
    prompt length)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    bound_onednn_caches()
    torch.set_num_threads(num_threads)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no GPU")
    return torch.device(device)


_MADV_HUGEPAGE = 14
_PAGE = 4096


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under a large CPU tensor (before it is touched).

    NIXL/UCX pins the KV cache page by page for its zero-copy reads, which run faster on huge
    pages than on 4 KiB ones (benchmarks/README.md, pd_transfer). Best effort: False if refused."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        start = -(-t.data_ptr() // _PAGE) * _PAGE
        end = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
        if end <= start:
            return False
        advised: bool = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
        return advised
    except (OSError, AttributeError):
        return False


def kv_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """One logical block (a page: shape/kv_cache_layout.py), every layer, on one rank (every rank of
    `tp_size` holds as much). `block_size`: the configured (kernel) block size."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return rank_kv_cache_layout(arch, block_size, 1, tp_size).page_elems * elem


def tier_slots(config: EngineConfig, arch: ModelArchConfig) -> int:
    """Blocks the KV tier holds (engine/kv_tier.py; each rank its shard of every one): the configured
    bytes, all ranks together as vLLM's --kv-offloading-size, over one block's bytes on all ranks.
    0: no tier."""
    cache, tp = config.cache, config.tensor_parallel_size
    if not cache.kv_offloading_bytes:
        return 0
    return cache.kv_offloading_bytes // (kv_bytes_per_block(arch, cache.block_size, DTYPES[config.dtype], tp) * tp)


class ModelRunner:
    """One rank's model and KV cache. With tensor parallelism (`shard`, `all_reduce`) each rank
    process has one; only the rank that `samples` (rank 0) computes logits and samples.
    `block_size` is the configured (attention kernel) block size and `num_blocks` counts
    logical blocks; the scheduler's block tables are in logical blocks of
    `self.layout.logical_block_size` tokens (shape/kv_cache_layout.py)."""

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: str, device: str,
                 block_size: int, num_blocks: int, seed: int = 0,
                 agent: RankAgent | None = None, shard: RankShard | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, samples: bool = True,
                 sync_ranks: Callable[[], None] | None = None, tier_slots: int = 0,
                 tier_dir: str | None = None) -> None:
        """`sync_ranks` (TP ranks): returns once every rank has called it (a barrier). `tier_slots`:
        blocks this rank's KV tier file holds (engine/tier_file.py; 0: no tier), in `tier_dir`."""
        self.arch = arch
        self.sync_ranks = sync_ranks
        self.device = resolve_device(device)
        self.dtype = DTYPES[dtype]
        self.num_blocks = num_blocks
        self.samples = samples
        self.model = build_model(arch, self.dtype, self.device, shard, all_reduce)
        groups = layer_groups(arch)
        self.windows = [g.sliding_window for g in groups]  # per KV cache group
        self.mamba_groups = [g.kind is KVCacheKind.MAMBA for g in groups]
        self.model.load_weights(weights)
        tp_size = shard.tp_size if shard is not None else 1
        self.tp_rank = shard.rank if shard is not None else 0
        self.layout = rank_kv_cache_layout(arch, block_size, num_blocks, tp_size, self.tp_rank)
        self.kernel_block_size = block_size
        self.block_size = self.layout.logical_block_size
        self.kv_cache = self.layout.allocate(self.dtype, self.device)
        if self.device.type == "cpu":
            advise_huge_pages(self.kv_cache)
        self.kv_cache.zero_()
        self.tier = TierFile(self.layout.pages(self.kv_cache), tier_slots, tier_dir) if tier_slots else None
        bind_layout = getattr(self.model, "bind_kv_cache_layout", None)  # a model with Mamba layers
        if bind_layout is not None:
            bind_layout(self.layout)
        if self.device.type == "cpu":
            cpu_kernels.available()  # build/load now, not in the first step (a warning if they cannot be)
        self.sampler = Sampler(seed)
        self.heap_trimmer = HeapTrimmer()  # returns the heap's free pages now and then (setup/native_memory.py)
        self.agent = agent
        if agent is not None:
            kv_heads = shard.kv_heads if shard is not None else range(arch.cache_kv_heads)
            agent.register(self.kv_cache, block_size, self.tp_rank, tp_size, kv_heads,
                           blocks_per_logical=self.layout.blocks_per_logical)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(sched.finished_req_ids)
        out = ModelRunnerOutput()
        if self.tier is not None and sched.kv_tier is not None:  # first: stores read blocks this step rewrites
            out.kv_tier_report = self.tier.run(sched.kv_tier)
        if self.agent is not None and sched.kv_rank_commands:
            if self.sync_ranks is not None and reads_start_together(sched.kv_rank_commands):
                self.sync_ranks()
            self.agent.apply(sched.kv_rank_commands[self.tp_rank])
        if sched.scheduled:
            self._forward_and_sample(sched, out)
            self.heap_trimmer.maybe_trim()
        if self.agent is not None:
            out.kv_rank_reports = [self.agent.poll()]
        return out

    def _forward_and_sample(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, sample_rows = [], [], []
        tables: list[list[Sequence[int]]] = [[] for _ in self.windows]  # per group, per request
        prompt_rows: list[tuple[str, int, tuple[int, ...], int]] = []  # request, first row, targets, top k
        for s in sched.scheduled:
            n = len(s.token_ids)
            if s.prompt_logprob_targets:
                prompt_rows.append((s.request_id, len(input_ids) + s.prompt_logprob_row, s.prompt_logprob_targets,
                                    s.sampling_params.prompt_logprobs or 0))
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + n))
            query_lens.append(n)
            context_lens.append(s.start_pos + n)
            for group_tables, table in zip(tables, s.block_ids):
                group_tables.append(table)
            if s.sample:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        metas: list[AttentionMetadata | Mamba2Metadata] = []
        for t, window, mamba in zip(tables, self.windows, self.mamba_groups):
            if mamba:  # each request's one state: its block of this group
                metas.append(Mamba2Metadata.from_context(query_lens, context_lens, [ids[0] for ids in t], dev))
            else:
                kernel = [self.layout.kernel_block_ids(list(ids)) for ids in t]
                metas.append(AttentionMetadata.build(query_lens, context_lens, kernel, self.kernel_block_size, dev,
                                                     window))
        attn = metas[0] if len(metas) == 1 else metas
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), attn, self.kv_cache)
        if not self.samples:
            return
        for request_id, row, targets, k in prompt_rows:
            out.prompt_logprobs[request_id] = self._prompt_logprobs(hidden, row, targets, k)
        if not sample_rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        sampled = [s for s in sched.scheduled if s.sample]
        masks = {row: sched.grammar_bitmasks[s.request_id] for row, s in enumerate(sampled)
                 if s.request_id in sched.grammar_bitmasks}
        result = self.sampler.sample(logits, [s.request_id for s in sampled], [s.sampling_params for s in sampled],
                                     [s.num_output_tokens for s in sampled], [s.penalty_token_ids for s in sampled],
                                     masks)
        out.sampled_token_ids = result.tokens
        out.logprobs = result.logprobs
        out.sampling_errors = result.errors

    def _prompt_logprobs(self, hidden: torch.Tensor, row: int, targets: tuple[int, ...],
                         k: int) -> list[TokenLogprob]:
        """The logprob and rank of each of `targets` under the logits of the rows from `row` on
        (each row's next prompt token), with `k` top alternatives: float32 log-softmax of the
        model's logits, as the sampler's logprobs. Slices of PROMPT_LOGPROB_ROWS rows bound the
        [rows, vocab] scratch."""
        out: list[TokenLogprob] = []
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            chunk = targets[lo:lo + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[row + lo:row + lo + len(chunk)])
            lp = torch.log_softmax(logits.float(), dim=-1).cpu()
            ids = torch.tensor(chunk, dtype=torch.long).unsqueeze(1)
            chosen = lp.gather(1, ids)
            ranks = (lp > chosen).sum(dim=1) + 1
            top = torch.topk(lp, k, dim=1) if k else None
            for i, tid in enumerate(chunk):
                pairs = tuple(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else ()
                out.append(TokenLogprob(tid, float(chosen[i, 0]), pairs, int(ranks[i])))
        return out
