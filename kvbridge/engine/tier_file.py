"""One rank's KV tier file (engine/kv_tier.py has the design): `num_slots` slots of one KV page
(one logical block of this rank, every layer) each, in an unlinked file on local disk, and the
digest (xxh3_64, as kv_transfer/digest.py) of what each slot was last given.

Stores write a page straight from the KV cache (`os.pwrite` of its memory: no staging copy); loads
read straight into the request's page (`os.preadv`) and check the digest there, before any step
computes from it. A short read (a truncated file), an I/O error or a digest that differs fails
that block alone: the report says so, the scheduler drops the entry and recomputes. The kernel
releases the GIL for both calls, and writes the page cache back to disk on its own.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import xxhash

from kvbridge.engine.kv_tier import TierReport, TierWork


def digest_bytes(page: memoryview) -> int:
    """xxh3_64 of a page, in place: the algorithm of the transfers' digests (kv_transfer/digest.py)."""
    return int(xxhash.xxh3_64_intdigest(page))


class TierFile:
    def __init__(self, pages: torch.Tensor, num_slots: int, directory: str | None = None) -> None:
        """`pages`: the rank's KV cache as [num_blocks, page_elems] (KVCacheLayout.pages), on the CPU."""
        if pages.device.type != "cpu":
            raise ValueError("the KV tier keeps CPU pages (a GPU's host-memory tier is not built)")
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._bytes = pages.view(torch.uint8).view(pages.shape[0], -1).numpy()  # the same memory, as bytes
        self.page_bytes = self._bytes.shape[1]
        fd, path = tempfile.mkstemp(prefix="kvbridge-kv-tier-", suffix=".bin", dir=directory)
        os.unlink(path)  # gone with the process: a restart starts with an empty tier
        self.fd = fd
        os.ftruncate(fd, num_slots * self.page_bytes)  # sparse until written
        self._digests: list[int | None] = [None] * num_slots

    def run(self, work: TierWork) -> TierReport:
        """Stores first (their blocks may be overwritten by this step), then loads."""
        report = TierReport()
        started = time.perf_counter()
        for store in work.stores:
            page = memoryview(self._bytes[store.block_id])
            self._digests[store.slot] = None  # a failed write must not leave the old digest valid
            os.pwrite(self.fd, page, store.slot * self.page_bytes)
            self._digests[store.slot] = digest_bytes(page)
        loads_started = time.perf_counter()
        report.store_s = loads_started - started
        for load in work.loads:
            n = 0
            for slot, block_id in zip(load.slots, load.block_ids):
                if not self._read(slot, block_id):
                    report.bad_slots.add(slot)
                    break
                n += 1
            report.loaded[load.request_id] = n
            report.load_bytes += n * self.page_bytes
        report.load_s = time.perf_counter() - loads_started
        return report

    def _read(self, slot: int, block_id: int) -> bool:
        want = self._digests[slot]
        page = memoryview(self._bytes[block_id])
        try:
            got = os.preadv(self.fd, [page], slot * self.page_bytes)
        except OSError:
            return False
        return want is not None and got == self.page_bytes and digest_bytes(page) == want

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
