"""The fleet index's rebuild from replayed KV event batches, on one core (issue 47's target: at
most 1 s per million blocks; Dynamo reported 45-50 s for 2.27 M events in a rollout).

What is timed: a router that joins late (or lost history) gets one instance's whole history as
replay answers, and `FleetIndex` ingests them: each payload decoded (vLLM 0.33's map encoding)
and its blocks added. The batches are what vLLM publishes: each event a BlockStored of
`--blocks-per-event` blocks with their token ids (block size 16), `--events-per-batch` events per
batch (one engine step), a BlockRemoved for every `--remove-every`-th event. Figures: seconds per
million blocks, events and batches per second; decoding alone; the index's memory per million
blocks (tracemalloc, a separate pass); with `--over-zmq`, the same history replayed for real
from a ZmqEventPublisher's ROUTER to an EventSubscriber on 127.0.0.1 (end-to-end rebuild).

The process is pinned to one CPU (sched_setaffinity). Prints the CPU model (lscpu).

    python benchmarks/kv_index.py --blocks 1000000 [--over-zmq] [--json /tmp/kv_index.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
import tracemalloc

from kvbridge.kv_events.config import KVEventsConfig
from kvbridge.kv_events.events import (
    BlockRemoved, BlockStored, DecodedBatch, KVEventBatch, decode_batch, decode_hashes, encode_batch)
from kvbridge.kv_events.hashing import model_root
from kvbridge.kv_events.index import FleetIndex, InstanceStatus
from kvbridge.kv_events.publisher import ZmqEventPublisher
from kvbridge.kv_events.subscriber import EventSubscriber

BLOCK_SIZE = 16


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def history(blocks: int, blocks_per_event: int, events_per_batch: int, remove_every: int) -> tuple[list[bytes], int, int]:
    """Encoded batches holding `blocks` stored blocks; (payloads, events, removed blocks)."""
    rng = random.Random(0)
    pool = [rng.randrange(50_000) for _ in range(1 << 16)]  # token ids: slices of a random pool
    payloads: list[bytes] = []
    events: list[BlockStored | BlockRemoved] = []
    n_events = removed = stored = 0
    parent: int | None = None
    while stored < blocks:
        k = min(blocks_per_event, blocks - stored)
        hashes = [rng.getrandbits(64) for _ in range(k)]
        events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=pool[(o := rng.randrange(1 << 15)):o + k * BLOCK_SIZE],
                                  block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                                  kv_cache_spec_kind="full_attention"))
        stored += k
        parent = hashes[-1]
        n_events += 1
        if remove_every and n_events % remove_every == 0:
            events.append(BlockRemoved(block_hashes=hashes[:1], medium="GPU", group_idx=0))
            removed += 1
            n_events += 1
        if len(events) >= events_per_batch:
            payloads.append(encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
            events = []
    if events:
        payloads.append(encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return payloads, n_events, removed


def rebuild(payloads: list[bytes]) -> tuple[float, FleetIndex]:
    """A late join: the first live message asks for replay from 0; every batch replayed; timed."""
    index = FleetIndex(model_root("bench"), BLOCK_SIZE)
    start = time.perf_counter()
    index.ingest("d0", [b"", (len(payloads)).to_bytes(8, "big"), encode_batch(KVEventBatch(ts=0.0, events=[]))])
    for seq, payload in enumerate(payloads):
        index.ingest_replay("d0", seq, payload)
    index.end_replay("d0", ok=True)
    elapsed = time.perf_counter() - start
    assert index.status("d0") is InstanceStatus.LIVE and index.view("d0").complete
    return elapsed, index


def over_zmq(payloads: list[bytes]) -> float:
    """The same history published for real, then replayed over the ROUTER to a late subscriber."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_steps=len(payloads) + 10,
                            max_queue_size=len(payloads) + 10)
    publisher = ZmqEventPublisher(config, put_timeout_s=5.0)
    subscriber = None
    try:
        for payload in payloads:
            b = decode_batch(payload)
            assert isinstance(b, DecodedBatch)
            publisher.publish(KVEventBatch(ts=b.ts, events=list(b.events), data_parallel_rank=0))
        deadline = time.monotonic() + 600
        while publisher.stats().published < len(payloads) and time.monotonic() < deadline:
            time.sleep(0.05)
        index = FleetIndex(model_root("bench"), BLOCK_SIZE)
        subscriber = EventSubscriber("d0", index, publisher.endpoint, publisher.replay_endpoint,
                                     replay_timeout_s=120.0)
        start = time.perf_counter()
        while (index.view("d0").last_seq or 0) < len(payloads) and time.perf_counter() - start < 600:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            subscriber.run_once(0.05)
        return time.perf_counter() - start
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.shutdown(timeout_s=5.0)


def measure(blocks: int, blocks_per_event: int, events_per_batch: int, remove_every: int,
            repeats: int, with_zmq: bool) -> dict[str, object]:
    payloads, n_events, removed = history(blocks, blocks_per_event, events_per_batch, remove_every)
    per_m = 1e6 / blocks
    decode_s = {}
    for name, decode in (("full", decode_batch), ("index", decode_hashes)):
        start = time.perf_counter()
        for p in payloads:
            decode(p)
        decode_s[name] = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        elapsed, index = rebuild(payloads)
        times.append(elapsed)
    held = index.view("d0").blocks[0]
    del index
    tracemalloc.start()
    _, index = rebuild(payloads)
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del index
    best = min(times)
    result: dict[str, object] = {
        "blocks": blocks, "blocks_per_event": blocks_per_event, "events": n_events, "batches": len(payloads),
        "events_per_batch": events_per_batch, "payload_mb": round(sum(map(len, payloads)) / 1e6, 1),
        "removed_blocks": removed, "blocks_held": held, "rebuild_s": [round(t, 3) for t in times],
        "rebuild_s_per_million_blocks": round(best * per_m, 3),
        "events_per_s": round(n_events / best), "batches_per_s": round(len(payloads) / best),
        "decode_s_per_million_blocks": {k: round(v * per_m, 3) for k, v in decode_s.items()},
        "index_mb_per_million_blocks": round(mem / 1e6 * per_m, 1),
    }
    if with_zmq:
        result["over_zmq_rebuild_s_per_million_blocks"] = round(over_zmq(payloads) * per_m, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--blocks-per-event", type=int, nargs="+", default=[1, 16],
                        help="event shapes, each measured: 1 is the worst case, vLLM stores a request's new blocks in one event")
    parser.add_argument("--events-per-batch", type=int, default=32)
    parser.add_argument("--remove-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--over-zmq", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    result = {"cpu": cpu_model(), "shapes": [
        measure(args.blocks, k, args.events_per_batch, args.remove_every, args.repeats, args.over_zmq)
        for k in args.blocks_per_event]}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
