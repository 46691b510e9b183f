"""P's answer: the kv_transfer_params its scheduler half returns when a do_remote_decode request
finishes, typed until the HTTP edge writes them with vLLM's field names. A vLLM decode
instance plans its reads from `tp_size`, so P's must be its own, not a constant."""

from __future__ import annotations

import pytest

from kvbridge.config import KVRole, KVTransferConfig
from kvbridge.engine.request import FinishReason, Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.connector.scheduler_side import KVBridgeSchedulerConnector
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.params import KVTransferParams, parse_kv_transfer_params, to_wire
from kvbridge.kv_transfer.stats import KVTransferStats

PROMPT = list(range(1, 41))  # 40 tokens: three blocks of 16
BLOCKS = ([3, 4, 5],)


def finished_prefill(request_id: str) -> Request:
    req = Request(request_id, list(PROMPT), SamplingParams(max_tokens=1),
                  kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True}))
    req.output_token_ids.append(17)
    req.finish(FinishReason.LENGTH)
    return req


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_p_s_params_carry_its_real_tp_size_in_vllm_s_fields(tp_size: int) -> None:
    leases = LeaseTable(30.0)
    conn = KVBridgeSchedulerConnector(KVTransferConfig(role=KVRole.PRODUCER, backend="tcp", engine_id="prefill-0"),
                                      "prefill-0", 16, leases, KVTransferStats(), lambda: ("127.0.0.1", 5600),
                                      tp_size=tp_size)
    delay_free, params = conn.request_finished(finished_prefill("cmpl-7"), BLOCKS)
    assert delay_free and isinstance(params, KVTransferParams)
    wire = to_wire(params)
    assert wire["tp_size"] == tp_size
    assert wire["do_remote_prefill"] is True and wire["do_remote_decode"] is False
    assert wire["remote_block_ids"] == [3, 4, 5] and wire["remote_request_id"] == "cmpl-7"
    assert (wire["remote_engine_id"], wire["remote_host"], wire["remote_port"]) == ("prefill-0", "127.0.0.1", 5600)
    assert wire["remote_num_tokens"] == len(PROMPT) and wire["generated_token_ids"] == [17]
    assert parse_kv_transfer_params(wire) == params  # D parses back exactly what P granted
    assert leases.check_read("cmpl-7", params.lease_generation, BLOCKS, content_digest(PROMPT)) is None
