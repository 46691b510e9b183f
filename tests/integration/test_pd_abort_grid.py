"""Every event at every phase of a P/D request's life (issue 27), explored exhaustively.

pd_explorer.py drives one request through P and D step by step and injects an event at a
phase boundary; each run then checks the invariants (no engine raised, every block back in its
pool on P and D, no lease expired unless the event made it, no output after an abort, every
request not aborted answers what the colocated engine answers). The grid: dense attention,
MLA and a hybrid Mamba model, every phase x every event that can happen there, and D
continuing from P's first token where the model allows it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, TINY_BAMBA, TINY_DEEPSEEK_V2_MOE, write_synthetic_folder
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from kvbridge.kv_transfer.backends.fake import FaultConfig
from tests.integration.pd_explorer import D_PHASES, Event, Phase, applies, check, explore, inject
from tests.integration.pd_world import SAMPLING, ModelCase, Track, World
from tests.integration.pd_harness import make_engine

PROMPT = ("Once upon a time in a small village by the sea there lived an old fisherman who told the children "
          "stories about the storms he had seen and the ships he had saved")
FILLER = "A completely different prompt about mountains, rivers, and the trains that cross the valleys at night."


VOCAB = 1024  # the synthetic models' vocabulary: a small LM head keeps the grid's ~600 engine pairs cheap to build


def _ids(tok, text: str) -> list[int]:
    """The text's token ids folded into the small vocabulary (clear of the special ids 0-2)."""
    return [3 + t % (VOCAB - 3) for t in tok.encode(text)]


