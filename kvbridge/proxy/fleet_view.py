"""What the router knows of each instance beyond its health: the KV blocks it holds (its KV events,
into one FleetIndex per model: kv_events/index.py), its load (GET /kvbridge/load), and, per
request, the token ids the instance will compute, so a prediction of its cached prefix is exact.

Who feeds it: the health loop (health.py) calls `refresh` for every instance its probe found
healthy: GET /kvbridge/kv_events (the events contract: endpoint, replay endpoint, topic, block
size, hash root) and GET /kvbridge/load, each bounded by the probe's timeout. A new or changed
contract (a new instance, one restarted on other ports) gets a feed: one thread per instance that
replays what the publisher kept (`catch_up`), then follows the live stream (subscriber.py). An
instance that turns unhealthy or leaves is `forget`-ed: its feed stops and its index entries go,
so a restart is rebuilt from nothing. Instances with events off, or whose contract could not be
read, are routed cold (overlap 0): the cost then weighs load alone.

Token ids: asked of an instance's POST /tokenize (vLLM's route, served by every kvbridge
instance) with the request's prompt or messages, the same defaults the instance's completions and
chat paths use (special tokens for a prompt, the chat template with its generation prompt, no
special tokens, for messages). Chosen over a tokenizer loaded in the proxy: the proxy stays free of
the model's files and of the engine's code, and the ids are the instance's own by construction
(template, special tokens, a tokenizer revision), at the price of one loopback round trip per
routed request. A prompt given as token ids needs no call; a request /tokenize cannot take (a
prompt list, an unreadable body) is routed without a prediction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbridge.kv_events.index import FleetIndex
from kvbridge.kv_events.subscriber import EventSubscriber
from kvbridge.proxy.kv_cost import Load

logger = logging.getLogger(__name__)

KV_EVENTS_PATH, LOAD_PATH, TOKENIZE_PATH = "/kvbridge/kv_events", "/kvbridge/load", "/tokenize"
FEED_POLL_S = 0.1  # how soon a feed's thread notices it must stop (plus one replay's timeout)


@dataclass(frozen=True)
class EventsContract:
    """An instance's GET /kvbridge/kv_events when its events are on."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    hash_root: bytes

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> EventsContract | None:
        """None when the instance publishes no events; ValueError when the answer is malformed."""
        if body.get("enabled") is not True:
            return None
        endpoint, replay, topic = body.get("endpoint"), body.get("replay_endpoint"), body.get("topic", "")
        block_size, root = body.get("block_size"), body.get("hash_root")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ValueError(f"endpoint must be a tcp:// address, got {endpoint!r}")
        if replay is not None and not (isinstance(replay, str) and replay.startswith("tcp://")):
            raise ValueError(f"replay_endpoint must be a tcp:// address or null, got {replay!r}")
        if not isinstance(topic, str) or type(block_size) is not int or block_size < 1:
            raise ValueError(f"topic must be a string and block_size a positive integer, got {topic!r}, {block_size!r}")
        if not isinstance(root, str):
            raise ValueError(f"hash_root must be hex, got {root!r}")
        return cls(endpoint, replay, topic, block_size, bytes.fromhex(root))


