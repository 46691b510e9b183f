"""Logical/kernel block mapping and the prefix-caching trim for hybrid models
(kvbridge.kv_transfer.read_plan.block_mapping): seed 004's cases by name, then exhaustive small
ranges checked against a token-position oracle."""

from __future__ import annotations

import ast
import inspect
import itertools
from pathlib import Path

import pytest

from kvbridge.kv_transfer.read_plan import block_mapping
from kvbridge.kv_transfer.read_plan.block_mapping import (BlockMappingError, GroupKind, KernelReadIds, apply_prefix_caching,
                                                check_block_ratios, group_kind, kernel_block_count,
                                                logical_to_kernel_block_ids)

FA, MLA, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
RATIOS = range(1, 7)
COUNTS = range(0, 6)


# ---- seed 004's parameterised cases ------------------------------------------------------

@pytest.mark.parametrize("group_kinds, remote_ratio, local_ratio, tp_ratio, remote_block_ids, expected", [
    pytest.param((FA, SWA), 2, 2, 1, ([0, 1, 2], [3, 4]), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]], id="dense_fa_swa"),
    # Nemotron-3-Nano's 4P1D: P (TP 4) has 34 kernel blocks per logical block, D (TP 1) 66.
    pytest.param((FA, MAMBA), 34, 66, -4, ([5, 6], [2]), [list(range(170, 238)), [2]], id="mamba_fa_ssm"),
])
def test_remote_ids_expand_with_the_remote_ratio(group_kinds, remote_ratio, local_ratio, tp_ratio,
                                                 remote_block_ids, expected):
    # tp_ratio is the seed's: the TP sizes made the ratios; it is no input of the mapping.
    assert logical_to_kernel_block_ids(remote_block_ids, remote_ratio=remote_ratio,
                                       group_kinds=group_kinds) == expected
    # The same logical ids under D's ratio are other kernel blocks, unless the ratios agree.
    with_local = logical_to_kernel_block_ids(remote_block_ids, local_ratio=local_ratio, group_kinds=group_kinds)
    assert (with_local == expected) == (local_ratio == remote_ratio)


def test_mamba_fa_ssm_read_pairs_d_s_whole_request_with_p_s_first_kernel_blocks():
    # A prompt of 600..1056 tokens (16-token kernel blocks): P holds two 544-token logical
    # blocks (68 kernel blocks), D one 1056-token block (66). Both start at token 0.
    read = apply_prefix_caching(([3], [7]), ([5, 6], [2]), local_ratio=66, remote_ratio=34,
                                group_kinds=(FA, MAMBA))
    assert read.local == [list(range(198, 264)), [7]]
    assert read.remote == [list(range(170, 236)), [2]]  # P's last two kernel blocks are padding
    local, remote = read  # unpacks as (local, remote)
    assert (local, remote) == (read.local, read.remote)


# ---- the Mamba-hybrid trim at both ends (vLLM's test_apply_prefix_caching_mamba_hybrid) ----

@pytest.mark.parametrize("local_ratio, remote_ratio, local_ids, remote_ids, expected_local, expected_remote", [
    # 10 kernel blocks of data; D: 2 logical blocks of 6 (12 kernel blocks), P: 1 of 10.
    pytest.param(6, 10, [[0, 1], [42]], [[0], [42]], [list(range(10)), [42]], [list(range(10)), [42]],
                 id="align_local6_remote10"),
    # 10 kernel blocks of data; D: 1 logical block of 10, P: 2 of 6 (12 kernel blocks).
    pytest.param(10, 6, [[0], [42]], [[0, 1], [42]], [list(range(10)), [42]], [list(range(10)), [42]],
                 id="align_local10_remote6"),
    # The same with scattered ids: the cut is in list order, never by id value.
    pytest.param(6, 10, [[3, 1], [9]], [[2], [4]], [[*range(18, 24), 6, 7, 8, 9], [9]],
                 [list(range(20, 30)), [4]], id="scattered_local6_remote10"),
    pytest.param(10, 6, [[2], [9]], [[5, 0], [4]], [list(range(20, 30)), [9]],
                 [[*range(30, 36), 0, 1, 2, 3], [4]], id="scattered_local10_remote6"),
])
def test_mamba_hybrid_trims_both_sides_to_the_smaller_kernel_count(local_ratio, remote_ratio, local_ids,
                                                                    remote_ids, expected_local,
                                                                    expected_remote):
    read = apply_prefix_caching(local_ids, remote_ids, local_ratio=local_ratio, remote_ratio=remote_ratio,
                                group_kinds=(FA, MAMBA))
    assert read == KernelReadIds(expected_local, expected_remote)


