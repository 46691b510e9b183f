"""The proxy's tap on a passing stream (exchange.UsageTap): it finds the usage event that reports
cached prompt tokens however the bytes are cut, once, and keeps no more than one event's bytes."""

from __future__ import annotations

import json

from kvbridge.proxy.exchange import UsageTap

CHUNK = b'data: {"choices": [{"index": 0, "text": " the"}], "usage": null}\n\n'
USAGE = (b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 8, '
         b'"prompt_tokens_details": {"cached_tokens": 32}}}\n\n')
STREAM = CHUNK * 3 + USAGE + b"data: [DONE]\n\n"


def _seen(pieces: list[bytes]) -> list[int]:
    seen: list[int] = []
    tap = UsageTap(lambda event: seen.append(json.loads(event)["usage"]["prompt_tokens_details"]["cached_tokens"]))
    for piece in pieces:
        tap.feed(piece)
    return seen


def test_the_usage_event_is_found_however_the_stream_is_cut():
    for size in (1, 2, 3, 7, 16, 64, len(STREAM)):
        assert _seen([STREAM[i:i + size] for i in range(0, len(STREAM), size)]) == [32], size


def test_found_once_and_nothing_without_usage():
    assert _seen([STREAM, STREAM]) == [32]  # continuous usage stats: the first report counts
    assert _seen([CHUNK * 5 + b"data: [DONE]\n\n"]) == []


def test_an_event_that_never_ends_is_not_kept_whole():
    tap = UsageTap(lambda event: None)
    for _ in range(40):
        tap.feed(b"x" * 65536)  # 2.5 MB with no event boundary
    assert len(tap._tail) <= UsageTap.MAX_EVENT_BYTES