class _Feed:
    """One instance's subscriber and the thread that runs it; `close` stops and joins it."""

    def __init__(self, url: str, contract: EventsContract, index: FleetIndex) -> None:
        self.contract = contract
        self._subscriber = EventSubscriber(url, index, contract.endpoint, contract.replay_endpoint, contract.topic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-kv-events {url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._subscriber.catch_up()
            self._subscriber.run_until(self._stop, FEED_POLL_S)
        except Exception:  # a feed that dies leaves its instance to go stale: routed cold
            logger.exception("kv events feed of %s stopped", self._subscriber.instance)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._subscriber.close()


@dataclass(frozen=True)
class Prediction:
    """One request as the fleet index sees it: its prompt length, and per instance URL the prompt
    tokens that instance will find in its prefix cache (the engine recomputes at least the last
    prompt token, as kvbridge and vLLM do: whole blocks before it only)."""

    prompt_tokens: int
    cached: dict[str, int]
    token_ids: tuple[int, ...] = ()  # the prompt's, as the instances compute it (a hold names them)
    # per URL, the prompt tokens it serves without computing: `cached` and what continues it in a lower
    # KV tier (engine/kv_tier.py: loaded back, not computed); absent: `cached` alone
    reusable: dict[str, int] = field(default_factory=dict)

    def served(self, url: str) -> int:
        """The prompt tokens `url` will not compute: its prefix cache and its KV tier together."""
        return self.reusable.get(url, self.cached.get(url, 0))


class FleetView:
    """The router's fleet view (module docstring). `refresh`, `forget` and `predict` run on the
    proxy's event loop; the feeds' threads touch only the (locked) indexes."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self._stale_after_s = stale_after_s
        self._indexes: dict[tuple[bytes, int], FleetIndex] = {}
        self._feeds: dict[str, _Feed] = {}
        self._loads: dict[str, Load] = {}
        self._problems: set[tuple[str, str]] = set()  # (url, kind) logged once

    # ---- fed by the health loop -------------------------------------------------------
    async def refresh(self, client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout: float) -> None:
        """Read `url`'s events contract and load (a healthy probe just answered)."""
        events, load = await asyncio.gather(self._get(client, url + KV_EVENTS_PATH, headers, timeout),
                                            self._get(client, url + LOAD_PATH, headers, timeout))
        if load is not None:
            try:
                self._loads[url] = Load.from_json(load)
            except ValueError as exc:
                self._once(url, "load", f"{url}{LOAD_PATH}: {exc}")
        if events is None:
            return
        try:
            contract = EventsContract.from_json(events)
        except ValueError as exc:
            self._once(url, "events", f"{url}{KV_EVENTS_PATH}: {exc}: routed cold")
            contract = None
        await self._follow(url, contract)

    async def forget(self, url: str) -> None:
        """`url` turned unhealthy or left: its feed stops, its entries and load go."""
        self._loads.pop(url, None)
        feed = self._feeds.pop(url, None)
        if feed is not None:
            await asyncio.to_thread(feed.close)
            self._index(feed.contract).reset(url)

    async def close(self) -> None:
        for url in list(self._feeds):
            await self.forget(url)

    async def _follow(self, url: str, contract: EventsContract | None) -> None:
        current = self._feeds.get(url)
        if current is not None and current.contract == contract:
            self._index(contract).note_alive(url)
            return
        await self.forget(url)
        if contract is None:
            return
        try:
            self._feeds[url] = _Feed(url, contract, self._index(contract))
        except Exception as exc:  # zmq refused the endpoint: cold, asked again next round
            self._once(url, "subscribe", f"could not follow {url}'s kv events ({exc!r}): routed cold")
            return
        logger.info("following the kv events of %s (%s)", url, contract.endpoint)

    def _index(self, contract: EventsContract) -> FleetIndex:
        key = (contract.hash_root, contract.block_size)
        if key not in self._indexes:
            self._indexes[key] = FleetIndex(contract.hash_root, contract.block_size, stale_after_s=self._stale_after_s)
        return self._indexes[key]

    async def _get(self, client: httpx.AsyncClient, url: str, headers: dict[str, str],
                   timeout: float) -> dict[str, Any] | None:
        try:
            r = await client.get(url, headers=headers, timeout=timeout)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            self._once(url, "get", f"{url}: {exc!r}")
            return None
        return body if isinstance(body, dict) else None

    def _once(self, url: str, kind: str, message: str) -> None:
        if (url, kind) not in self._problems:
            self._problems.add((url, kind))
            logger.warning("%s (logged once)", message)

    # ---- read by the router -------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """Per followed instance: its index status, blocks held per group, the problems its event stream
        had so far (by kind: gaps, undecodable messages, ...), and its last load."""
        out: dict[str, dict[str, Any]] = {}
        for url, feed in self._feeds.items():
            view = self._index(feed.contract).view(url)
            load = self._loads.get(url)
            out[url] = {"status": view.status.value, "blocks": view.blocks, "last_seq": view.last_seq,
                        "problems": {kind.value: n for kind, n in sorted(view.problems.items())},
                        "load": None if load is None else dataclasses.asdict(load)}
        return out

    def load(self, url: str) -> Load | None:
        return self._loads.get(url)

    def block_size(self, url: str) -> int | None:
        feed = self._feeds.get(url)
        return None if feed is None else feed.contract.block_size

    def predict(self, token_ids: list[int], urls: list[str]) -> Prediction:
        """The prompt tokens each of `urls` holds (0 for one without a live feed); the request's
        hashes are computed once per index."""
        cached: dict[str, int] = {}
        reusable: dict[str, int] = {}
        hashes: dict[tuple[bytes, int], list[int]] = {}
        for url in urls:
            feed = self._feeds.get(url)
            if feed is None:
                cached[url] = reusable[url] = 0
                continue
            key = (feed.contract.hash_root, feed.contract.block_size)
            index = self._indexes[key]
            if key not in hashes:
                hashes[key] = index.hashes(token_ids[:max(len(token_ids) - 1, 0)])  # the last token is computed
            cached[url] = index.overlap_blocks(url, hashes[key]) * feed.contract.block_size
            reusable[url] = index.reusable_blocks(url, hashes[key]) * feed.contract.block_size
        return Prediction(len(token_ids), cached, tuple(token_ids), reusable)

    async def token_ids(self, client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any],
                        headers: dict[str, str], timeout: httpx.Timeout) -> list[int] | None:
        """The request's prompt as instance `url` will compute it, or None (module docstring)."""
        question = tokenize_question(route, body)
        if question is None or isinstance(question, list):
            return question
        try:
            r = await client.post(url + TOKENIZE_PATH, json=question, headers=headers, timeout=timeout)
            tokens = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            self._once(url, "tokenize", f"{url}{TOKENIZE_PATH}: {exc!r}")
            return None
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            return None
        return tokens


def tokenize_question(route: str, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """The /tokenize body for a completions or chat request, the prompt itself when it is token
    ids, or None when the request cannot be predicted (a prompt list, a malformed body: the
    instance answers those itself)."""
    model = body.get("model")
    if route.endswith("/chat/completions"):
        messages = body.get("messages")
        return {"model": model, "messages": messages} if isinstance(messages, list) else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None
