"""One request's bad bookkeeping fails that request, not the engine (issue 27, part 3).

The per-request output stage of a step (detokenising, stop strings, building the output) is
made to raise for one request: that request finishes with an error output (code
request_output_failed: HTTP 500 or an error event), the others in the same batch finish as a
colocated engine answers them, the engine keeps serving, and every block is back in its pool. On
P, a request that failed there after its lease was granted has the lease released at once (its
answer, which names the blocks, never leaves P, so no reader could ever end it)."""

from __future__ import annotations

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.outputs import REQUEST_OUTPUT_FAILED
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.pd_harness import make_engine, settle

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    write_synthetic_folder(folder, load_model("SmolLM2-135M-Instruct").tokenizer, **TINY_4_KV_HEADS)
    return load_model(str(folder))


def prompts(model) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.encode(t) for t in ("The first request of the batch", "A second one, served beside it",
                                    "And a third that goes on too")]


def break_output_stage(engine, request_id: str, after_tokens: int = 0) -> None:
    """The output stage raises for `request_id` once it has `after_tokens` output tokens."""
    real = engine.output_processor.detokenize

    def detokenize(req):
        if req.request_id == request_id and req.num_output_tokens > after_tokens:
            raise KeyError(f"injected: no stream state for {request_id}")
        return real(req)
    engine.output_processor.detokenize = detokenize


def run(engine, ids: list[str]) -> dict[str, list]:
    outs: dict[str, list] = {rid: [] for rid in ids}
    for _ in range(200):
        if all(outs[rid] and outs[rid][-1].finished for rid in ids):
            break
        for out in engine.step().outputs:
            outs[out.request_id].append(out)
    return outs


@pytest.mark.parametrize("after_tokens", [0, 3])
def test_a_failing_output_stage_fails_only_its_request(model, after_tokens):
    ps = prompts(model)
    want = make_engine(model, None).generate(ps, GREEDY)
    engine = make_engine(model, None)
    ids = ["a", "bad", "c"]
    for rid, p in zip(ids, ps):
        engine.add_request(rid, p, GREEDY)
    break_output_stage(engine, "bad", after_tokens)
    outs = run(engine, ids)
    bad = outs["bad"][-1]
    assert bad.finished and bad.finish_reason is FinishReason.ERROR and bad.error_code == REQUEST_OUTPUT_FAILED
    assert "KeyError" in bad.error
    assert sum(o.finished for o in outs["bad"]) == 1  # one final output, nothing after it
    for rid, w in zip(ids, want):
        if rid != "bad":
            assert [t for o in outs[rid] for t in o.new_token_ids] == w
    m = engine.metrics()
    assert m.num_running == m.num_waiting == 0 and m.num_free_blocks == m.num_total_blocks
    assert engine.generate([ps[0]], GREEDY) == [want[0]]  # the engine serves on


def test_p_releases_the_lease_of_a_request_whose_answer_failed(model):
    fabric = FakeFabric()
    p = make_engine(model, KVRole.PRODUCER, fabric.create_agent("p"))
    try:
        prompt = prompts(model)[0]
        p.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0),
                      parse_kv_transfer_params({"do_remote_decode": True}))
        break_output_stage(p, "r")
        outs = run(p, ["r"])
        assert outs["r"][-1].finish_reason is FinishReason.ERROR and outs["r"][-1].kv_transfer_params is None
        settle(p)
        stats = p.connectors.worker.stats
        assert len(p.connectors.worker.leases) == 0 and stats.expired_leases == 0
        assert p.metrics().num_free_blocks == p.metrics().num_total_blocks
    finally:
        p.shutdown()
