"""The tests' one fleet builder: `kvbridge serve` and `kvbridge proxy` processes on loopback,
started through the product's own launcher (kvbridge/launcher/cluster.py: its command lines,
child environment, log files and stop order), described by a spec.

- `FleetSpec`: the model, the KV backend and the members (name -> `Member`: KV role or none, TP
  size, extra `kvbridge serve` arguments). Frozen and hashable: it is the key fleets are shared by.
- `Fleet`: the started members, plus what a test adds (proxies between pairs, a process of its
  own, an instance adopted from elsewhere); `stop()` ends every process it started.
- `Fleets` (the session fixture `fleets`, tests/conftest.py): `shared(spec)` hands every test that
  asks the same started fleet, restarted if a member died; `own(spec)` a fleet for one test that
  breaks it (kills a member), stopped after that test. Shared fleets are stopped when the session
  ends, or when another spec is asked for (`MAX_IDLE`), so a 2-core, 24 GiB machine holds a few
  engines at a time; `retire(fleet)` stops one a test broke on purpose.

A test that kills or breaks a member uses `own`, or retires the shared fleet it broke.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI

from kvbridge.config import CacheConfig, EngineConfig, KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import (DEFAULT_CLI, ChildProcess, InstanceSpec, child_env, free_ports, http_url,
                                      proxy_command, serve_command, spawn_child, stop_children)
from tests.e2e.processes import metric

SMOLLM2 = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = ["Hello there",  # less than one block
           "The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
           "of Constantinople. Summarise its three most important turning points:"]  # several blocks
SHORT = "Hello there"  # fewer tokens than one block
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city "
        "to the fall of Constantinople. Summarise its three most important turning points, "
        "with a date for each:")  # several blocks
# A small KV cache and context, fp32 (the references below are fp32 engines: greedy text compares exactly)
BASE_ARGS = ("--num-blocks", "64", "--max-model-len", "512", "--dtype", "float32")
START_S = 300.0
MAX_IDLE = 1  # shared fleets kept started while another spec is in use


@dataclass(frozen=True)
class Member:
    """One `kvbridge serve` of the fleet's model: a KV role (None: no KV transfer, colocated), its
    TP size, and arguments after the fleet's base ones."""

    role: KVRole | None
    tp: int = 1
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class FleetSpec:
    model: str
    backend: str = "nixl"
    members: tuple[tuple[str, Member], ...] = ()
    base_args: tuple[str, ...] = BASE_ARGS
    num_threads: int = 1
    env: tuple[tuple[str, str], ...] = ()  # added to the children's environment

    @classmethod
    def of(cls, model: str, backend: str, members: dict[str, Member], **options) -> FleetSpec:
        return cls(model, backend, tuple(members.items()), **options)