def test_the_trim_drops_the_end_not_the_front():
    # The seed report's `[-n:]` would keep kernel blocks 2..11 of D's and pair them with P's
    # 0..9: tokens 32.. into D's slots for tokens 0... The trim keeps both fronts.
    read = apply_prefix_caching([[0, 1], [42]], [[0], [42]], local_ratio=6, remote_ratio=10,
                                group_kinds=(FA, MAMBA))
    assert read.local[0][0] == 0 and read.remote[0][0] == 0
    assert read.local[0] != list(range(12))[-10:]


# ---- prefix hits for attention groups (equal ratios) -----------------------------------

@pytest.mark.parametrize("ratio", [1, 2, 5])
def test_partial_prefix_hit_reads_the_tail_d_lacks(ratio):
    # P: 4 logical blocks in both groups; D has the first 3 of the full-attention group cached
    # and the sliding-window group's first 2 were clipped on both sides.
    remote = ([10, 11, 12, 13], [20, 21])
    local = ([7], [30, 31])
    read = apply_prefix_caching(local, remote, local_ratio=ratio, remote_ratio=ratio, group_kinds=(FA, SWA))
    x = lambda ids: logical_to_kernel_block_ids([ids], local_ratio=ratio, group_kinds=(FA,))[0]  # noqa: E731
    assert read.local == [x([7]), x([30, 31])]
    assert read.remote == [x([13]), x([20, 21])]


def test_full_prefix_hit_reads_nothing():
    read = apply_prefix_caching(([], []), ([1, 2, 3], [4]), local_ratio=4, remote_ratio=4, group_kinds=(FA, MLA))
    assert read == KernelReadIds([[], []], [[], []])  # the `[-0:]` trap: not P's whole list


def test_no_prefix_hit_reads_everything_in_order():
    read = apply_prefix_caching(([9, 2], [5]), ([4, 8], [1]), local_ratio=3, remote_ratio=3,
                                group_kinds=(MLA, SWA))
    assert read.local == [[27, 28, 29, 6, 7, 8], [15, 16, 17]]
    assert read.remote == [[12, 13, 14, 24, 25, 26], [3, 4, 5]]


def test_prefix_hit_in_a_mamba_model_with_equal_ratios_keeps_the_attention_tail():
    read = apply_prefix_caching(([8], [3]), ([1, 2, 3], [6]), local_ratio=2, remote_ratio=2,
                                group_kinds=(FA, MAMBA))
    assert read == KernelReadIds([[16, 17], [3]], [[6, 7], [6]])


@pytest.mark.parametrize("kinds", [(FA,), (MLA,), (SWA,), (MAMBA,)])
def test_d_listing_more_blocks_than_p_raises(kinds):
    with pytest.raises(BlockMappingError, match="D lists 3 .* P sent 2"):
        apply_prefix_caching([[1, 2, 3]], [[4, 5]], local_ratio=1, remote_ratio=1, group_kinds=kinds)


def test_mamba_states_pair_from_the_end_and_are_never_expanded():
    read = apply_prefix_caching([[4]], [[0, 9]], local_ratio=66, remote_ratio=34, group_kinds=(MAMBA,))
    assert read == KernelReadIds([[4]], [[9]])  # D's state takes P's latest
    with pytest.raises(BlockMappingError, match="mamba.*D lists 1 states but P sent 0"):
        apply_prefix_caching([[4]], [[]], local_ratio=2, remote_ratio=2, group_kinds=(MAMBA,))


