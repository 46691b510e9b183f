"""Every event at every phase of a P/D request's life (issue 27), explored exhaustively.

pd_explorer.py drives one request through P and D step by step and injects an event at a
phase boundary; each run then checks the invariants (no engine raised, every block back in its
pool on P and D, no lease expired unless the event made it, no output after an abort, every
request not aborted answers what the colocated engine answers). The grid: dense attention,
MLA and a hybrid Mamba model, every phase x every event that can happen there, and D
continuing from P's first token where the model allows it.
"""

from __future__ import annotations

import pytest

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, TINY_BAMBA, TINY_DEEPSEEK_V2_MOE, write_synthetic_folder
from tests.integration.pd_explorer import D_PHASES, Event, ModelCase, Phase, SAMPLING, applies, explore
from tests.integration.pd_harness import make_engine

PROMPT = ("Once upon a time in a small village by the sea there lived an old fisherman who told the children "
          "stories about the storms he had seen and the ships he had saved")
FILLER = "A completely different prompt about mountains, rivers, and the trains that cross the valleys at night."


def _case(tmp_path_factory, name: str, architecture: str, geometry: dict, block_size: int,
          continued_ok: bool = True, p_num_blocks: int = 4) -> ModelCase:
    tok = load_model("SmolLM2-135M-Instruct").tokenizer
    folder = tmp_path_factory.mktemp("models") / name
    write_synthetic_folder(folder, tok, architecture=architecture, **geometry)
    model = load_model(str(folder))
    colocated = make_engine(model, None, block_size=block_size, num_blocks=64)
    memo: dict[tuple[int, ...], list[int]] = {}

    def want(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            memo[key] = colocated.generate([prompt], SAMPLING)[0]
        return memo[key]
    return ModelCase(name, model, block_size, want, tok.encode(PROMPT), tok.encode(FILLER), continued_ok, p_num_blocks)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {"dense": _case(tmp_path_factory, "tiny-llama", "llama", TINY_4_KV_HEADS, 16),
            "mla": _case(tmp_path_factory, "tiny-deepseek", "deepseek_v2", TINY_DEEPSEEK_V2_MOE, 16),
            "hybrid": _case(tmp_path_factory, "tiny-bamba", "bamba", TINY_BAMBA, 4, continued_ok=False,
                            p_num_blocks=6)}


def grid(case: ModelCase) -> list[tuple[Phase, Event, bool]]:
    runs = [(ph, ev, False) for ph in Phase for ev in Event if applies(ev, ph)]
    if case.continued_ok:
        runs += [(ph, ev, True) for ph in D_PHASES for ev in Event if applies(ev, ph)]
    return runs


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid"])
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
