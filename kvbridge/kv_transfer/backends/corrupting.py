"""A transfer backend wrapper that delivers wrong KV for a seeded fraction of reads.

It wraps any backend (fake, tcp, NIXL) and keeps its protocol: every call goes to the inner
agent, and a read it picks (``rate``, drawn from its own seeded generator) still moves real bytes
and settles DONE, only the wrong ones. The kinds are the bugs an end-to-end digest exists for
(kv_transfer/digest.py):

  corrupt  one byte of the read's local destination flipped once the read is DONE (a torn or
           overwritten block)
  truncate the read's last descriptor pair only half read (the tail keeps what it held before)
  shift    every remote descriptor moved back by the first one's length (an off-by-one block
           mapping)
  foreign  the remote descriptors of an earlier read from the same peer (another request's
           blocks) read instead, when one of the same lengths is known, else shifted

Local memory is flipped in place, so ``corrupt`` needs the local KV in host memory; the others
change only descriptors. ``counts`` says how many reads each kind hit.
"""

from __future__ import annotations

import ctypes
import random
from collections import Counter
from collections.abc import Sequence

from kvbridge.kv_transfer.backends.base import DescList, MemoryRegion, TransferBackend, TransferState, XferHandle

KINDS = ("corrupt", "truncate", "shift", "foreign")


class CorruptingBackend(TransferBackend):
    """`inner`: the real agent; `rate`: the fraction of reads delivered wrong; `kinds`: which
    corruptions to draw from (module docstring); `seed`: the generator's seed."""

    def __init__(self, inner: TransferBackend, rate: float, kinds: Sequence[str] = KINDS, seed: int = 0) -> None:
        super().__init__(inner.agent_name)
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        unknown = set(kinds) - set(KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be some of {KINDS}")
        self.inner, self.rate, self.kinds = inner, rate, tuple(kinds)
        self._rng = random.Random(seed)
        self._corrupt_on_done: dict[int, tuple[int, int]] = {}  # handle id -> local (addr, length) to flip
        # remote descs of the reads so far, per peer agent (for foreign)
        self._seen: dict[str, list[tuple[tuple[int, int], ...]]] = {}
        self.counts: Counter[str] = Counter()

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register_memory(regions)

    def agent_metadata(self) -> bytes:
        return self.inner.agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self.inner.add_remote_agent(metadata)

    def remove_remote_agent(self, name: str) -> None:
        self.inner.remove_remote_agent(name)

    def prep_descs(self, descs: Sequence[tuple[int, int]], device: str = "cpu", device_id: int = 0) -> DescList:
        return self.inner.prep_descs(descs, device, device_id)

    def read(self, remote_agent: str, local: DescList, remote: DescList, notif: bytes = b"") -> XferHandle:
        kind = self._rng.choice(self.kinds) if local.descs and self._rng.random() < self.rate else None
        r_descs, l_descs = list(remote.descs), list(local.descs)
        seen = self._seen.get(remote_agent, [])
        previous = [s for s in seen if [n for _, n in s] == [n for _, n in r_descs] and list(s) != r_descs]
        self._seen[remote_agent] = (seen + [tuple(r_descs)])[-64:]
        if kind == "foreign" and not previous:
            kind = "shift"
        if kind == "truncate":
            (la, ln), (ra, rn) = l_descs[-1], r_descs[-1]
            if ln < 2:
                kind = "corrupt"
            else:
                l_descs[-1], r_descs[-1] = (la, ln // 2), (ra, rn // 2)
        if kind == "shift":
            step = r_descs[0][1]  # out of the peer's region: the inner backend refuses the read (no misread)
            r_descs = [(a - step, n) for a, n in r_descs]
        elif kind == "foreign":
            r_descs = list(self._rng.choice(previous))
        if kind in ("truncate", "shift", "foreign"):
            local = self.inner.prep_descs(l_descs, local.device, local.device_id)
            remote = self.inner.prep_descs(r_descs, remote.device, remote.device_id)
        if kind is not None:
            self.counts[kind] += 1
        handle = self.inner.read(remote_agent, local, remote, notif)
        if kind == "corrupt":
            addr, length = l_descs[self._rng.randrange(len(l_descs))]
            self._corrupt_on_done[handle.handle_id] = (addr + self._rng.randrange(length), 1)
        return handle

    def check_state(self, handle: XferHandle) -> TransferState:
        state = self.inner.check_state(handle)
        if state is TransferState.DONE:
            target = self._corrupt_on_done.pop(handle.handle_id, None)
            if target is not None:
                byte = ctypes.c_ubyte.from_address(target[0])
                byte.value ^= 0x5A
        return state

    def release(self, handle: XferHandle) -> None:
        self._corrupt_on_done.pop(handle.handle_id, None)
        self.inner.release(handle)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        self.inner.send_notif(remote_agent, msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.inner.get_new_notifs()

    def shutdown(self) -> None:
        self.inner.shutdown()
