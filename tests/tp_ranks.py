"""What the tensor-parallel parity tests share: joining a real gloo group from a spawned rank
process, and loading a Hugging Face folder's model (a rank's shard of it) through kvbridge's
own loader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from kvbridge.engine.loader.safetensors import arch_from_config, read_weights
from kvbridge.engine.models import CausalLM, build_model
from kvbridge.shape.model_config import ModelArchConfig
from kvbridge.shape.tp_split import RankShard, rank_shard
from tests.paged_steps import PagedSteps, prompt

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def join_gloo(rank: int, world: int, store: str) -> AllReduce:
    """Join the gloo group of `world` ranks rendezvousing at the file `store` (one thread per
    rank); returns the in-place sum over the ranks the model layers take."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t
    return all_reduce


def leave_gloo() -> None:
    """Leave the group: a barrier first, so no rank exits while a peer still receives the last
    collective's data from it (gloo aborts that peer: "terminate called without an active
    exception", a SIGABRT seen once in CI in test_tp_parity's TP 4 run)."""
    dist.barrier()
    dist.destroy_process_group()


def load_folder(folder: Path, tp: int = 1, rank: int = 0, all_reduce: AllReduce | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[ModelArchConfig, CausalLM, RankShard | None]:
    """The folder's architecture and model (rank `rank` of `tp`'s shard) in `dtype`, weights loaded."""
    arch = arch_from_config(json.loads((folder / "config.json").read_text()))
    shard = rank_shard(arch.num_heads, arch.cache_kv_heads, tp, rank) if tp > 1 else None
    model = build_model(arch, dtype, "cpu", shard, all_reduce)
    model.load_weights(read_weights(folder, arch))
    return arch, model, shard


def paged_scenario(steps: PagedSteps) -> dict[str, torch.Tensor]:  # or any runner with its step() and tokens
    """Per sequence, the logits of every token it computed across mixed steps (a whole prefill,
    a decode beside a first chunk, a chunk after context, batched decodes at different context
    lengths), and the tokens of each sequence."""
    rows: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def run(new: dict[str, list[int]]) -> None:
        for seq, logits in steps.step(new).items():
            rows[seq].append(logits)
    run({"a": prompt(13, seed=1)})  # whole prefill
    run({"a": [int(rows["a"][-1][-1].argmax())], "b": prompt(6, seed=2)})  # decode + first chunk
    run({"b": prompt(5, seed=3)})  # the rest of b's prompt (a chunk after context)
    for _ in range(3):  # batched decode at different context lengths
        run({seq: [int(rows[seq][-1][-1].argmax())] for seq in ("a", "b")})
    return {seq: torch.cat(r) for seq, r in rows.items()} | {
        f"{seq}_tokens": torch.tensor(steps.tokens[seq]) for seq in ("a", "b")}


def scenario_rank(rank: int, world: int, store: str, models: str, out: str) -> None:
    """A rank process: for every (architecture, weights) saved at `models` (name -> pair), load
    this rank's shard and run `paged_scenario`; rank 0 saves the results at `out`."""
    all_reduce = join_gloo(rank, world, store)
    results = {}
    for name, (arch, weights) in torch.load(models, weights_only=False).items():
        shard = rank_shard(arch.num_heads, arch.num_kv_heads, world, rank)
        model = build_model(arch, torch.float32, "cpu", shard, all_reduce)
        model.load_weights(weights)
        results[name] = paged_scenario(PagedSteps(model, arch, num_kv_heads=shard.num_kv_heads))
    if rank == 0:
        torch.save(results, out)
    leave_gloo()
