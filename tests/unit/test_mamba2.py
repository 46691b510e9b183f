"""The Mamba2 mixer over slot-indexed state computes what transformers' `BambaMixer` computes.

A tiny random-weight `BambaForCausalLM` (one Mamba layer, one attention layer) is built per
config; its layer-0 mixer (the torch path, CPU, fp32) is the reference, fed the whole sequence
at once. kvbridge's `Mamba2Mixer` loads the same tensors by their Hugging Face names and must
give the same rows whether the sequence comes whole, in uneven chunks carrying the state, as
one-token decode steps, batched with other sequences in other states, or split over 2 real
gloo ranks (and 4 simulated ones: threads summing in a barrier). Configs: one group with
in_proj / out_proj biases (at TP the group and its gated-norm statistics span ranks), and two
groups without conv bias under a finite time-step limit (the clamp changes the outputs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from kvbridge.engine.layers.mamba2 import Mamba2Metadata, Mamba2Mixer, mamba2_weight_slots  # noqa: E402
from kvbridge.engine.layers.weights import load_slots  # noqa: E402
from kvbridge.shape.mamba_shard import mamba2_shard  # noqa: E402
from kvbridge.shape.model_config import Mamba2Config  # noqa: E402
from kvbridge.shape.tp_split import TPSplitError  # noqa: E402
from tests.tp_ranks import join_gloo, leave_gloo  # noqa: E402

ATOL = 1e-4
PREFIX = "model.layers.0.mamba."
HIDDEN = 32
_SHAPE = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, mamba_n_heads=4, mamba_d_state=8, mamba_expand=2,
              mamba_chunk_size=8)  # head_dim 16; chunks of 8 so the reference's scan crosses chunks
CONFIGS = {
    "g1_bias": dict(mamba_n_groups=1, mamba_d_conv=4, mamba_proj_bias=True),
    "g2_dt_limit": dict(mamba_n_groups=2, mamba_d_conv=3, mamba_conv_bias=False, time_step_limit=(0.0, 0.8)),
}


@dataclasses.dataclass
class Case:
    config: Mamba2Config
    weights: dict[str, torch.Tensor]  # the mixer's tensors by their full Hugging Face names
    reference: Callable[[torch.Tensor], torch.Tensor]  # [L, hidden] -> [L, hidden], the sequence whole


def make_case(name: str) -> Case:
    import transformers
    torch.manual_seed(0)
    hf_config = transformers.BambaConfig(**_SHAPE, **CONFIGS[name])
    model = transformers.BambaForCausalLM(hf_config).eval()
    mixer = model.model.layers[0].mamba
    with torch.no_grad():  # larger than HF's init, and A, D, dt_bias, the norm away from their constants
        for pname, p in mixer.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.uniform_(-1.0, 1.0)
        mixer.norm.weight.uniform_(0.5, 1.5)

    def reference(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return mixer(x[None])[0]
    weights = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(PREFIX)}
    return Case(Mamba2Config.from_hf(hf_config), weights, reference)


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {name: make_case(name) for name in CONFIGS}


def engine_mixer(config: Mamba2Config, weights: dict[str, torch.Tensor], tp: int = 1, rank: int = 0,
                 all_reduce: Callable | None = None) -> Mamba2Mixer:
    mixer = Mamba2Mixer(config, torch.float32, "cpu", tp, rank, all_reduce)
    load_slots(mamba2_weight_slots(mixer, PREFIX), weights)
    mixer.in_proj.prepack()
    mixer.out_proj.prepack()
    return mixer


def inputs(length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


class Slots:
    """A mixer's preallocated states, NaN where nothing was written (a fresh slot must not be read)."""

    def __init__(self, mixer: Mamba2Mixer, num_slots: int) -> None:
        self.mixer = mixer
        self.conv, self.ssm = (torch.full(s, float("nan")) for s in mixer.state_shapes(num_slots))

    def step(self, batch: list[tuple[int, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """batch: (slot, new tokens [L, hidden], has_initial_state) per sequence -> outputs per sequence."""
        meta = Mamba2Metadata.build([len(x) for _, x, _ in batch], [s for s, _, _ in batch], [h for _, _, h in batch])
        out = self.mixer(torch.cat([x for _, x, _ in batch]), self.conv, self.ssm, meta)
        return list(out.split([len(x) for _, x, _ in batch]))


@pytest.mark.parametrize("name", CONFIGS)
def test_whole_prefill_matches_transformers(cases, name) -> None:
    case = cases[name]
    x = inputs(21, seed=1)
    slots = Slots(engine_mixer(case.config, case.weights), 3)
    (got,) = slots.step([(1, x, False)])
    want = case.reference(x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert want.abs().max() > 1.0  # outputs far above the tolerance
    assert not slots.conv[1].isnan().any() and not slots.ssm[1].isnan().any()
    assert slots.conv[[0, 2]].isnan().all() and slots.ssm[[0, 2]].isnan().all()  # other slots untouched
    low, high = case.config.time_step_limit
    if high != float("inf"):  # the clamp is live: without it the outputs differ
        free = dataclasses.replace(case.config, time_step_limit=(low, float("inf")))
        (unclamped,) = Slots(engine_mixer(free, case.weights), 1).step([(0, x, False)])
        assert (unclamped - want).abs().max() > 100 * ATOL


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("chunks", [(5, 1, 9, 2, 4), (1, 1, 17, 2), (8, 8, 5)])
def test_chunked_prefill_carrying_state_equals_whole(cases, name, chunks) -> None:
    case = cases[name]
    x = inputs(sum(chunks), seed=2)
    slots = Slots(engine_mixer(case.config, case.weights), 4)
    rows, pos = [], 0
    for n in chunks:  # 1-token chunks take the decode path; 2 tokens are fewer than the conv state holds
        rows += slots.step([(2, x[pos:pos + n], pos > 0)])
        pos += n
    torch.testing.assert_close(torch.cat(rows), case.reference(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_steps_after_prefill_match_the_whole_sequence_row_by_row(cases, name) -> None:
    case = cases[name]
    x = inputs(21, seed=3)
    want = case.reference(x)
    slots = Slots(engine_mixer(case.config, case.weights), 2)
    (got,) = slots.step([(0, x[:13], False)])
    torch.testing.assert_close(got, want[:13], atol=ATOL, rtol=0)
    for t in range(13, 21):
        (row,) = slots.step([(0, x[t:t + 1], True)])
        torch.testing.assert_close(row[0], want[t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_mixed_batch_equals_each_sequence_alone(cases, name) -> None:
    case = cases[name]
    mixer = engine_mixer(case.config, case.weights)
    a, b, c, d = inputs(11, 4), inputs(13, 5), inputs(5, 6), inputs(1, 7)
    batched = Slots(mixer, 6)
    batched.step([(1, b[:6], False)])  # b and c have states before the mixed step
    batched.step([(0, c[:4], False)])
    # a: a fresh prefill; b: a chunk after its state; c: a decode after its state; d: a fresh 1-token prompt.
    got = batched.step([(5, a, False), (1, b[6:], True), (0, c[4:], True), (3, d, False)])
    assert batched.conv[[2, 4]].isnan().all() and batched.ssm[[2, 4]].isnan().all()
    for out, (x, done) in zip(got, ((a, 0), (b, 6), (c, 4), (d, 0))):
        alone = Slots(mixer, 1)
        rows = alone.step([(0, x[:done], False)]) if done else []
        rows += alone.step([(0, x[done:], done > 0)])
        torch.testing.assert_close(out, rows[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(out, case.reference(x)[done:], atol=ATOL, rtol=0)
    # the slots end in the states each sequence reaches alone
    alone = Slots(mixer, 1)
    alone.step([(0, b, False)])
    torch.testing.assert_close(batched.ssm[1], alone.ssm[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batched.conv[1], alone.conv[0], atol=1e-5, rtol=0)


def scenario(mixer: Mamba2Mixer) -> dict[str, torch.Tensor]:
    """Per sequence, the rows it computed across mixed steps (the same calls on every rank)."""
    xs = {"a": inputs(17, 11), "b": inputs(14, 12), "c": inputs(4, 13)}
    slots = Slots(mixer, 5)
    where = {"a": 3, "b": 0, "c": 4}
    done = {seq: 0 for seq in xs}
    rows: dict[str, list[torch.Tensor]] = {seq: [] for seq in xs}

    def run(new: dict[str, int]) -> None:
        batch = [(where[s], xs[s][done[s]:done[s] + n], done[s] > 0) for s, n in new.items()]
        for s, out in zip(new, slots.step(batch)):
            rows[s].append(out)
            done[s] += new[s]
    run({"a": 13})  # whole prefill
    run({"a": 1, "b": 6})  # decode + first chunk
    run({"b": 5, "c": 1})  # a chunk after state + a fresh 1-token prompt
    for _ in range(3):
        run({"a": 1, "b": 1, "c": 1})  # batched decode
    return {s: torch.cat(r) for s, r in rows.items()}


def check_scenario(got: dict[str, torch.Tensor], case: Case) -> None:
    for seq, seed, length in (("a", 11, 17), ("b", 12, 14), ("c", 13, 4)):
        torch.testing.assert_close(got[seq], case.reference(inputs(length, seed)), atol=ATOL, rtol=0)


class ThreadAllReduce:
    """`world` ranks as threads of this process: all_reduce sums their tensors at a barrier."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())  # the same order on every rank
            self.barrier.wait()
            return t.copy_(total)
        return all_reduce


@pytest.mark.parametrize("name", CONFIGS)
def test_tp4_thread_ranks_compute_the_unsplit_outputs(cases, name) -> None:
    # 1 head per rank: the one group (g1) or each of the two (g2) is shared by ranks, whose norm
    # statistics are summed across them.
    case, world = cases[name], 4
    reduce = ThreadAllReduce(world)

    def rank_run(rank: int) -> dict[str, torch.Tensor]:
        mixer = engine_mixer(case.config, case.weights, world, rank, reduce.for_rank(rank))
        assert not mixer.norm_local and mixer.num_groups == 1
        return scenario(mixer)
    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank_run, range(world)))
    unsplit = scenario(engine_mixer(case.config, case.weights))
    for got in results:
        for seq in unsplit:
            torch.testing.assert_close(got[seq], unsplit[seq], atol=ATOL, rtol=0)
    check_scenario(results[0], case)


def _gloo_rank(rank: int, world: int, store: str, weights_file: str, out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    results = {}
    for name, (config, weights) in torch.load(weights_file, weights_only=False).items():
        mixer = engine_mixer(config, weights, world, rank, all_reduce)
        results[name] = scenario(mixer) | {"norm_local": torch.tensor(mixer.norm_local)}
    torch.save(results, f"{out}.{rank}")
    leave_gloo()


def test_tp2_gloo_ranks_compute_the_unsplit_outputs(cases, tmp_path: Path) -> None:
    weights_file = tmp_path / "weights.pt"
    torch.save({name: (case.config, case.weights) for name, case in cases.items()}, weights_file)
    out = tmp_path / "out"
    mp.spawn(_gloo_rank, args=(2, str(tmp_path / "store"), str(weights_file), str(out)), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    # g1: the one group spans both ranks (norm statistics all-reduced); g2: a group per rank (local norm).
    assert [bool(ranks[0][n]["norm_local"]) for n in CONFIGS] == [False, True]
    for name, case in cases.items():
        unsplit = scenario(engine_mixer(case.config, case.weights))
        for got in ranks:
            for seq in unsplit:
                torch.testing.assert_close(got[name][seq], unsplit[seq], atol=ATOL, rtol=0)
        check_scenario(ranks[0][name], case)


def test_config_from_a_config_json_dict_equals_from_the_object(cases) -> None:
    import transformers
    for name in CONFIGS:
        hf_config = transformers.BambaConfig(**_SHAPE, **CONFIGS[name])
        assert Mamba2Config.from_hf(hf_config.to_dict()) == Mamba2Config.from_hf(hf_config) == cases[name].config
    with pytest.raises(ValueError, match="SiLU"):
        Mamba2Config.from_hf(transformers.BambaConfig(**_SHAPE, hidden_act="gelu"))


def test_shards_split_heads_and_split_or_share_groups() -> None:
    cfg = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=4, n_groups=2, conv_kernel=4)
    assert [(s.heads, s.groups) for s in (mamba2_shard(cfg, 2, r) for r in range(2))] == [
        (range(0, 4), range(0, 1)), (range(4, 8), range(1, 2))]
    assert [mamba2_shard(cfg, 4, r).groups for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [mamba2_shard(cfg, 8, r).heads for r in range(8)] == [range(r, r + 1) for r in range(8)]
    for tp in (3, 16):
        with pytest.raises(TPSplitError):
            mamba2_shard(cfg, tp, 0)
    with pytest.raises(TPSplitError, match="groups"):
        mamba2_shard(dataclasses.replace(cfg, n_groups=4, num_heads=12), 6, 0)  # 6 neither divides 4 nor is a multiple
    # Per-rank state: heads split; B and C channels of the conv state split with the groups or are copied.
    shapes = {tp: Mamba2Mixer(cfg, torch.float32, "meta", tp, 0, all_reduce=lambda t: t).state_shapes(3)
              for tp in (1, 2, 4)}
    assert shapes[1] == ((3, 128 + 2 * 2 * 4, 3), (3, 8, 16, 4))
    assert shapes[2] == ((3, 64 + 2 * 1 * 4, 3), (3, 4, 16, 4))
    assert shapes[4] == ((3, 32 + 2 * 1 * 4, 3), (3, 2, 16, 4))


def test_metadata_refuses_inconsistent_batches() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Mamba2Metadata.build([2, 3], [1, 1], [False, False])
    with pytest.raises(ValueError, match="increase"):
        Mamba2Metadata.build([2, 0], [0, 1], [False, False])
    with pytest.raises(ValueError):
        Mamba2Metadata.build([2], [0, 1], [False, False])
    meta = Mamba2Metadata.from_context([4, 1, 1], [10, 1, 7], [2, 0, 1])
    assert meta.has_initial_state == [True, False, True]
    assert [(p.start, p.end, p.slot) for p in meta.prefills] == [(0, 4, 2)]
    assert meta.decode_rows.tolist() == [4, 5] and meta.decode_slots.tolist() == [0, 1]
