"""Specification of the kv_transfer_params wire schema (kvbridge.kv_transfer.params)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.kv_transfer.params import (
    KNOWN_FIELDS,
    MAX_BLOCK_ID,
    KVTransferParams,
    KVTransferParamsError,
    parse_kv_transfer_params,
    to_wire,
)

# What a vLLM prefill instance returns in its response body (one KV cache group).
P_RESPONSE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5],
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-abc-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 40,
}


def with_(**changes: object) -> dict:
    body = dict(P_RESPONSE)
    body.update(changes)
    return body


def without(name: str) -> dict:
    return {k: v for k, v in P_RESPONSE.items() if k != name}


# ---- accepted shapes ---------------------------------------------------------------


@pytest.mark.parametrize("raw", [None, {}])
def test_absent_or_empty_params_mean_no_kv_transfer(raw: object) -> None:
    assert parse_kv_transfer_params(raw) is None


def test_proxy_to_prefill_params_ask_to_keep_kv_for_remote_decode() -> None:
    params = parse_kv_transfer_params({"do_remote_decode": True})
    assert params is not None
    assert params.wants_remote_decode and not params.wants_remote_prefill
    assert params.remote_block_ids is None


def test_vllm_proxy_nulls_are_treated_as_absent() -> None:
    raw = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert parse_kv_transfer_params(raw) == KVTransferParams(do_remote_decode=True)


def test_prefill_response_is_parsed_for_the_decode_side() -> None:
    params = parse_kv_transfer_params(P_RESPONSE)
    assert params is not None and params.wants_remote_prefill and not params.wants_remote_decode
    assert params.remote_block_ids == ((3, 4, 5),)
    assert params.num_kv_groups == 1
    assert (params.remote_engine_id, params.remote_request_id) == ("prefill-0", "cmpl-abc-0")
    assert (params.remote_host, params.remote_port) == ("127.0.0.1", 5600)
    assert (params.tp_size, params.remote_num_tokens, params.lease_generation) == (1, 40, None)


def test_one_list_per_kv_cache_group_is_kept_per_group() -> None:
    params = parse_kv_transfer_params(with_(remote_block_ids=[[1, 2, 3], [7], []]))
    assert params is not None and params.remote_block_ids == ((1, 2, 3), (7,), ())


def test_empty_block_list_is_one_group_with_nothing_to_read() -> None:
    params = parse_kv_transfer_params(with_(remote_block_ids=[]))
    assert params is not None and params.remote_block_ids == ((),)


def test_missing_tp_size_defaults_to_one_like_vllm() -> None:
    params = parse_kv_transfer_params(without("tp_size"))
    assert params is not None and params.tp_size is None and params.remote_tp_size == 1


def test_lease_generation_is_kvbridges_own_field() -> None:
    params = parse_kv_transfer_params(with_(lease_generation=7))
    assert params is not None and params.lease_generation == 7
    assert to_wire(params)["lease_generation"] == 7


def test_unknown_keys_are_kept_and_forwarded() -> None:
    params = parse_kv_transfer_params(with_(_p_side_truncated=True, future_field={"a": [1]}))
    assert params is not None
    assert dict(params.unknown_fields) == {"_p_side_truncated": True, "future_field": {"a": [1]}}
    wire = to_wire(params)
    assert wire["_p_side_truncated"] is True and wire["future_field"] == {"a": [1]}


def test_unknown_keys_holding_non_json_values_are_dropped() -> None:
    params = parse_kv_transfer_params(with_(weird=object()))
    assert params is not None and "weird" not in params.unknown_fields


def test_params_do_not_change_when_the_callers_dict_does() -> None:
    raw = with_(extra={"k": [1]})
    params = parse_kv_transfer_params(raw)
    raw["extra"]["k"].append(2)
    assert params is not None and params.unknown_fields["extra"] == {"k": [1]}
    with pytest.raises(TypeError):
        params.unknown_fields["x"] = 1  # type: ignore[index]


def test_params_are_frozen_and_hashable() -> None:
    params = parse_kv_transfer_params(P_RESPONSE)
    assert params is not None
    assert hash(params) == hash(parse_kv_transfer_params(dict(P_RESPONSE)))
    with pytest.raises(AttributeError):
        params.remote_port = 1  # type: ignore[misc]


# ---- refused shapes ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["remote_block_ids", "remote_engine_id", "remote_request_id",
                                  "remote_host", "remote_port"])
def test_remote_prefill_without_a_required_field_is_refused(name: str) -> None:
    with pytest.raises(KVTransferParamsError, match=name):
        parse_kv_transfer_params(without(name))


@pytest.mark.parametrize("raw", [[], "do_remote_prefill", 1, True, 1.5, [P_RESPONSE]])
def test_params_that_are_not_an_object_are_refused(raw: object) -> None:
    with pytest.raises(KVTransferParamsError, match="JSON object"):
        parse_kv_transfer_params(raw)


@pytest.mark.parametrize("field, value", [
    ("remote_port", True),  # a bool is not an int
    ("remote_port", 5600.0),
    ("remote_port", "5600"),
    ("tp_size", False),
    ("remote_num_tokens", 1.0),
    ("lease_generation", True),
    ("remote_block_ids", [1, True]),
    ("remote_block_ids", [1, 2.0]),
    ("remote_block_ids", ["1"]),
    ("remote_block_ids", [[1], 2]),  # a mix of groups and ids
    ("remote_block_ids", {"0": [1]}),
    ("remote_block_ids", "1,2"),
    ("remote_engine_id", 5),
    ("remote_request_id", ["r"]),
    ("remote_host", {"h": 1}),
    ("do_remote_prefill", 1),
    ("do_remote_decode", "true"),
])
def test_wrong_types_are_refused(field: str, value: object) -> None:
    with pytest.raises(KVTransferParamsError, match=field):
        parse_kv_transfer_params(with_(**{field: value}))


@pytest.mark.parametrize("field, value", [
    ("remote_block_ids", [-1]),
    ("remote_block_ids", [MAX_BLOCK_ID + 1]),
    ("remote_block_ids", [[0], [10**30]]),
    ("remote_port", 0),
    ("remote_port", -5),
    ("remote_port", 65536),
    ("tp_size", 0),
    ("remote_num_tokens", -1),
    ("lease_generation", -1),
    ("lease_generation", 2**63),
    ("remote_engine_id", ""),
    ("remote_host", "evil host"),
    ("remote_host", "h" * 256),
    ("remote_request_id", "id\x00"),
])
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(KVTransferParamsError, match=field):
        parse_kv_transfer_params(with_(**{field: value}))


def test_both_directions_at_once_are_refused() -> None:
    with pytest.raises(KVTransferParamsError, match="both"):
        parse_kv_transfer_params(with_(do_remote_decode=True))


def test_a_held_prefix_may_be_read_by_a_prefill_that_keeps_its_kv_for_decode() -> None:
    params = parse_kv_transfer_params(with_(do_remote_decode=True, remote_prefix_tokens=32))
    assert params is not None and params.wants_remote_decode and params.is_prefix_load
    assert parse_kv_transfer_params(to_wire(params)) == params
    plain = parse_kv_transfer_params(P_RESPONSE)
    assert plain is not None and not plain.is_prefix_load


@pytest.mark.parametrize("raw, match", [
    (with_(do_remote_prefill=False, remote_prefix_tokens=32), "needs do_remote_prefill"),
    (with_(remote_prefix_tokens=32, generated_token_ids=[5]), "generated_token_ids"),
    (with_(remote_prefix_tokens=0), "remote_prefix_tokens"),
    (with_(remote_prefix_tokens="32"), "remote_prefix_tokens"),
])
def test_held_prefix_misuse_is_refused(raw: dict, match: str) -> None:
    with pytest.raises(KVTransferParamsError, match=match):
        parse_kv_transfer_params(raw)


def test_non_string_keys_are_refused() -> None:
    with pytest.raises(KVTransferParamsError, match="keys"):
        parse_kv_transfer_params({1: True})


def test_the_error_is_a_value_error_with_a_message_for_the_client() -> None:
    with pytest.raises(ValueError) as info:
        parse_kv_transfer_params(with_(remote_port="x"))
    assert str(info.value) == "kv_transfer_params.remote_port must be an integer, got string"


def test_constructing_params_directly_validates_too() -> None:
    with pytest.raises(KVTransferParamsError, match="remote_engine_id"):
        KVTransferParams(do_remote_prefill=True, remote_block_ids=((1,),),
                         remote_request_id="r", remote_host="h", remote_port=1)
    with pytest.raises(KVTransferParamsError, match="remote_block_ids"):
        KVTransferParams(remote_block_ids=())


# ---- writing -----------------------------------------------------------------------


def test_to_wire_writes_a_flat_list_for_one_group_and_lists_for_several() -> None:
    one = KVTransferParams(remote_block_ids=((1, 2),))
    several = KVTransferParams(remote_block_ids=((1, 2), (3,)))
    assert to_wire(one)["remote_block_ids"] == [1, 2]
    assert to_wire(several)["remote_block_ids"] == [[1, 2], [3]]


def test_to_wire_always_writes_both_flags_and_omits_unset_fields() -> None:
    assert to_wire(KVTransferParams(do_remote_decode=True)) == {
        "do_remote_decode": True, "do_remote_prefill": False}


def test_prefill_response_round_trips_byte_for_byte() -> None:
    params = parse_kv_transfer_params(P_RESPONSE)
    assert params is not None
    assert to_wire(params) == P_RESPONSE


# ---- fuzzing -----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
known_keys = st.sampled_from(sorted(KNOWN_FIELDS))
plausible = st.fixed_dictionaries(
    {},
    optional={
        "do_remote_prefill": st.booleans() | json_values,
        "do_remote_decode": st.booleans() | json_values,
        "remote_block_ids": st.lists(st.integers(-2, 2**32))
        | st.lists(st.lists(st.integers(-2, 9))) | json_values,
        "remote_engine_id": st.text(max_size=4) | json_values,
        "remote_request_id": st.text(max_size=4) | json_values,
        "remote_host": st.text(max_size=4) | json_values,
        "remote_port": st.integers(-2, 70000) | json_values,
        "tp_size": st.integers(-1, 9) | json_values,
        "lease_generation": st.integers(-1, 2**64) | json_values,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(json_values, plausible,
                 st.dictionaries(known_keys | st.text(max_size=6), json_values, max_size=6)))
def test_any_json_value_parses_or_raises_kv_transfer_params_error(raw: object) -> None:
    try:
        params = parse_kv_transfer_params(raw)
    except KVTransferParamsError:
        return
    if params is not None:  # whatever was accepted can be written back and re-read
        wire = json.loads(json.dumps(to_wire(params)))
        assert parse_kv_transfer_params(wire) == params


ids = st.text(st.characters(categories=("L", "N", "P", "S")), min_size=1, max_size=12)
block_groups = st.lists(st.lists(st.integers(0, MAX_BLOCK_ID), max_size=6).map(tuple),
                        min_size=1, max_size=4).map(tuple)
unknown = st.dictionaries(st.text(max_size=6).filter(lambda k: k not in KNOWN_FIELDS),
                          json_values, max_size=3)


@st.composite
def valid_params(draw: st.DrawFn) -> KVTransferParams:
    direction = draw(st.sampled_from(["decode", "prefill", "neither"]))
    prefill = direction == "prefill"
    optional = draw(st.booleans())
    return KVTransferParams(
        do_remote_decode=direction == "decode",
        do_remote_prefill=prefill,
        remote_block_ids=draw(block_groups) if prefill or optional else None,
        remote_engine_id=draw(ids) if prefill or optional else None,
        remote_request_id=draw(ids) if prefill or optional else None,
        remote_host=draw(ids) if prefill else None,
        remote_port=draw(st.integers(1, 65535)) if prefill else None,
        tp_size=draw(st.none() | st.integers(1, 64)),
        remote_num_tokens=draw(st.none() | st.integers(0, 10**6)),
        lease_generation=draw(st.none() | st.integers(0, 2**63 - 1)),
        unknown_fields=draw(unknown),
    )


@settings(max_examples=300, deadline=None)
@given(valid_params())
def test_valid_params_round_trip_through_json(params: KVTransferParams) -> None:
    wire = json.loads(json.dumps(to_wire(params)))
    assert parse_kv_transfer_params(wire) == params


def test_the_tokens_p_sampled_are_parsed_and_written_back() -> None:
    offered = parse_kv_transfer_params({**P_RESPONSE, "generated_token_ids": [42]})
    assert offered is not None and offered.generated_token_ids == (42,)
    assert to_wire(offered) == {**P_RESPONSE, "generated_token_ids": [42]}


@pytest.mark.parametrize("raw", [
    {**P_RESPONSE, "generated_token_ids": 42},
    {**P_RESPONSE, "generated_token_ids": []},
    {**P_RESPONSE, "generated_token_ids": [1.5]},
    {**P_RESPONSE, "generated_token_ids": [True]},
    {**P_RESPONSE, "generated_token_ids": [-1]},
    {**P_RESPONSE, "generated_token_ids": list(range(17))},
])
def test_bad_generated_tokens_are_refused(raw: dict) -> None:
    with pytest.raises(KVTransferParamsError):
        parse_kv_transfer_params(raw)
