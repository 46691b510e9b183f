"""The proxy's half of KV reuse (proxy/kv_reuse.py): which instance is asked to hold a prefix, what a
holder's answer must be for its params to be sent on, and what the serving instance receives. The
holder answers over the real HTTP protocol here (an httpx transport answering /kvbridge/kv_hold as
an instance does, api_server._kv_hold); the whole path on real instances is
tests/integration/test_held_prefix_pd.py and tests/e2e/test_kv_reuse_turns.py."""

from __future__ import annotations

import json

import httpx
import pytest

from kvbridge.proxy.fleet_view import Prediction
from kvbridge.proxy.kv_reuse import HOLD_PATH, Held, better_holder, held_params, hold, with_held

P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"
IDS = tuple(range(100, 200))


@pytest.mark.parametrize("cached, targets, cannot, want", [
    ({P1: 0, D1: 64}, [P1], set(), D1),  # the D that answered the last turn holds the history
    ({P1: 48, D1: 64}, [P1], set(), D1),  # a block more than P's own cache: worth a read
    ({P1: 56, D1: 64}, [P1], set(), None),  # under a block more: P computes the difference
    ({P1: 64, D1: 64}, [P1], set(), None),  # P holds as much itself
    ({P1: 0, P2: 80, D1: 64}, [P1, P2], set(), None),  # a target holds the most: routing sends it there
    ({P1: 0, P2: 0, D1: 32, D2: 64}, [P1, P2], set(), D2),  # the longest holder of all
    ({P1: 0, D1: 64, D2: 32}, [P1], {D1}, D2),  # one that never holds is never asked
    ({P1: 0, D1: 0}, [P1], set(), None),  # nothing cached anywhere
    ({P1: 0, D1: 64}, [], set(), None),  # nowhere to send it
    ({D1: 0, D2: 64}, [D1, D2], set(), None),  # D alone: the holder is a target itself
])
def test_the_holder_asked(cached: dict[str, int], targets: list[str], cannot: set[str], want: str | None) -> None:
    assert better_holder(Prediction(100, cached, IDS), targets, 16, cannot) == want


def test_no_holder_without_a_prediction_or_its_token_ids() -> None:
    assert better_holder(None, [P1], 16) is None
    assert better_holder(Prediction(100, {P1: 0, D1: 64}), [P1], 16) is None  # no token ids to name


HELD = {"do_remote_decode": False, "do_remote_prefill": True, "remote_block_ids": [4, 5, 6, 7],
        "remote_engine_id": "decode-0", "remote_request_id": "kvbridge-hold-1-7", "remote_host": "127.0.0.1",
        "remote_port": 5601, "remote_num_tokens": 64, "remote_block_size": 16, "lease_generation": 3,
        "remote_cached_tokens": 64, "remote_prefix_tokens": 64}


@pytest.mark.parametrize("answer, want", [
    ({"held_tokens": 64, "kv_transfer_params": HELD, "can_hold": True}, (HELD, 64)),
    ({"held_tokens": 0, "kv_transfer_params": None, "can_hold": True}, None),  # evicted since its events
    ({"held_tokens": 48, "kv_transfer_params": HELD}, None),  # tokens and params disagree
    ({"held_tokens": 64, "kv_transfer_params": {**HELD, "do_remote_prefill": False}}, None),
    ({"held_tokens": True, "kv_transfer_params": HELD}, None),
    ({"held_tokens": 64, "kv_transfer_params": [HELD]}, None),
])
def test_a_holders_answer_is_used_only_when_it_is_one(answer: dict, want: object) -> None:
    assert held_params(answer) == want


def _holder(status: int, body: object, seen: list[dict]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == HOLD_PATH and request.method == "POST"
        seen.append(json.loads(request.content))
        return httpx.Response(status, json=body)
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


@pytest.mark.parametrize("status, body, want", [
    (200, {"held_tokens": 64, "kv_transfer_params": HELD, "can_hold": True}, Held(D1, HELD, 64)),
    (200, {"held_tokens": 0, "kv_transfer_params": None, "can_hold": True}, None),
    (200, {"held_tokens": 0, "kv_transfer_params": None, "can_hold": False}, False),  # a consumer-only instance
    (404, {"error": {"message": "Not Found"}}, False),  # a vLLM instance
    (503, {"error": {"message": "overloaded"}}, None),
    (200, ["not", "an", "object"], None),
])
async def test_hold_asks_with_the_prompts_ids_and_reads_the_answer(status: int, body: object, want: object) -> None:
    seen: list[dict] = []
    async with _holder(status, body, seen) as client:
        got = await hold(client, D1, IDS, {}, httpx.Timeout(5.0))
    assert got == want
    assert seen == [{"prompt_token_ids": list(IDS)}]


async def test_an_unreachable_holder_holds_nothing_this_time() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        assert await hold(client, D1, IDS, {}, httpx.Timeout(5.0)) is None


def test_what_the_serving_instance_is_sent() -> None:
    held = Held(D1, HELD, 64)
    to_p = with_held({"do_remote_decode": True}, held)  # P reads the prefix, keeps the whole prompt for D
    assert to_p == {**HELD, "do_remote_decode": True}
    assert with_held({}, held) == HELD  # D alone reads it
    assert with_held({"do_remote_decode": True}, None) == {"do_remote_decode": True}
