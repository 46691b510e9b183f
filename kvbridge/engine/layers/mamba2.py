"""The Mamba2 mixer (the "linear attention" layer of Bamba-style hybrid models) over explicit
per-sequence state, in plain torch, split over tensor-parallel ranks.

The math (transformers' `BambaMixer`, its torch path), for one sequence of tokens u_t:

    [z | xBC | dt] = in_proj(u)                      z, x: intermediate I = H * P; B, C: G * N each; dt: H
    xBC = silu(causal depthwise conv1d(xBC))         kernel K over the time axis, per channel
    [x | B | C] = xBC                                x -> H heads of P; B, C -> G groups of N
    dt = clamp(softplus(dt + dt_bias), time_step_limit)
    A = -exp(A_log)                                  one scalar per head
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T       per head: state [P, N]; head h reads group h // (H / G)
    y_t = h_t C_t + D x_t
    out = out_proj(w * rmsnorm_per_group(y * silu(z)))   gated RMSNorm over groups of I / G values

A sequence's state between calls is therefore two tensors, "the Mamba state a request owns"
(one block of a Mamba KV cache group; its size does not grow with the sequence):

    conv state [conv_dim, K - 1]   the last K - 1 inputs of the conv (xBC before the conv), oldest
                                   first; conv_dim = I + 2 G N (the rank's part at TP, below)
    ssm state  [H, P, N]           h after the last token

An engine preallocates `conv_states[num_slots, conv_dim, K - 1]` and `ssm_states[num_slots, H, P,
N]` per layer (`Mamba2Mixer.state_shapes`) and gives each running sequence a slot. One step's batch
is flattened sequence-major like the attention layers' (`query_start_loc`); `Mamba2Metadata` names
each sequence's slot and whether the slot holds its state already (`has_initial_state`: False for
a sequence's first chunk, which starts from zeros without reading the slot, so a reused slot
needs no clearing). `forward` reads each sequence's state from its slot and writes the state
after its new tokens back; a chunked prefill carries its state from chunk to chunk this way.
(transformers keeps K conv inputs per sequence; the oldest of them never reaches an output.)

Cost: a sequence with several new tokens (a prefill or a prefill chunk, L tokens) runs the chunked
SSD scan: the L tokens are cut into chunks of Q = chunk_size; within a chunk the output is a
causal, decay-weighted C.B^T "attention" (O(L Q H (N + P)) time, O(Q^2 H) memory per chunk), and
the state is carried across chunks by a sequential loop over the L / Q chunks (O(L H P N)). Such
sequences are processed one by one (a Python loop, as the attention layers do for prefills). All
sequences with one new token (decode) take ONE batched recurrence step together: O(B H P N) time,
no loop. Both paths compute in fp32 and store the states in the slot tensors' dtype. Both clamp
dt to time_step_limit; transformers clamps in its chunked path only, not in its one-token path,
so with a finite limit its cached decode differs from its own whole-sequence output (the
default limit (0, inf) makes the clamp a no-op). Here a decode equals the whole-sequence rows.

Tensor parallelism (`Mamba2Shard`, shape/mamba_shard.py): the H heads split evenly over ranks (H % tp == 0), so a rank
holds z, x, dt, A, D, dt_bias and the norm weight of its heads and the conv channels of its x.
Groups (B and C, conv channels and in_proj rows alike) split evenly when G % tp == 0; otherwise tp
must be a multiple of G (vLLM allows G == 1 only; any divisor of tp works the same way): each rank
holds a copy of the one group its heads read. in_proj is column-parallel with the rank's rows of
each part gathered in the order [z | x | B | C | dt] (the checkpoint's in_proj is that
concatenation whole; conv1d's channels are [x | B | C]); out_proj is row-parallel followed by
`all_reduce` (its bias, if any, is added once after it). The gated norm normalises groups of I / G
values: when groups split evenly each rank holds whole norm groups and normalises locally; when a
group spans ranks, each rank all-reduces its sums of squares ([T, G], its group's column filled)
before normalising, so every rank divides by the whole group's mean. Two all-reduces per layer in
that case, one otherwise.

Weights load by Hugging Face names (`mamba2_weight_slots`): in_proj.weight (+ bias), conv1d.weight
(+ bias), dt_bias, A_log, D, norm.weight, out_proj.weight (+ bias) under the layer's prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers.linear import Linear
from kvbridge.engine.layers.weights import WeightSlot, whole
from kvbridge.shape.mamba_shard import mamba2_shard
from kvbridge.shape.model_config import Mamba2Config

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with several new tokens: rows start:end of the step."""

    start: int
    end: int
    slot: int
    has_initial_state: bool