class Fleet:
    """The members of a spec, started together and healthy; proxies and other processes added on demand."""

    def __init__(self, spec: FleetSpec, log_dir: Path) -> None:
        self.spec, self.log_dir = spec, log_dir
        self.env = child_env({**os.environ, **dict(spec.env)}, loopback_only=True, num_threads=spec.num_threads)
        self.children: list[ChildProcess] = []
        self.urls: dict[str, str] = {}
        self.members = dict(spec.members)
        self.side_channel_ports: dict[str, int] = {}
        self.adopted: set[str] = set()  # instances this fleet did not start (a shared cluster's)
        self.expired_leases: dict[str, float] = {}  # name -> its expired leases before the test
        try:
            for name, member in spec.members:
                self.add(name, member, wait=False)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def served(self) -> str:
        """The model name the instances answer to (a folder's name for a model folder)."""
        return Path(self.spec.model).name

    def add(self, name: str, member: Member, port: int | None = None, side_channel_port: int | None = None,
            wait: bool = True) -> str:
        """Start one more instance of the fleet's model (on given ports: a restart at the same address)."""
        port = port or free_ports(1)[0]
        if member.role is None:
            argv = [*DEFAULT_CLI, "serve", self.spec.model, "--host", "127.0.0.1", "--port", str(port),
                    "--num-threads", str(self.spec.num_threads), "--tensor-parallel-size", str(member.tp)]
        else:
            side_channel_port = side_channel_port or free_ports(1)[0]
            self.side_channel_ports[name] = side_channel_port
            spec = InstanceSpec(name, member.role, port, side_channel_port, f"{name}-{os.getpid()}-{port}", member.tp)
            argv = serve_command(DEFAULT_CLI, self.spec.model, spec, host="127.0.0.1", kv_backend=self.spec.backend,
                                 num_threads=self.spec.num_threads)
        self.members[name] = member
        self.spawn(name, [*argv, *self.spec.base_args, *member.args], http_url("127.0.0.1", port), wait=wait)
        return self.urls[name]

    def spawn(self, name: str, argv: list[str], url: str, wait: bool = True) -> None:
        """A process of the test's own (`url`: where it answers /health), stopped with the fleet."""
        self.children.append(spawn_child(name, argv, self.env, self.log_dir))
        self.urls[name] = url
        if wait:
            self.wait_healthy([name])

    def proxy(self, prefill: str, decode: str, *extra: str) -> str:
        """A `kvbridge proxy` between two members (started on first use)."""
        name = f"proxy-{prefill}-{decode}"
        if name not in self.urls:
            port = free_ports(1)[0]
            self.spawn(name, proxy_command(DEFAULT_CLI, [self.urls[prefill]], [self.urls[decode]], host="127.0.0.1",
                                           port=port, extra_args=extra), http_url("127.0.0.1", port))
        return self.urls[name]

    def adopt(self, name: str, url: str) -> None:
        """Name an instance this fleet did not start (one of the session's shared cluster's)."""
        self.urls[name] = url
        self.adopted.add(name)

    def note_expired_leases(self) -> None:
        """Before a test: every P/D instance's expired leases so far (earlier tests' own)."""
        names = [*(n for n, m in self.members.items() if m.role is not None), *self.adopted]
        self.expired_leases = {n: metric(self.urls[n], "kvbridge_kv_expired_leases_total") for n in names}

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.children if c.name == name)

    def forget(self, name: str) -> ChildProcess:
        """Drop a (dead) process from the fleet: its name can be started again."""
        child = self.child(name)
        self.children.remove(child)
        return child

    def first_dead(self) -> str | None:
        return next((c.name for c in self.children if not c.alive()), None)

    def wait_healthy(self, names: list[str] | None = None, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5, trust_env=False) as client:
            for child in self.children if names is None else map(self.child, names):
                while True:
                    assert child.alive(), f"{child.name} exited:\n{child.tail()}"
                    try:
                        if client.get(self.urls[child.name] + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, f"{child.name} not healthy:\n{child.tail()}"
                    time.sleep(0.2)

    def stop(self) -> None:
        stop_children(self.children)


@dataclass
class Fleets:
    """The session's fleets by spec (see the module's docstring)."""

    log_root: Path
    idle: OrderedDict[FleetSpec, Fleet] = field(default_factory=OrderedDict)
    starts: int = 0

    def _log_dir(self, spec: FleetSpec, shared: bool) -> Path:
        self.starts += 1
        if os.environ.get("KVBRIDGE_MODULE_TIMES"):  # the suite's profile (tests/conftest.py): each start
            import json
            with open(os.environ["KVBRIDGE_MODULE_TIMES"], "a") as f:
                f.write(json.dumps({"fleet_start": repr(spec), "shared": shared,
                                    "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")
        path = self.log_root / f"fleet-{self.starts}"
        path.mkdir(parents=True)
        return path

    def shared(self, spec: FleetSpec) -> Fleet:
        fleet = self.idle.pop(spec, None)
        if fleet is not None and fleet.first_dead() is not None:
            fleet.stop()  # a test broke it (and failed for it): a new one, so the next tests do not
            fleet = None
        while len(self.idle) >= MAX_IDLE:
            self.idle.popitem(last=False)[1].stop()
        if fleet is None:
            fleet = Fleet(spec, self._log_dir(spec, True))
        self.idle[spec] = fleet
        return fleet

    def retire(self, fleet: Fleet) -> None:
        """Stop a shared fleet a test broke on purpose: the next `shared` of its spec starts a new one."""
        if self.idle.get(fleet.spec) is fleet:
            del self.idle[fleet.spec]
        fleet.stop()

    def own(self, spec: FleetSpec) -> Fleet:
        """A fleet for the caller alone; the caller stops it."""
        return Fleet(spec, self._log_dir(spec, False))

    def close(self) -> None:
        while self.idle:
            self.idle.popitem()[1].stop()


def assert_settled(fleet: Fleet, names: list[str], timeout_s: float = 15.0) -> None:
    """Every block free on every instance named, and no lease expired on any of them since
    `note_expired_leases` (or ever, without it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {n: (metric(fleet.urls[n], "kvbridge_kv_cache_free_blocks"),
                     metric(fleet.urls[n], "kvbridge_kv_cache_total_blocks")) for n in names}
        if all(free == total for free, total in state.values()):
            break
        assert time.monotonic() < deadline, f"KV blocks still allocated: {state}"
        time.sleep(0.1)
    for n in names:
        assert metric(fleet.urls[n], "kvbridge_kv_expired_leases_total") == fleet.expired_leases.get(n, 0), n


def complete(url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


class Reference:
    """One colocated TP 1 engine of the model, in this process: the answers P/D must give."""

    def __init__(self, model: str) -> None:
        self.loaded = load_model(model)
        self.engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), num_threads=1), self.loaded)

    def __call__(self, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        tok = self.loaded.tokenizer
        return tok.decode(self.engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=max_tokens,
                                                                                    temperature=0))[0])
