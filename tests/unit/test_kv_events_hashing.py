"""Block hashes: the bytes hashed are the documented ones (pinned vectors), the chain runs over the
previous block, and two processes (different PYTHONHASHSEEDs: a restart) compute equal chains."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kv_events.hashing import (
    DIGEST_BYTES, block_digest, block_hashes, chain_digests, model_root, to_external)

ROOT = model_root("SmolLM2-135M-Instruct")
REPO = Path(__file__).resolve().parents[2]


def test_the_documented_formula_and_pinned_vectors():
    """Any change to these bytes changes every hash a fleet has published: it must be deliberate."""
    assert ROOT == hashlib.sha256(b"kvbridge-root-v1" + b"SmolLM2-135M-Instruct").digest()
    assert ROOT.hex() == "1e78ac3a8918c0f4e7234314c150c540a4c352a228006a46e72161072b5024ab"
    tokens = [1, 2, 3]
    extra = ("salt", 1, b"x", None, ("mm", 2))
    by_hand = hashlib.sha256(b"kvbridge-block-v1" + ROOT + struct.pack(">I", 3) + struct.pack(">3I", *tokens)
                             + msgspec.msgpack.encode(extra)).digest()
    assert block_digest(ROOT, tokens, extra) == by_hand
    assert by_hand.hex() == "03e20512f1c00eefe9f4d8fdfe54e288ca22b34ad19aba4a38a78fa51ce6295b"
    assert block_hashes(ROOT, list(range(8)), 4) == [3345100817360595809, 13094635553475177626]


def test_each_block_chains_over_the_previous_one():
    a, b = chain_digests(ROOT, list(range(8)), 4)
    assert a == block_digest(ROOT, [0, 1, 2, 3]) and b == block_digest(a, [4, 5, 6, 7])
    # the same tokens after another first block hash differently
    assert chain_digests(ROOT, [9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != b


def test_only_full_blocks_have_hashes_and_a_longer_prompt_extends_the_chain():
    assert chain_digests(ROOT, list(range(7)), 4) == chain_digests(ROOT, list(range(4)), 4)
    assert chain_digests(ROOT, list(range(3)), 4) == []
    assert chain_digests(ROOT, list(range(12)), 4)[:2] == chain_digests(ROOT, list(range(8)), 4)


def test_models_extra_keys_and_token_counts_keep_hashes_apart():
    other = model_root("another-model")
    assert block_digest(ROOT, [1, 2]) != block_digest(other, [1, 2])
    assert block_digest(ROOT, [1, 2]) != block_digest(ROOT, [1, 2], ("salt",))
    assert block_digest(ROOT, [1, 2], ()) != block_digest(ROOT, [1, 2], None)
    assert block_digest(ROOT, [1, 2], ("a",)) != block_digest(ROOT, [1, 2], ("b",))
    assert block_digest(ROOT, [1]) != block_digest(ROOT, [1, 0])
    assert block_digest(ROOT, [256]) != block_digest(ROOT, [1, 0])


def test_extra_keys_go_block_by_block():
    with_salt = chain_digests(ROOT, list(range(8)), 4, [("s",), ("s",)])
    assert with_salt[0] == block_digest(ROOT, [0, 1, 2, 3], ("s",))
    assert with_salt[1] == block_digest(with_salt[0], [4, 5, 6, 7], ("s",))
    with pytest.raises(ValueError, match="2 full blocks"):
        chain_digests(ROOT, list(range(8)), 4, [("s",)])


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5]])
def test_token_ids_outside_u32_are_refused(tokens):
    with pytest.raises(ValueError, match="token ids"):
        block_digest(ROOT, tokens)


def test_bad_parents_roots_and_block_sizes_are_refused():
    with pytest.raises(ValueError, match="32-byte"):
        block_digest(b"short", [1])
    with pytest.raises(ValueError, match="empty"):
        model_root("")
    with pytest.raises(ValueError, match="block_size"):
        chain_digests(ROOT, [1], 0)


def test_external_form_is_the_low_64_bits():
    d = block_digest(ROOT, [1, 2, 3])
    assert len(d) == DIGEST_BYTES and to_external(d) == int.from_bytes(d, "big") % 2**64


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
def test_the_chain_is_a_function_of_the_prefix(tokens, block_size):
    hashes = block_hashes(ROOT, tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    for n in range(len(hashes) + 1):
        assert block_hashes(ROOT, tokens[:n * block_size], block_size) == hashes[:n]


CHILD = """
import json, sys
from kvbridge.kv_events.hashing import block_hashes, model_root
root = model_root(sys.argv[1])
tokens = list(range(1000, 1000 + 64))
extra = [("lora-a", "salt-\\u00e9", ("mm", b"\\x00\\x01", 3))] * 4
print(json.dumps({"plain": block_hashes(root, tokens, 16), "extra": block_hashes(root, tokens, 16, extra),
                  "str_hash": hash("seeded")}))
"""


def chains_in_a_new_process(seed: str) -> dict[str, list[int] | int]:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", CHILD, "SmolLM2-135M-Instruct"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, list[int] | int] = json.loads(out.stdout)
    return result


def test_two_processes_and_a_restart_compute_the_same_chains():
    """Two processes with different hash seeds (Python's own str hash differs between them, as it
    would between two instances or across a restart) give equal chains, equal to this process's."""
    first, restarted = chains_in_a_new_process("1"), chains_in_a_new_process("2")
    assert first["str_hash"] != restarted["str_hash"]  # the processes really are seeded apart
    assert first["plain"] == restarted["plain"] == block_hashes(ROOT, list(range(1000, 1064)), 16)
    assert first["extra"] == restarted["extra"] != first["plain"]
