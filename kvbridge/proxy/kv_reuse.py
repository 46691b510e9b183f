"""KV reuse across turns and instances, the proxy's half: before a request is sent, the instance of
the fleet holding the longest cached prefix of its prompt (the fleet index's prediction: typically
the D that answered the conversation's last turn, whose prefix cache holds that turn's prompt and
answer) is asked to hold it (`POST /kvbridge/kv_hold`), and the instance serving the request reads it
from there instead of computing it again: P, which then prefills only the new tokens for D (and D
reads from P only the blocks it lacks), or a D serving the request alone.

The holder's answer is kv_transfer_params with `remote_prefix_tokens` (kv_transfer/params.py); the
proxy adds them to what it sends P (beside `do_remote_decode`) or D. The holder keeps the blocks
under a lease until the reader is done; a reader that finds the prefix in its own cache, rejects the
request or aborts it releases the hold itself (the same notices as for P's KV), the proxy releases a
hold nobody received, and the lease's expiry bounds the rest. A failed read is recomputed by the
reader whatever its load-failure policy: a held prefix only saves work.

Asked only when the holder has at least a block more than every instance the request may go to
(`better_holder`): a hold costs one loopback round trip and a read, against computing the prefix on
a CPU at hundreds to thousands of tokens a second. An instance that cannot hold (a vLLM instance:
404; a consumer-only kvbridge instance: nothing held) is not asked again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from kvbridge.proxy.fleet_view import Prediction

logger = logging.getLogger(__name__)

HOLD_PATH = "/kvbridge/kv_hold"
# How long a hold may take: it waits for the holder's current step and saves at most a prefill, so a
# holder slower than this is passed over for the request (the hold, if it lands later, expires).
HOLD_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Held:
    """A prefix held for this request: where, its reader's params (wire JSON) and its tokens."""

    url: str
    params: dict[str, object]
    tokens: int


def better_holder(prediction: Prediction | None, targets: Sequence[str], min_gain_tokens: int,
                  cannot_hold: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The instance holding the longest cached prefix of the request, when it holds at least
    `min_gain_tokens` more than every one of `targets` (where the request may be sent); None otherwise.
    Instances known not to hold (`cannot_hold`) are never chosen."""
    if prediction is None or not prediction.token_ids or not targets:
        return None
    candidates = [(n, url) for url, n in prediction.cached.items() if url not in cannot_hold and n > 0]
    if not candidates:
        return None
    best_tokens, best = max(candidates)
    target_best = max(prediction.cached.get(u, 0) for u in targets)
    return best if best_tokens >= target_best + min_gain_tokens else None


def held_params(answer: Mapping[str, object]) -> tuple[dict[str, object], int] | None:
    """The params and token count of a holder's answer, or None when it held nothing or the
    answer is not what a kvbridge instance answers."""
    params, tokens = answer.get("kv_transfer_params"), answer.get("held_tokens")
    if not isinstance(params, dict) or type(tokens) is not int or tokens <= 0:
        return None
    if params.get("do_remote_prefill") is not True or params.get("remote_prefix_tokens") != tokens:
        return None
    return params, tokens


async def hold(client: httpx.AsyncClient, url: str, token_ids: Sequence[int], headers: dict[str, str],
               timeout: httpx.Timeout) -> Held | None | Literal[False]:
    """Ask `url` to hold the longest cached prefix of `token_ids`. Returns what it holds, None when
    it held nothing this time (evicted since its events said otherwise, draining, unreachable), or
    False when it cannot hold at all (no such route, or a kvbridge instance that serves no reads)."""
    try:
        r = await client.post(url + HOLD_PATH, json={"prompt_token_ids": list(token_ids)}, headers=headers,
                              timeout=timeout)
    except httpx.HTTPError as exc:
        logger.info("hold on %s failed: %r", url, exc)
        return None
    if r.status_code in (404, 405):
        return False
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code == 200 and isinstance(answer, dict) and answer.get("can_hold") is False:
        return False
    if r.status_code != 200:
        logger.info("hold on %s answered %d: %s", url, r.status_code, r.text[:200])
        return None
    got = held_params(answer) if isinstance(answer, dict) else None
    return Held(url, got[0], got[1]) if got is not None else None


def with_held(params: Mapping[str, object], held: Held | None) -> dict[str, object]:
    """`params` (P's {"do_remote_decode": true}, or none for a D alone) plus the held prefix's."""
    if held is None:
        return dict(params)
    return {**held.params, **params}
