"""Benchmark: one TP step's exchange, StepChannel vs torch.distributed's object collectives.

A TP engine's step sends the scheduler output from the engine process to its N rank processes
and gathers one reply from each (engine/tp/executor.py). This times that exchange alone, with
nothing computed between, in N + 1 spawned processes on one gloo group (one torch thread each,
OMP_WAIT_POLICY=PASSIVE as a TP engine runs):

  objects  `broadcast_object_list` + `gather_object` (what the executor used before
           `StepChannel`: four collectives, one of them an all_gather through every process)
  channel  `StepChannel.broadcast` + `StepChannel.gather` (one broadcast and one gather of
           fixed-size frames; a message longer than a frame sends its rest after)

Per payload size, the two alternate in blocks of `--steps` exchanges, `--rounds` times; the
engine process sleeps `--gap-ms` between exchanges so that the ranks block in the collective
as they do between engine steps. Reported: the median exchange time of each over all its
exchanges, and the ratio channel / objects of the medians.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/tp_channel.py
    kvbridge bench tp_channel --ranks 3 --sizes 2000 200000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvbridge.engine.tp.channel import FRAME_BYTES, StepChannel  # noqa: E402

MODES = ("objects", "channel")


def _payload(size: int) -> dict:
    """A scheduler-output-like message whose pickle is about `size` bytes: token ids, block ids."""
    ints = max(size // 5, 1)
    return {"token_ids": list(range(1000, 1000 + ints // 2)), "block_ids": [list(range(ints - ints // 2))]}


def _exchange(mode: str, channel: StepChannel, rank: int, world: int, message, reply) -> list | None:
    if mode == "objects":
        box = [message]
        dist.broadcast_object_list(box, src=0)
        out = [None] * world if rank == 0 else None
        dist.gather_object(reply, out, dst=0)
        return out
    channel.broadcast(message)
    return channel.gather(reply)


def _process(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    channel = StepChannel(rank, world)
    for size in args.sizes:
        message = _payload(size) if rank == 0 else None
        reply = {"tokens": [7] * 16, "rank": rank} if rank else None
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rnd in range(args.rounds):
            for mode in MODES if rnd % 2 == 0 else reversed(MODES):
                for i in range(args.warmup + args.steps):
                    started = time.perf_counter()
                    _exchange(mode, channel, rank, world, message, reply)
                    if i >= args.warmup:
                        times[mode].append(time.perf_counter() - started)
                    if rank == 0:
                        time.sleep(args.gap_ms / 1e3)
        if rank == 0:
            results[size] = {m: statistics.median(t) * 1e3 for m, t in times.items()}
    dist.barrier()
    dist.destroy_process_group()


def _rank_entry(index: int, world: int, port: int, args: argparse.Namespace) -> None:
    _process(index + 1, world, port, args, {})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="rank processes (the engine process is one more)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000, 30_000, 200_000],
                        help=f"approximate pickle bytes of the engine's message (frame: {FRAME_BYTES})")
    parser.add_argument("--steps", type=int, default=100, help="timed exchanges per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed exchanges before each block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per mode, alternating which goes first")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="the engine process's sleep between exchanges")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    world = args.ranks + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(i, world, port, args)) for i in range(args.ranks)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, float]] = {}
    _process(0, world, port, args, results)
    for p in procs:
        p.join()
    print(f"one step's exchange, {args.ranks} rank processes + the engine process, gloo, "
          f"medians of {args.rounds} x {args.steps} exchanges (ms)")
    print(f"{'message B':>10} {'objects':>8} {'channel':>8} {'ratio':>6}")
    for size, r in results.items():
        print(f"{size:>10} {r['objects']:>8.3f} {r['channel']:>8.3f} {r['channel'] / r['objects']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
