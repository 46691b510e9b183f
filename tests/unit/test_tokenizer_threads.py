"""Tokenising a long prompt on a worker thread must leave the other threads running (issue
14, finding 8): the API server tokenises off its event loop, which helps only if the
tokenizer releases the GIL while it works."""

from __future__ import annotations

import threading

import pytest

from kvbridge.engine.loader import DEFAULT_MODEL, load_model
from kvbridge.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_model(DEFAULT_MODEL).tokenizer


def test_other_threads_run_while_a_long_text_is_encoded(tokenizer: Tokenizer) -> None:
    """This thread counts how often it gets to run while another encodes ~0.9 MB (half a
    second of work or more). Holding the GIL, the encode lets it run at most a couple of times (as
    the encode ends); releasing it, hundreds of times. Nothing here depends on how fast the
    machine is: a slow machine only makes the encode longer."""
    text = "All work and no play makes Jack a dull boy. " * 20_000
    started, finished = threading.Event(), threading.Event()

    def encode() -> None:
        started.set()
        tokenizer.encode(text)
        finished.set()

    worker = threading.Thread(target=encode)
    worker.start()
    assert started.wait(30)
    ran = 0
    while not finished.wait(0.001):  # each timeout is one chance to run while the encode works
        ran += 1
    worker.join()
    assert ran >= 5, f"this thread ran {ran} times during the encode: the tokenizer holds the GIL"


def test_no_token_stands_for_more_bytes_than_the_bound(tokenizer: Tokenizer) -> None:
    """SmolLM2's vocabulary has no normalizer: the bound is its longest entry, and a text of
    that entry repeated n times is n tokens of at most that many bytes."""
    bound = tokenizer.max_bytes_per_token
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_text(i).encode("utf-8")))
    text = tokenizer.token_text(longest) * 50
    assert len(text.encode("utf-8")) <= len(tokenizer.encode(text)) * bound
    assert bound >= max(len(tokenizer.token_text(i).encode("utf-8")) for i in range(tokenizer.vocab_size))
