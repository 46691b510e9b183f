"""Native memory of an engine process: oneDNN's per-shape caches bounded, glibc's heap trimmed.

Why: every matmul torch runs through oneDNN (kvbridge's prepacked fp32 and bf16 linears,
every bf16 linear) gets a JIT-compiled primitive for its exact shape, and oneDNN keeps it in
its primitive cache, keyed by shape, with ideep (torch's wrapper) keeping its own cache on top.
Both default to 1024 entries. A step's row count is its number of tokens, so every prompt
length is a new shape for each distinct linear weight (four in a Llama layer): with prompts
of ever-changing lengths a prefilling server created four primitives of about 0.5 MB each
per request, for over a thousand requests, before the caches stopped it (1-1.5 GB here). A
decode-only instance stays flat: its row counts are its batch sizes, a few dozen values.

The fix bounds both caches (`PRIMITIVE_CACHE_CAPACITY` entries each, least recently used
evicted): the working set of decode batch sizes stays cached, prefill shapes come and go (a
new shape's primitives cost little to create against the prefill they serve:
benchmarks/native_memory_ab.py). The entries evicted and created leave holes in glibc's heap that it does not hand
back by itself, so the model runner calls `malloc_trim` at most every `TRIM_INTERVAL_S`
seconds to return the free pages to the OS.

Both capacities are read from the environment once, when oneDNN makes its first primitive in
the process, so `bound_onednn_caches` must run before any model is built (the engine and each
TP rank call it from `configure_torch_threads`). A value already in the environment wins.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Entries in oneDNN's primitive cache, and in ideep's: 256 holds a Llama model's five linear
# weights (four per layer and the head) at about 50 row counts. The default of both is 1024.
PRIMITIVE_CACHE_CAPACITY = 256
CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's
TRIM_ENV = "KVBRIDGE_MALLOC_TRIM_S"  # seconds between trims; 0 turns them off
TRIM_INTERVAL_S = 10.0


def bound_onednn_caches(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> None:
    """Set both caches' capacity in this process's environment unless it is set already.
    Effective only before the process's first oneDNN primitive (nothing before the model)."""
    for name in CACHE_ENV:
        os.environ.setdefault(name, str(capacity))


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc; absent on musl and other C libraries
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    trim: Callable[[int], int] = fn
    return trim


_malloc_trim = _load_malloc_trim()


def trim_interval_s() -> float:
    """The interval from KVBRIDGE_MALLOC_TRIM_S (0: never), else TRIM_INTERVAL_S."""
    value = os.environ.get(TRIM_ENV)
    if not value:
        return TRIM_INTERVAL_S
    try:
        return max(0.0, float(value))
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %s", TRIM_ENV, value, TRIM_INTERVAL_S)
        return TRIM_INTERVAL_S


class HeapTrimmer:
    """Calls glibc's malloc_trim(0) (every arena's free pages back to the OS) when `maybe_trim`
    finds `interval_s` passed since the last call. Does nothing without glibc or at interval 0."""

    def __init__(self, interval_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = trim_interval_s() if interval_s is None else interval_s
        self.clock = clock
        self.last = clock()
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return _malloc_trim is not None and self.interval_s > 0

    def maybe_trim(self) -> bool:
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.last < self.interval_s or _malloc_trim is None:
            return False
        _malloc_trim(0)
        self.last = self.clock()
        self.trims += 1
        return True
