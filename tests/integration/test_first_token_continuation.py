"""A decode engine continues from the token its prefill engine sampled (first token straight
from prefill): in-process P and D engines on the real default model, the fake transfer
backend (real copies) and the real side channel.

- greedy and seeded outputs equal one engine's (P's token, then D's);
- a stop string that spans P's token and D's first is found, and the text streamed after
  P's token is exactly the rest of one engine's stream;
- a continuation from another token than P's is refused by P (content mismatch) and D
  recomputes it; params swapped between two continued requests (the chaos run's fault) are
  refused and each request still continues from its own token; P's params alone (no
  `continued`) keep the ordinary behaviour.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire
from kvbridge.stop_strings import stop_holdback
from tests.integration.pd_harness import decode, make_engine, settle, tokens

_ids = itertools.count()
PROMPTS = ["Tell me about the history of Rome, its emperors and its roads.", "Hi"]


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def colocated(loaded):
    engine = make_engine(loaded, None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pd(loaded):
    fabric = FakeFabric(seed=1)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D")
    yield p, d
    settle(p, d)
    p.shutdown()
    d.shutdown()


def prompt_of(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def prefill_one(p, prompt: list[int], sp: SamplingParams) -> tuple[dict, list[int], str]:
    """P's half with the client's sampling, one token: its params, its tokens and its text."""
    rid = f"p-{next(_ids)}"
    one = dataclasses.replace(sp, max_tokens=1)
    p.add_request(rid, prompt, one, parse_kv_transfer_params({"do_remote_decode": True}))
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in p.step().outputs if o.request_id == rid]
    return to_wire(outs[-1].kv_transfer_params), tokens(outs), "".join(o.new_text for o in outs)


def continue_on_d(p, d, prompt, params: dict, sp: SamplingParams, continued: list[int] | None = None):
    """D's half, continuing from `continued` (default: the tokens P named), stepping P too."""
    rid = f"d-{next(_ids)}"
    d.add_request(rid, prompt, sp, parse_kv_transfer_params(params),
                  continued=params["generated_token_ids"] if continued is None else continued)
    outs = []
    deadline = time.monotonic() + 60
    while not (outs and outs[-1].finished):
        assert time.monotonic() < deadline, "D did not finish"
        outs += [o for o in d.step().outputs if o.request_id == rid]
        p.step()
    return outs


def colocated_run(engine, prompt, sp: SamplingParams):
    rid = f"c-{next(_ids)}"
    engine.add_request(rid, prompt, sp)
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    return outs


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=12, temperature=0),
                                SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_d_continuing_from_p_s_token_equals_one_engine(loaded, colocated, pd, sp):
    p, d = pd
    for text in PROMPTS:
        prompt = prompt_of(loaded, text)
        want = colocated_run(colocated, prompt, sp)
        params, first, first_text = prefill_one(p, prompt, sp)
        assert params["generated_token_ids"] == first and len(first) == 1
        outs = continue_on_d(p, d, prompt, params, sp)
        assert first + tokens(outs) == tokens(want)
        last = outs[-1]
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), len(tokens(want)))
        # What the proxy streams for P's token, then D's text: one engine's stream.
        sent = "" if first_text.endswith("\ufffd") else first_text[:len(first_text) - stop_holdback(first_text, sp.stop)]
        assert sent + "".join(o.new_text for o in outs) == "".join(o.new_text for o in want)
        settle(p, d)
        assert p.metrics().num_held_for_remote == 0


def test_a_stop_string_spanning_p_s_token_and_d_s_first_is_found(loaded, colocated, pd):
    p, d = pd
    prompt = prompt_of(loaded, PROMPTS[0])
    greedy = SamplingParams(max_tokens=12, temperature=0)
    out = colocated_run(colocated, prompt, greedy)
    first_text = out[0].new_text if out[0].new_text else "".join(o.new_text for o in out[:2])
    full = "".join(o.new_text for o in out)
    stop = full[len(first_text) - 1:len(first_text) + 2]  # last char of P's token + D's next two
    sp = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    want = colocated_run(colocated, prompt, sp)
    params, _, p_text = prefill_one(p, prompt, sp)
    outs = continue_on_d(p, d, prompt, params, sp)
    sent = p_text[:len(p_text) - stop_holdback(p_text, sp.stop)]
    assert sent + "".join(o.new_text for o in outs) == "".join(o.new_text for o in want) == full[:full.index(stop)]
    assert outs[-1].finish_reason == want[-1].finish_reason


def test_a_continuation_from_another_token_is_refused_by_p_and_recomputed(loaded, colocated, pd):
    p, d = pd
    prompt = prompt_of(loaded, "Name three rivers of Europe and the seas they flow into.")
    greedy = SamplingParams(max_tokens=6, temperature=0)
    params, first, _ = prefill_one(p, prompt, greedy)
    forged = (first[0] + 1) % loaded.arch.vocab_size
    before = p.connectors.worker.stats.content_mismatches
    outs = continue_on_d(p, d, prompt, params, greedy, continued=[forged])
    assert p.connectors.worker.stats.content_mismatches == before + 1
    # D recomputed prompt + the forged token itself: a correct continuation of what it was given.
    want = colocated.generate([prompt + [forged]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert tokens(outs) == want
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0


def test_swapped_params_are_refused_and_each_request_continues_from_its_own_token(loaded, colocated, pd):
    p, d = pd
    greedy = SamplingParams(max_tokens=6, temperature=0)
    a, b = (prompt_of(loaded, t) for t in ("Why is the sky blue? Explain it simply.",
                                           "Write two lines about a cat on a warm windowsill."))
    params_a, first_a, _ = prefill_one(p, a, greedy)
    params_b, first_b, _ = prefill_one(p, b, greedy)
    before = p.connectors.worker.stats.content_mismatches
    # A's prompt and token with B's params, and B's with A's: P holds neither sequence there.
    outs_a = continue_on_d(p, d, a, params_b, greedy, continued=first_a)
    outs_b = continue_on_d(p, d, b, params_a, greedy, continued=first_b)
    assert p.connectors.worker.stats.content_mismatches == before + 2
    assert first_a + tokens(outs_a) == colocated.generate([a], greedy)[0]
    assert first_b + tokens(outs_b) == colocated.generate([b], greedy)[0]
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0


def test_p_s_params_alone_are_an_ordinary_remote_prefill(loaded, colocated, pd):
    p, d = pd
    prompt = prompt_of(loaded, "What is the capital of France and why?")
    greedy = SamplingParams(max_tokens=6, temperature=0)
    params, first, _ = prefill_one(p, prompt, greedy)
    assert params["generated_token_ids"] == first  # P offers it; a router that forwards it unchanged...
    outs = decode(d, p, prompt, params, greedy)
    assert tokens(outs) == colocated.generate([prompt], greedy)[0]  # ...gets one engine's whole answer
    settle(p, d)


def test_a_stop_string_completed_by_the_last_allowed_token_is_the_finish_reason(loaded, colocated):
    """P answers one token: if that token completes a stop string, P's finish reason must say
    so ("stop", not "length"), or the proxy would send the request on to D."""
    prompt = prompt_of(loaded, PROMPTS[0])
    first = colocated_run(colocated, prompt, SamplingParams(max_tokens=1, temperature=0))
    text = "".join(o.new_text for o in first).strip()
    assert text and first[-1].finish_reason.value == "length"
    stopped = colocated_run(colocated, prompt, SamplingParams(max_tokens=1, temperature=0, stop=(text,)))
    assert stopped[-1].finish_reason.value == "stop" and text not in "".join(o.new_text for o in stopped)