# ---- the API cannot be misused silently (seed 004's bug) ---------------------------------

def test_expanding_remote_ids_with_the_local_ratio_gives_other_blocks():
    remote_ids, kinds = ([5, 6], [2]), (FA, MAMBA)
    right = logical_to_kernel_block_ids(remote_ids, remote_ratio=34, group_kinds=kinds)
    seed_bug = logical_to_kernel_block_ids(remote_ids, local_ratio=66, group_kinds=kinds)
    assert right[0] == list(range(170, 238))
    assert seed_bug[0] == list(range(330, 462))  # beyond P's blocks 170..237: silent garbage
    assert not set(right[0]) & set(seed_bug[0])


def test_the_ratio_must_be_named_and_only_one_given():
    with pytest.raises(TypeError):
        logical_to_kernel_block_ids(([1],), 2, (FA,))  # type: ignore[misc]
    with pytest.raises(TypeError, match="exactly one"):
        logical_to_kernel_block_ids(([1],), group_kinds=(FA,))
    with pytest.raises(TypeError, match="exactly one"):
        logical_to_kernel_block_ids(([1],), local_ratio=2, remote_ratio=3, group_kinds=(FA,))
    with pytest.raises(TypeError):
        apply_prefix_caching(([1],), ([1],), 2, 3, (FA,))  # type: ignore[misc]
    for fn in (logical_to_kernel_block_ids, apply_prefix_caching):
        params = inspect.signature(fn).parameters
        assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY
                   for p in params if p.endswith("_ratio") or p == "group_kinds")


# ---- the handshake refusal ---------------------------------------------------------------

def test_mismatched_physical_per_logical_fails_with_prefix_caching():
    why = check_block_ratios(66, 34, local_prefix_caching=True)
    assert why is not None
    assert "66" in why and "34" in why and "--no-prefix-caching" in why
    assert check_block_ratios(66, 34, local_prefix_caching=False) is None
    assert check_block_ratios(34, 34, local_prefix_caching=True) is None
    with pytest.raises(BlockMappingError):
        check_block_ratios(0, 34, True)


def test_the_prefix_caching_flag_named_is_the_cli_s():
    from kvbridge.cli import build_parser
    assert build_parser().parse_args(["serve", "--no-prefix-caching"]).no_prefix_caching is True


@pytest.mark.parametrize("local_ratio, remote_ratio, remote_fa, local_fa, correct_local, correct_remote", [
    # 10 kernel blocks of data: P one logical block of 10, D two of 6 with the first cached.
    # D lacks kernel positions 6..9; no pairing of these lists by count can say so.
    pytest.param(6, 10, [0], [1], [6, 7, 8, 9], [6, 7, 8, 9], id="local6_remote10"),
    # 15 kernel blocks of data: P three logical blocks of 6, D two of 10 with the first cached.
    pytest.param(10, 6, [0, 1, 2], [1], [10, 11, 12, 13, 14], [10, 11, 12, 13, 14], id="local10_remote6"),
])
def test_a_prefix_hit_with_mismatched_ratios_cannot_be_paired(local_ratio, remote_ratio, remote_fa, local_fa,
                                                             correct_local, correct_remote):
    """Why check_block_ratios refuses: given only D's suffix in its own logical blocks,
    the mapping either rejects the lists or pairs the wrong kernel blocks."""
    try:
        read = apply_prefix_caching([local_fa, [42]], [remote_fa, [42]], local_ratio=local_ratio,
                                    remote_ratio=remote_ratio, group_kinds=(FA, MAMBA))
    except BlockMappingError as exc:
        assert "prefix caching off" in str(exc)
    else:
        assert (read.local[0], read.remote[0]) != (correct_local, correct_remote)
    assert check_block_ratios(local_ratio, remote_ratio, local_prefix_caching=True) is not None


