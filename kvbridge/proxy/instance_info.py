"""What the proxy asks an instance about itself, outside a request's legs: its context length
(the first-token path needs it for a chat without max_tokens; proxy.py asks once per P)."""

from __future__ import annotations

import logging

import httpx

from kvbridge.proxy.routing import Upstream

logger = logging.getLogger("kvbridge.proxy.proxy")  # the name these lines logged under before the split


async def ask_context_len(client: httpx.AsyncClient, upstream: Upstream, headers: dict[str, str],
                          timeout: httpx.Timeout) -> int | None:
    """`upstream`'s max_model_len from its /v1/models (kvbridge's and vLLM's cards name it); 0
    when its answer does not say, None when it could not be asked (asked again next time)."""
    try:
        r = await client.get(upstream.url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        logger.warning("could not ask %s for its context length: %r", upstream.url, exc)
        return None
    try:
        context_len = r.json()["data"][0]["max_model_len"]
    except (ValueError, KeyError, IndexError, TypeError):
        context_len = None
    if type(context_len) is not int or context_len < 1:
        logger.warning("%s named no context length on /v1/models: streamed chat requests without max_tokens "
                       "take the ordinary P/D path", upstream.url)
        return 0
    return context_len