@dataclass
class Mamba2Metadata:
    """One step's batch, flattened sequence-major: sequence i owns tokens query_start_loc[i]:
    query_start_loc[i + 1] and state slot state_slots[i]. has_initial_state[i]: the slot holds the
    state after exactly the tokens before this step's (False: a fresh sequence; the slot's contents,
    whatever they are, are ignored and overwritten). Slots of one step must differ. The derived
    index tensors are built once per step on `device` and shared by every Mamba layer."""

    query_start_loc: list[int]
    state_slots: list[int]
    has_initial_state: list[bool]
    device: torch.device | str = "cpu"
    prefills: list[PrefillSeq] = field(init=False)
    decode_rows: torch.Tensor | None = field(init=False)  # [Bd] token rows; None when every token is a decode
    decode_slots: torch.Tensor | None = field(init=False)  # [Bd]; None without decodes
    decode_has_state: torch.Tensor | None = field(init=False)  # bool [Bd]

    @classmethod
    def build(cls, query_lens: list[int], state_slots: list[int], has_initial_state: list[bool],
              device: torch.device | str = "cpu") -> Mamba2Metadata:
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(starts, list(state_slots), list(has_initial_state), device)

    @classmethod
    def from_context(cls, query_lens: list[int], context_lens: list[int], state_slots: list[int],
                     device: torch.device | str = "cpu") -> Mamba2Metadata:
        """For sequences whose step ends at context_lens[i] (the attention layers' context_lens):
        a sequence has an initial state when tokens were computed before this step."""
        return cls.build(query_lens, state_slots, [c > q for q, c in zip(query_lens, context_lens)], device)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def __post_init__(self) -> None:
        n = len(self.state_slots)
        if len(self.query_start_loc) != n + 1 or len(self.has_initial_state) != n:
            raise ValueError("query_start_loc needs one entry more than state_slots and has_initial_state")
        if self.query_start_loc[0] != 0 or any(b <= a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])):
            raise ValueError(f"query_start_loc must start at 0 and increase strictly, got {self.query_start_loc}")
        if len(set(self.state_slots)) != n or any(s < 0 for s in self.state_slots):
            raise ValueError(f"state slots must be distinct and >= 0, got {self.state_slots}")
        decodes = [i for i in range(n) if self.query_start_loc[i + 1] - self.query_start_loc[i] == 1]
        self.prefills = [PrefillSeq(self.query_start_loc[i], self.query_start_loc[i + 1], self.state_slots[i],
                                    bool(self.has_initial_state[i])) for i in sorted(set(range(n)) - set(decodes))]
        if not decodes:
            self.decode_rows = self.decode_slots = self.decode_has_state = None
            return
        rows = [self.query_start_loc[i] for i in decodes]
        self.decode_rows = None if len(rows) == self.num_tokens else torch.tensor(rows, device=self.device)
        self.decode_slots = torch.tensor([self.state_slots[i] for i in decodes], device=self.device)
        self.decode_has_state = torch.tensor([bool(self.has_initial_state[i]) for i in decodes], device=self.device)


