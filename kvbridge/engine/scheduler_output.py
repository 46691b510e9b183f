"""The contracts between scheduler and model runner, one object per direction per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbridge.engine.kv_tier import TierReport, TierWork
from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.connector.base import KVConnectorOutput
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata
from kvbridge.kv_transfer.connector.rank_agent import RankCommands, RankReport
from kvbridge.kv_transfer.params import BlockIds


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # absolute position of token_ids[0]
    block_ids: BlockIds  # all of the request's blocks, one list per KV cache group
    sample: bool  # this step reaches the request's last known token: sample the next one
    sampling_params: SamplingParams
    num_output_tokens: int  # output tokens so far (seeds the per-request generator offset)
    # With `sample` and a repetition penalty: the prompt's and output's tokens, which the penalty discourages.
    penalty_token_ids: tuple[int, ...] = ()
    # Prompt logprobs (Request.prompt_logprob_targets): rows from `prompt_logprob_row` on give
    # the logprobs of these prompt tokens.
    prompt_logprob_row: int = 0
    prompt_logprob_targets: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str]  # requests that ended since the last step; the runner drops their state
    kv_connector_metadata: ConnectorMetadata | None = None  # from the scheduler connector, for the worker half
    kv_rank_commands: list[RankCommands] | None = None  # one per TP rank, from the worker connector
    # Structured output: per request sampling this step, its next token's allowed ids (engine/structured.py)
    grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_tier: TierWork | None = None  # the KV tier's stores and loads, before anything of the step writes KV

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    sampling_errors: dict[str, str] = field(default_factory=dict)  # request id -> why it got no token
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # this step's, per request
    kv_rank_reports: list[RankReport] = field(default_factory=list)  # of each rank with an agent
    kv_connector_output: KVConnectorOutput | None = None  # the worker connector's reading of the reports
    kv_tier_report: TierReport | None = None  # what the ranks did with SchedulerOutput.kv_tier (merged)