# ---- kinds, counts and refusals ----------------------------------------------------------

def test_group_kinds_share_the_engines_values_and_module_stays_pure():
    from kvbridge.shape.kv_groups import KVCacheKind
    assert {k.value for k in KVCacheKind} <= {k.value for k in GroupKind}
    for k in KVCacheKind:
        assert group_kind(k).value == k.value  # the engine's enum passes as it is
    assert [k.value for k in GroupKind] == ["full_attention", "mla", "sliding_window", "mamba"]
    assert group_kind("mamba") is MAMBA and not MAMBA.token_indexed and SWA.token_indexed
    tree = ast.parse(Path(block_mapping.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.startswith(("kvbridge", "torch", "numpy"))}, imported


def test_kernel_block_count():
    assert kernel_block_count(3, 4, FA) == 12 and kernel_block_count(3, 4, "mamba") == 3
    with pytest.raises(BlockMappingError):
        kernel_block_count(-1, 4, FA)


@pytest.mark.parametrize("call, words", [
    (lambda: logical_to_kernel_block_ids(([1],), local_ratio=0, group_kinds=(FA,)), "local_ratio .* >= 1"),
    (lambda: logical_to_kernel_block_ids(([1],), remote_ratio=True, group_kinds=(FA,)), "remote_ratio"),
    (lambda: logical_to_kernel_block_ids(([1], [2]), local_ratio=1, group_kinds=(FA,)),
     "2 groups, the model has 1"),
    (lambda: logical_to_kernel_block_ids(([-1],), local_ratio=1, group_kinds=(FA,)), "block id -1"),
    (lambda: logical_to_kernel_block_ids(([True],), local_ratio=1, group_kinds=(FA,)), "block id True"),
    (lambda: logical_to_kernel_block_ids(([1.0],), local_ratio=1, group_kinds=(FA,)), "block id 1.0"),
    (lambda: logical_to_kernel_block_ids("12", local_ratio=1, group_kinds=(FA,)), "one list per group"),
    (lambda: logical_to_kernel_block_ids(([1],), local_ratio=1, group_kinds=("linear",)), "unknown .* 'linear'"),
    (lambda: logical_to_kernel_block_ids((), local_ratio=1, group_kinds=()), "at least one"),
    (lambda: apply_prefix_caching(([1],), ([1], [2]), local_ratio=1, remote_ratio=1, group_kinds=(FA,)),
     "remote block ids have 2 groups"),
    (lambda: apply_prefix_caching(([1],), ([1],), local_ratio=2, remote_ratio=3, group_kinds=(SWA,)),
     "sliding_window.*differ"),
    (lambda: apply_prefix_caching(([],), ([1],), local_ratio=2, remote_ratio=3, group_kinds=(FA,)),
     "whole request"),
])
def test_impossible_inputs_are_refused_with_the_reason(call, words):
    with pytest.raises(BlockMappingError, match=words):
        call()


def test_inputs_are_not_mutated():
    local, remote = [[1, 2]], [[3, 4, 5]]
    apply_prefix_caching(local, remote, local_ratio=2, remote_ratio=2, group_kinds=(FA,))
    logical_to_kernel_block_ids(remote, remote_ratio=3, group_kinds=(FA,))
    assert (local, remote) == ([[1, 2]], [[3, 4, 5]])


# ---- exhaustive small ranges -------------------------------------------------------------

@pytest.mark.parametrize("ratio", RATIOS)
def test_expansion_is_disjoint_and_covers_exactly_len_times_ratio(ratio):
    for n in COUNTS:
        for ids in itertools.permutations(range(6), n):
            (fa, mamba) = logical_to_kernel_block_ids([ids, ids], local_ratio=ratio, group_kinds=(FA, MAMBA))
            assert len(fa) == len(set(fa)) == n * ratio == kernel_block_count(n, ratio, FA)
            assert fa == [k for b in ids for k in range(b * ratio, (b + 1) * ratio)]
            assert [fa[i] // ratio for i in range(0, len(fa), ratio)] == list(ids)  # round trip
            assert mamba == list(ids)


@pytest.mark.parametrize("local_ratio", RATIOS)
def test_trim_keeps_equal_counts_or_refuses_exactly_when_it_must(local_ratio):
    for remote_ratio, n_local, n_remote in itertools.product(RATIOS, COUNTS, COUNTS):
        local = [list(range(50, 50 + n_local)), [7]]
        remote = [list(range(10, 10 + n_remote)), [3]]
        local_k, remote_k = (n_local * local_ratio, n_remote * remote_ratio)
        if local_ratio == remote_ratio:
            must_refuse = n_local > n_remote
        else:
            must_refuse = remote_k - local_k >= remote_ratio
        try:
            read = apply_prefix_caching(local, remote, local_ratio=local_ratio, remote_ratio=remote_ratio,
                                        group_kinds=(FA, MAMBA))
        except BlockMappingError:
            assert must_refuse, (local_ratio, remote_ratio, n_local, n_remote)
            continue
        assert not must_refuse, (local_ratio, remote_ratio, n_local, n_remote)
        for g in range(2):
            assert len(read.local[g]) == len(read.remote[g])
        full_l = logical_to_kernel_block_ids(local, local_ratio=local_ratio, group_kinds=(FA, MAMBA))
        full_r = logical_to_kernel_block_ids(remote, remote_ratio=remote_ratio, group_kinds=(FA, MAMBA))
        assert _is_slice(read.local[0], full_l[0]) and _is_slice(read.remote[0], full_r[0])
        assert len(read.local[0]) == (local_k if local_ratio == remote_ratio else min(local_k, remote_k))
        assert read.local[1] == [7] and read.remote[1] == [3]


def _is_slice(part: list[int], whole: list[int]) -> bool:
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def _side(num_tokens: int, ratio: int, first_id: int, keep_from: int, window: int | None):
    """One engine's logical ids for a request of `num_tokens` tokens (one token per kernel
    block: positions are kernel positions) and where each of its kernel ids sits in the
    request. `keep_from`: the first logical block listed (a prefix hit); `window`: the
    sliding window in logical blocks (the last `window` blocks stay)."""
    num_logical = -(-num_tokens // ratio)
    start = keep_from if window is None else max(keep_from, num_logical - window)
    ids = [first_id + 7 * i for i in range(num_logical)]  # scattered, distinct
    position = {ids[i] * ratio + j: i * ratio + j for i in range(num_logical) for j in range(ratio)}
    return ids[start:], position, start * ratio


@pytest.mark.parametrize("remote_ratio", RATIOS)
def test_every_pair_is_the_same_token_positions_and_d_gets_every_token_it_lacks(remote_ratio):
    """Against the oracle: kernel block i of D's read holds the same tokens as P's, and the
    read covers every real token D lacks (equal ratios: any prefix hit and sliding window;
    different ratios: the whole request, full attention)."""
    for local_ratio, num_tokens in itertools.product(RATIOS, range(31)):
        windows = [None] + ([1, 2, 3] if local_ratio == remote_ratio else [])
        hits = range(-(-num_tokens // local_ratio) + 1) if local_ratio == remote_ratio else [0]
        for window, hit in itertools.product(windows, hits):
            kind = FA if window is None else SWA
            p_ids, p_pos, _ = _side(num_tokens, remote_ratio, 1000, 0, window)
            d_ids, d_pos, d_from = _side(num_tokens, local_ratio, 3, hit, window)
            read = apply_prefix_caching([d_ids, [5]], [p_ids, [9]], local_ratio=local_ratio,
                                        remote_ratio=remote_ratio, group_kinds=(kind, MAMBA))
            got = [d_pos[k] for k in read.local[0]]
            assert got == [p_pos[k] for k in read.remote[0]]
            assert set(range(d_from, num_tokens)) <= set(got), (local_ratio, remote_ratio, num_tokens, hit)
            assert read.local[1] == [5] and read.remote[1] == [9]