class Mamba2Mixer(nn.Module):
    """A Mamba2 mixer's rank part over slot-indexed state (see the module docstring).
    Parameters stay uninitialised until loaded (`mamba2_weight_slots`)."""

    def __init__(self, config: Mamba2Config, dtype: torch.dtype, device: torch.device | str,
                 tp_size: int = 1, rank: int = 0, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.shard = mamba2_shard(config, tp_size, rank)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel shard needs an all_reduce over its ranks")
        self.all_reduce = all_reduce
        c, s = config, self.shard
        self.num_heads, self.num_groups = s.num_heads, s.num_groups
        self.intermediate = s.num_heads * c.head_dim
        self.conv_dim = self.intermediate + 2 * s.num_groups * c.state_size
        # A norm group (I / G values) lies inside this rank, or this rank holds part of one group.
        self.norm_local = c.n_groups % tp_size == 0

        def param(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)
        self.in_proj = Linear(c.hidden_size, self.intermediate + self.conv_dim + s.num_heads, c.proj_bias, dtype, device)
        self.conv_weight = param(self.conv_dim, 1, c.conv_kernel)  # depthwise, as nn.Conv1d stores it
        self.conv_bias = param(self.conv_dim) if c.conv_bias else None
        self.dt_bias = param(s.num_heads)
        self.A_log = param(s.num_heads)
        self.D = param(s.num_heads)
        self.norm_weight = param(self.intermediate)
        self.out_proj = Linear(self.intermediate, c.hidden_size, False, dtype, device)
        self.out_bias = param(c.hidden_size) if c.proj_bias else None  # added once, after the all-reduce

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv_states, ssm_states) shapes of this rank's state for `num_slots` sequences."""
        c = self.config
        return ((num_slots, self.conv_dim, c.conv_kernel - 1),
                (num_slots, self.num_heads, c.head_dim, c.state_size))

    def allocate_states(self, num_slots: int, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv_states, ssm_states) for `num_slots` sequences (default: the weights' dtype
        and device)."""
        dtype = dtype or self.conv_weight.dtype
        device = device or self.conv_weight.device
        conv, ssm = self.state_shapes(num_slots)
        return torch.zeros(conv, dtype=dtype, device=device), torch.zeros(ssm, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                meta: Mamba2Metadata) -> torch.Tensor:
        """x [T, hidden] (the step's tokens, sequence-major) -> [T, hidden]. Reads and writes each
        sequence's slot of conv_states [slots, conv_dim, K - 1] and ssm_states [slots, H, P, N]."""
        c = self.config
        if x.shape[0] != meta.num_tokens:
            raise ValueError(f"{x.shape[0]} tokens for metadata of {meta.num_tokens}")
        conv_shape, ssm_shape = self.state_shapes(conv_states.shape[0])
        if tuple(conv_states.shape) != conv_shape or tuple(ssm_states.shape) != ssm_shape:
            raise ValueError(f"state tensors must be [slots, {conv_shape[1]}, {conv_shape[2]}] and [slots, "
                             f"{ssm_shape[1]}, {ssm_shape[2]}, {ssm_shape[3]}] with the same slots, got "
                             f"{tuple(conv_states.shape)} and {tuple(ssm_states.shape)}")
        proj = self.in_proj(x)
        z, xbc, dt = proj.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        y = torch.empty(x.shape[0], self.num_heads, c.head_dim, dtype=torch.float32, device=x.device)
        A = -torch.exp(self.A_log.float())
        for seq in meta.prefills:
            y[seq.start:seq.end] = self._prefill(xbc[seq.start:seq.end], dt[seq.start:seq.end], A, conv_states,
                                                 ssm_states, seq)
        if meta.decode_slots is not None:
            assert meta.decode_has_state is not None  # set with decode_slots
            rows = meta.decode_rows
            y_dec = self._decode(xbc if rows is None else xbc[rows], dt if rows is None else dt[rows], A,
                                 conv_states, ssm_states, meta.decode_slots, meta.decode_has_state)
            if rows is None:
                y = y_dec
            else:
                y[rows] = y_dec
        out: torch.Tensor = self.out_proj(self._gated_norm(y.view(x.shape[0], self.intermediate), z).to(x.dtype))
        if self.all_reduce is not None:
            out = self.all_reduce(out)
        return out if self.out_bias is None else out + self.out_bias

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, conv_dim] -> x [T, h, P], B and C [T, h, N] repeated per head (fp32)."""
        c, t = self.config, xbc.shape[0]
        gn = self.num_groups * c.state_size
        xs, B, C = xbc.float().split_with_sizes([self.intermediate, gn, gn], dim=-1)
        per = self.num_heads // self.num_groups
        B = B.view(t, self.num_groups, c.state_size).repeat_interleave(per, dim=1)
        C = C.view(t, self.num_groups, c.state_size).repeat_interleave(per, dim=1)
        return xs.view(t, self.num_heads, c.head_dim), B, C

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        low, high = self.config.time_step_limit
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(min=low, max=high)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        keep = self.config.conv_kernel - 1
        new = xbc.t()  # [conv_dim, L]
        if seq.has_initial_state:
            past = conv_states[seq.slot].to(new.dtype)
        else:
            past = new.new_zeros(self.conv_dim, keep)
        window = torch.cat((past, new), dim=1)  # [conv_dim, K - 1 + L]
        conv_states[seq.slot] = window[:, window.shape[1] - keep:]
        conv = F.conv1d(window[None].to(self.conv_weight.dtype), self.conv_weight, self.conv_bias,
                        groups=self.conv_dim)[0]
        xs, B, C = self._split_xbc(F.silu(conv).t())
        init = ssm_states[seq.slot].float() if seq.has_initial_state else None
        y, final = ssd_scan(xs, self._time_step(dt), A, B, C, self.D.float(), self.config.chunk_size, init)
        ssm_states[seq.slot] = final.to(ssm_states.dtype)
        return y

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, conv_states: torch.Tensor,
                ssm_states: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """One token for each of Bd sequences: one batched conv step and one recurrence step."""
        past = torch.where(has_state[:, None, None], conv_states[slots].to(xbc.dtype), 0)
        window = torch.cat((past, xbc[:, :, None]), dim=2)  # [Bd, conv_dim, K]
        conv_states[slots] = window[:, :, 1:].to(conv_states.dtype)
        conv = (window.to(self.conv_weight.dtype) * self.conv_weight[:, 0]).sum(dim=-1)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        xs, B, C = self._split_xbc(F.silu(conv))
        dt = self._time_step(dt)  # [Bd, h]
        state = torch.where(has_state[:, None, None, None], ssm_states[slots].float(), 0)
        state = (state * torch.exp(dt * A)[:, :, None, None]
                 + (dt[:, :, None] * xs)[..., None] * B[:, :, None, :])
        ssm_states[slots] = state.to(ssm_states.dtype)
        return (state @ C[..., None])[..., 0] + self.D.float()[:, None] * xs

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """w * rmsnorm(y * silu(z)) over groups of I / G values (statistics in fp32)."""
        c, t = self.config, y.shape[0]
        h = y.float() * F.silu(z.float())
        if self.norm_local:
            grouped = h.view(t, self.num_groups, -1)
            h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.norm_eps)).view(t, -1)
        else:  # this rank holds part of one group: sum the squares over the ranks sharing it
            assert self.all_reduce is not None
            sums = h.new_zeros(t, c.n_groups)
            group = self.shard.groups.start
            sums[:, group] = h.pow(2).sum(-1)
            sums = self.all_reduce(sums)
            h = h * torch.rsqrt(sums[:, group:group + 1] / (c.intermediate_size // c.n_groups) + c.norm_eps)
        return self.norm_weight * h.to(self.norm_weight.dtype)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             chunk_size: int, initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan of one sequence (fp32): x [L, H, P], dt [L, H] (after softplus), A and
    D [H], B and C [L, H, N] (already per head), initial_state [H, P, N] or None (zeros).
    Returns y [L, H, P] and the state after the last token [H, P, N].

    Within a chunk (Q tokens): y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s with
    a = dt A, the decay sums taken as masked cumulative sums (no cancellation between large
    prefix sums); the chunk's start state adds C_l h_start exp(a_1 + ... + a_l). The chunk's end
    state is h_start exp(a_1 + ... + a_Q) + sum_s exp(a_{s+1} + ... + a_Q) dt_s x_s B_s^T. Padding
    the last chunk with dt = 0 leaves the state unchanged, so the final state is the last
    chunk's end state."""
    length, heads, head_dim = x.shape
    q = chunk_size
    pad = (-length) % q
    x_dt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(-1, q, heads, head_dim)  # [c, Q, H, P]
    a = F.pad(dt * A, (0, 0, 0, pad)).view(-1, q, heads).transpose(1, 2)  # [c, H, Q]
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).view(-1, q, heads, B.shape[-1])
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).view(-1, q, heads, C.shape[-1])
    a_cum = a.cumsum(dim=-1)  # [c, H, Q]: decay from the chunk's start through each token
    scores = torch.einsum("clhn,cshn->chls", C, B) * torch.exp(_segment_sums(a))
    y = torch.einsum("chls,cshp->clhp", scores, x_dt)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [c, H, Q]
    own = torch.einsum("cshn,chs,cshp->chpn", B, to_end, x_dt)  # each chunk's end state from its own tokens
    chunk_decay = torch.exp(a_cum[..., -1])  # [c, H]
    state = x.new_zeros(heads, head_dim, B.shape[-1]) if initial_state is None else initial_state
    starts = []
    for i in range(own.shape[0]):
        starts.append(state)
        state = state * chunk_decay[i][:, None, None] + own[i]
    y = y + torch.einsum("clhn,chpn->clhp", C, torch.stack(starts)) * torch.exp(a_cum).transpose(1, 2)[..., None]
    return y.reshape(-1, heads, head_dim)[:length] + D[:, None] * x, state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: out[..., l, s] = a[s+1] + ... + a[l] for l >= s, -inf for l < s."""
    q = a.shape[-1]
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, q).masked_fill(~below, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(q, q, dtype=torch.bool, device=a.device).tril(), -math.inf)


def mamba2_weight_slots(mixer: Mamba2Mixer, prefix: str) -> dict[str, WeightSlot]:
    """{Hugging Face name: WeightSlot} for one mixer whose checkpoint tensors are `prefix` + name
    (e.g. "model.layers.3.mamba."), each taking this rank's part."""
    c, s = mixer.config, mixer.shard
    p, n, inter = c.head_dim, c.state_size, c.intermediate_size
    heads = range(s.heads.start * p, s.heads.stop * p)  # the rank's rows of z, x, the norm and out_proj's columns
    b_rows = range(s.groups.start * n, s.groups.stop * n)
    conv_rows = [*heads, *(inter + r for r in b_rows), *(inter + c.n_groups * n + r for r in b_rows)]
    in_rows = [*heads, *(inter + r for r in conv_rows), *(inter + c.conv_dim + h for h in s.heads)]
    in_total = inter + c.conv_dim + c.num_heads
    slots = {
        "in_proj.weight": _rows_slot(mixer.in_proj.weight, in_rows, in_total),
        "conv1d.weight": _rows_slot(mixer.conv_weight, conv_rows, c.conv_dim),
        "dt_bias": _rows_slot(mixer.dt_bias, list(s.heads), c.num_heads),
        "A_log": _rows_slot(mixer.A_log, list(s.heads), c.num_heads),
        "D": _rows_slot(mixer.D, list(s.heads), c.num_heads),
        "norm.weight": _rows_slot(mixer.norm_weight, list(heads), inter),
        "out_proj.weight": WeightSlot(mixer.out_proj.weight, 0, c.hidden_size,
                                      (1, heads.start, len(heads), inter)),
    }
    if mixer.in_proj.bias is not None:
        slots["in_proj.bias"] = _rows_slot(mixer.in_proj.bias, in_rows, in_total)
    if mixer.conv_bias is not None:
        slots["conv1d.bias"] = _rows_slot(mixer.conv_bias, conv_rows, c.conv_dim)
    if mixer.out_bias is not None:
        slots["out_proj.bias"] = whole(mixer.out_bias)
    return {prefix + name: slot for name, slot in slots.items()}


def _rows_slot(param: torch.Tensor, rows: list[int], total: int) -> WeightSlot:
    """The checkpoint rows `rows` (of `total`, dim 0, in this order) into the whole of `param`.
    A contiguous run narrows; anything else permutes the rank's rows to the front first."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return WeightSlot(param, 0, len(rows), None if len(rows) == total else (0, rows[0], len(rows), total))
    taken = set(rows)
    order = torch.tensor(rows + [r for r in range(total) if r not in taken])

    def front(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, order) if t.shape[0] == total else t
    return WeightSlot(param, 0, len(rows), (0, 0, len(rows), total), front)