def _case(tmp_path_factory, name: str, architecture: str, geometry: dict, block_size: int,
          continued_ok: bool = True, p_num_blocks: int = 4) -> ModelCase:
    tok = load_model("SmolLM2-135M-Instruct").tokenizer
    folder = tmp_path_factory.mktemp("models") / name
    write_synthetic_folder(folder, tok, architecture=architecture, **{**geometry, "vocab_size": VOCAB})
    model = load_model(str(folder))
    colocated = make_engine(model, None, block_size=block_size, num_blocks=64)
    memo: dict[tuple[int, ...], list[int]] = {}

    def want(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            memo[key] = colocated.generate([prompt], SAMPLING)[0]
        return memo[key]
    return ModelCase(name, model, block_size, want, _ids(tok, PROMPT), _ids(tok, FILLER), continued_ok, p_num_blocks)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    dense = _case(tmp_path_factory, "tiny-llama", "llama", TINY_4_KV_HEADS, 16)
    mla = _case(tmp_path_factory, "tiny-deepseek", "deepseek_v2", TINY_DEEPSEEK_V2_MOE, 16)
    return {"dense": dense, "mla": mla,
            "hybrid": _case(tmp_path_factory, "tiny-bamba", "bamba", TINY_BAMBA, 4, continued_ok=False,
                            p_num_blocks=6),
            # D of TP 2 (each rank its 2 of the 4 KV heads; with MLA each rank the whole latent, read
            # by each rank from P): only D's phases differ from TP 1, and a read done on one rank only.
            "dense-tp2": dataclasses.replace(dense, d_tp=2), "mla-tp2": dataclasses.replace(mla, d_tp=2)}


def grid(case: ModelCase) -> list[tuple[Phase, Event, bool]]:
    phases = [ph for ph in (D_PHASES if case.d_tp > 1 else Phase) if ph is not Phase.READ_PARTIAL or case.d_tp > 1]
    runs = [(ph, ev, False) for ph in phases for ev in Event if applies(ev, ph)]
    if case.continued_ok:
        runs += [(ph, ev, True) for ph in phases if ph in D_PHASES for ev in Event if applies(ev, ph)]
    return runs


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid", "dense-tp2", "mla-tp2"])
def test_every_event_at_every_phase(cases, name):
    case = cases[name]
    runs = grid(case)
    failures = []
    for phase, event, continued in runs:
        problems = explore(case, phase, event, continued)
        if problems:
            failures.append(f"[{phase.value} x {event.value}{' (continued)' if continued else ''}]\n  "
                            + "\n  ".join(problems))
    print(f"\n{name}: explored {len(runs)} runs ({len(Phase)} phases x {len(Event)} events, "
          f"the pairs that can happen{', plain and continued from P' if case.continued_ok else ''})")
    assert not failures, f"{len(failures)} of {len(runs)} runs broke an invariant:\n" + "\n".join(failures)


def test_random_interleavings_of_several_requests(cases):
    """Beyond the grid: several requests at once, their steps, client departures, faults, held
    messages, held reads and passing time interleaved at random (hypothesis, derandomized: the
    same runs every time), on D of TP 1 and of TP 2. Each run ends as a proxy would end it (every
    answered prefill sent to D, every engine stepped until idle) and checks the grid's invariants."""
    seen: Counter[str] = Counter()

    class Interleavings(RuleBasedStateMachine):
        world: World | None = None

        @initialize(tp2=st.booleans())
        def start(self, tp2: bool) -> None:
            self.world = World(dataclasses.replace(cases["dense"], d_tp=2 if tp2 else 1))

        @rule(which=st.sampled_from(["prompt", "prompt", "filler"]), continued=st.booleans())
        def new_request(self, which: str, continued: bool) -> None:
            w = self.world
            if sum(not t.abandoned for t in w.tracks) < 4:
                w.add_to_p(w.new_track(w.case.prompt if which == "prompt" else w.case.filler, continued))

        @rule(n=st.integers(1, 4), engine=st.sampled_from(["p", "d"]))
        def step(self, n: int, engine: str) -> None:
            for _ in range(n):
                (self.world.step_p if engine == "p" else self.world.step_d)()

        @rule(data=st.data())
        def send_to_d(self, data) -> None:
            ready = _answered(self.world)
            if ready:
                self.world.add_to_d(data.draw(st.sampled_from(ready)))

        @rule(data=st.data(), event=st.sampled_from([Event.ABORT_D, Event.ABORT_P]))
        def client_leaves(self, data, event: Event) -> None:
            live = [t for t in self.world.tracks if not t.abandoned and not t.d_done]
            live = [t for t in live if t.on_d] if event is Event.ABORT_D else [t for t in live if not t.on_d]
            if live:
                seen["departures"] += 1
                inject(self.world, data.draw(st.sampled_from(live)), event, Phase.D_ADMITTED)

        @rule(kind=st.sampled_from(["handshake", "check"]), held=st.booleans())
        def gate(self, kind: str, held: bool) -> None:
            (self.world.gate.hold if held else self.world.gate.open)(kind)

        @rule(held=st.booleans(), rank=st.integers(0, 1))
        def hold_reads(self, held: bool, rank: int) -> None:
            self.world.hold_reads(held, slice(rank, rank + 1))

        @rule()
        def reads_fail(self) -> None:
            seen["read faults"] += 1
            self.world.faulted = True
            agent = self.world.d_agents()[-1]
            agent.set_faults(FaultConfig(hold_reads=agent.faults.hold_reads, error_state=True,
                                         raise_on_check_state=True))

        @rule(seconds=st.sampled_from([5.0, 25.0, 61.0]))
        def time_passes(self, seconds: float) -> None:
            w = self.world
            w.faulted = w.expiry_expected = True  # leases may expire; D then recomputes
            w.clock.advance(seconds)

        def teardown(self) -> None:
            w = self.world
            if w is None:
                return
            try:
                w.gate.open_all()
                w.lift_read_hold()

                def proxy_step() -> None:  # the proxy sends each answered prefill on to D
                    for t in _answered(w):
                        w.add_to_d(t)
                    w.step_both()
                w.until(lambda: all(t.abandoned or t.d_done or (t.p_done and not t.params) or t.filler and t.p_done
                                    for t in w.tracks), "every request ends", proxy_step)
                w.settle()
                problems = check(w)
                seen["runs"] += 1
                seen["requests"] += len(w.tracks)
                assert not problems, "\n".join(problems)
            finally:
                w.shutdown()

    run_state_machine_as_test(Interleavings, settings=settings(
        max_examples=40, stateful_step_count=40, derandomize=True, deadline=None,
        suppress_health_check=list(HealthCheck), database=None))
    print(f"\nrandom interleavings: {seen['runs']} runs, {seen['requests']} requests, "
          f"{seen['departures']} client departures, {seen['read faults']} read-fault injections")
    assert seen["runs"] >= 40 and seen["departures"] > 0 and seen["read faults"] > 0


def _answered(w: World) -> list[Track]:
    """Requests P answered that no D has yet (the proxy sends each on)."""
    return [t for t in w.tracks if t.p_done and t.params and not t.on_d and not t.abandoned and not t.filler]
