"""Running requests through an LLMEngine to their end, step by step, in a test: their outputs by
request id. Not collected (no test in it); the integration modules that drive an engine directly
share it."""

from __future__ import annotations

from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.pacing import Pacer
from kvbridge.engine.sampling_params import SamplingParams


def run_to_end(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
               | dict[str, tuple[list[int], SamplingParams, str | None]]) -> dict[str, list[RequestOutput]]:
    """Add each request (id -> prompt ids, params and optionally the request whose prompt blocks it
    shares: LLMEngine.add_request's share_prompt_with), in order, and step until none is unfinished."""
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (ids, params, *leader) in requests.items():
        engine.add_request(rid, ids, params, share_prompt_with=leader[0] if leader else None)
    pacer = Pacer()
    while engine.has_unfinished_requests():
        step = engine.step()
        for out in step.outputs:
            outputs[out.request_id].append(out)
        pacer.sleep_after(step.next_step)
    return outputs
