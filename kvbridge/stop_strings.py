"""The stop-string rule a stream follows, on the ground floor because two programs apply it: the
engine's output processor (what an unfinished stream may emit) and the proxy's first token from
prefill (what a stream has emitted after P's token, which D then continues)."""

from __future__ import annotations

from collections.abc import Sequence


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` a stream holds back while unfinished: the
    longest end that is the start of a stop string (it may still become one)."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                longest = max(longest, k)
                break
    return longest
