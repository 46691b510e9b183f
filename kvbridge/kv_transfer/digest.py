"""End-to-end digests of transferred KV: the last line of defence against KV that arrives wrong.

Every other check binds the *request* (lease, generation, prompt digest); this one checks the
*bytes*. A block freed and reused under a read, a wrong block mapping across TP layouts or KV
groups, a stale registration after a restart, a torn read: each leaves D with bytes P never
computed for this prompt, and each is caught by comparing digests.

Which bytes: the reader's view. D plans its reads before asking P to grant them (the plan is a
pure function of both layouts: read_plan/), and sends, per P rank, the remote spans it is about
to read, in order. P checks every span lies inside the KV blocks the lease grants (on that
rank's registered region) and answers one digest per span with the grant. After the read D
digests its own local span of each read and compares, in the rank that holds the memory, before
the read is reported done (so before any decode step uses the KV). P digesting the reader's view
rather than D mapping P's per-block digests means one rule for every layout: dense (a span per
block), MLA (the one replicated latent read from one P rank), hybrid groups (the Mamba state pages
are spans like any other) and hetero-TP (the head slices D reads): whatever D reads, P digested
exactly that, so no layout needs its own mapping of digests. What it cannot catch is a D that
reads consistently from the wrong place on P *and* names that place to P: P refuses any span
outside the granted blocks, which bounds that to a reordering within the request's own blocks.

When: P digests when it grants the read. The lease holds the blocks from the request's finish
(their last write) until D's read-done, release or expiry, so these are the bytes of the grant.

Memory: hashed in place through a memoryview of the registered storage (no copy). KV on a GPU is
not hashed (copying it to host to hash would cost more than the transfer): such a rank answers
no digest and D counts the read as unverified (``unverified_reads``).

The algorithm and its version are part of the handshake's compatibility info (``kv_digest``), so
a P and a D with different settings (another algorithm, or verification off on one side) refuse
each other's handshake cleanly instead of misreading.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence

import xxhash

DIGEST_ALGORITHM = "xxh3_64"
DIGEST_VERSION = 1
DIGEST_ID = f"{DIGEST_ALGORITHM}/v{DIGEST_VERSION}"  # the handshake's kv_digest when verification is on
DIGEST_OFF = "off"  # the handshake's kv_digest when verification is off
MAX_DIGEST_SPANS = 1 << 20  # the most spans one check_read may ask P to digest

Span = tuple[int, int]  # (address, length) in host memory


def digest_bytes(buffer: memoryview | bytes) -> int:
    """The digest of one span's bytes (xxh3_64)."""
    return int(xxhash.xxh3_64_intdigest(buffer))


def digest_span(addr: int, length: int) -> int:
    """The digest of `length` bytes of host memory at `addr`, hashed in place (no copy). The
    caller guarantees the span lies in memory it owns (a registered KV region)."""
    return digest_bytes(memoryview((ctypes.c_char * length).from_address(addr)).cast("B"))


def digest_spans(spans: Sequence[Span]) -> list[int]:
    return [digest_span(a, n) for a, n in spans]


def within(spans: Sequence[Span], allowed: Sequence[Span]) -> bool:
    """Every span is non-empty and lies inside the union of the `allowed` spans (spans that touch
    merge: a read of consecutive blocks is one span)."""
    merged: list[list[int]] = []
    for lo, n in sorted(allowed):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], lo + n)
        else:
            merged.append([lo, lo + n])
    starts = [m[0] for m in merged]
    for addr, n in spans:
        i = bisect.bisect_right(starts, addr) - 1
        if n <= 0 or i < 0 or addr + n > merged[i][1]:
            return False
    return True
