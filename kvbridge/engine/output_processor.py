"""Turns finished steps into RequestOutputs: incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.engine.outputs import RequestOutput, TokenLogprob
from kvbridge.engine.request import FinishReason, Request
from kvbridge.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvbridge.stop_strings import stop_holdback

# A request ended before its prompt was computed (aborted, failed) has fewer prompt logprobs.
_CUT_SHORT = (FinishReason.ABORT, FinishReason.ERROR)


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    text: str = ""  # all text produced so far (before stop-string truncation)
    emitted_chars: int = 0
    emitted_tokens: int = 0
    pushed_tokens: int = 0  # output tokens already given to the detokenizer
    stopped: str | None = None  # the stop string that ended the request
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, continued: Sequence[int] = (), stops: tuple[str, ...] = ()) -> None:
        """Start a request's stream. `continued`: output tokens it starts with, sampled and sent
        by another instance (a prefill's first token): their text counts for stop strings, and
        what a stream would have emitted after them (streamed_text) is never emitted again."""
        st = _Stream(IncrementalDetokenizer(self.tokenizer))
        for tok in continued:
            st.text += st.detok.push(tok)
        st.pushed_tokens = st.emitted_tokens = len(continued)
        st.emitted_chars = len(st.text) - stop_holdback(st.text, stops)
        self._streams[request_id] = st

    def has_stream(self, request_id: str) -> bool:
        """The request is live here: its final output has not been made yet."""
        return request_id in self._streams

    def discard(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def detokenize(self, req: Request) -> str | None:
        """Detokenise the request's new tokens; return a stop string that now appears, if any
        (the text is then cut before it, or after it with include_stop_str_in_output)."""
        st = self._streams[req.request_id]
        sp = req.sampling_params
        # as vLLM: stop strings count only once more than min_tokens tokens were generated
        stops = sp.stop if len(req.output_token_ids) > sp.min_tokens else ()
        start_search = max(0, len(st.text) - max((len(s) for s in stops), default=0))
        for tok in req.output_token_ids[st.pushed_tokens:]:
            st.text += st.detok.push(tok)
        st.pushed_tokens = len(req.output_token_ids)
        if req.status.is_finished:
            st.text += st.detok.flush()  # a character cut off by the end is still emitted (as U+FFFD)
        for s in stops:
            idx = st.text.find(s, start_search)
            if idx >= 0:
                keep = idx + len(s) if req.sampling_params.include_stop_str_in_output else idx
                st.text = st.text[:keep]
                st.stopped = s
                return s
        return None

    def make_output(self, req: Request, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        st = self._streams[req.request_id]
        new_ids = req.output_token_ids[st.emitted_tokens:]
        st.emitted_tokens = len(req.output_token_ids)
        finished = req.status.is_finished
        # Hold back text that could be the start of a stop string until it is decided.
        hold = 0 if finished else stop_holdback(st.text, req.sampling_params.stop)
        new_text = st.text[st.emitted_chars:len(st.text) - hold]
        st.emitted_chars += len(new_text)
        prompt_logprobs = None
        if req.wants_prompt_logprobs and not st.prompt_logprobs_sent and (new_ids or finished):
            st.prompt_logprobs_sent = True
            if len(req.prompt_logprobs) != req.num_prompt_tokens and req.finish_reason not in _CUT_SHORT:
                raise RuntimeError(f"{len(req.prompt_logprobs)} prompt logprobs for {req.num_prompt_tokens} "
                                   "prompt tokens")
            prompt_logprobs = list(req.prompt_logprobs)
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), num_loaded_tokens=req.num_loaded_tokens,
            num_reused_tokens=req.num_reused_tokens,
            logprobs=logprobs,
            kv_transfer_params=req.kv_transfer_params_out if finished else None,
            error=req.error, stop_reason=st.stopped if st.stopped is not None else req.stop_reason,
            error_code=req.error_code, times=req.times if finished else None, prompt_logprobs=prompt_logprobs)
        if finished:
            self.discard(req.request_id)
        return out
