"""The connector's view of a request (kv_transfer/connector/request_view.py) matches the engine's
Request: kv_transfer cannot import the engine, so this test holds the two together."""

from kvbridge.engine.request import FinishReason, Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.connector.request_view import FINISHED_WITH_OUTPUT, ConnectorRequest


def test_an_engine_request_is_a_connector_request():
    assert isinstance(Request("r", [1, 2, 3], SamplingParams(max_tokens=1)), ConnectorRequest)


def test_p_keeps_blocks_for_stop_and_length_only():
    kept = {reason for reason in FinishReason if reason in FINISHED_WITH_OUTPUT}
    assert kept == {FinishReason.STOP, FinishReason.LENGTH}
