"""The engine's pace (engine/pacing.py), exhaustively: next_step's answer for every combination of
what a step did and what the worker half says, and the waits a Pacer makes of a sequence of
answers (the back-off doubles from BACKOFF_MIN_S to BACKOFF_MAX_S, any NOW starts it over, SOON
polls at the minimum, a loop with nothing pending waits IDLE_WAIT_S for a command)."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.engine import pacing
from kvbridge.engine.pacing import NextStep, Pacer, next_step
from kvbridge.kv_transfer.connector.base import WorkerStatus


@pytest.mark.parametrize(("progress", "commands", "in_flight", "has_work"),
                         list(itertools.product([False, True], repeat=4)))
def test_next_step_for_every_combination(progress: bool, commands: bool, in_flight: bool, has_work: bool) -> None:
    status = WorkerStatus(rank_commands_waiting=commands, transfers_in_flight=in_flight, has_work=has_work,
                          leases_held=3 if has_work else 0)
    want = NextStep.NOW if progress or commands else NextStep.SOON if in_flight else NextStep.IDLE
    assert next_step(progress, status) is want


@pytest.mark.parametrize("progress", [False, True])
def test_without_a_connector_only_progress_counts(progress: bool) -> None:
    assert next_step(progress, None) is (NextStep.NOW if progress else NextStep.IDLE)


def test_idle_backs_off_doubling_to_the_cap_and_now_starts_it_over() -> None:
    pacer = Pacer()
    waits = [pacer.after(NextStep.IDLE) for _ in range(12)]
    assert waits[0] == pacing.BACKOFF_MIN_S
    assert all(b == min(2 * a, pacing.BACKOFF_MAX_S) for a, b in zip(waits, waits[1:]))
    assert waits[-1] == pacing.BACKOFF_MAX_S
    assert pacer.wait_s(busy=True) == pacing.BACKOFF_MAX_S
    assert pacer.after(NextStep.NOW) == 0.0 and pacer.wait_s(busy=True) == 0.0
    assert pacer.after(NextStep.IDLE) == pacing.BACKOFF_MIN_S


def test_soon_polls_at_the_minimum_whatever_came_before() -> None:
    pacer = Pacer()
    for _ in range(8):
        pacer.after(NextStep.IDLE)
    assert pacer.after(NextStep.SOON) == pacing.BACKOFF_MIN_S
    assert pacer.after(NextStep.IDLE) == 2 * pacing.BACKOFF_MIN_S


def test_a_loop_with_nothing_pending_waits_for_a_command() -> None:
    pacer = Pacer()
    pacer.after(NextStep.IDLE)
    assert pacer.wait_s(busy=False) == pacing.IDLE_WAIT_S
    assert pacing.BACKOFF_MIN_S < pacing.BACKOFF_MAX_S < pacing.IDLE_WAIT_S


def test_sleep_after_now_does_not_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", slept.append)
    pacer = Pacer()
    pacer.sleep_after(NextStep.NOW)
    pacer.sleep_after(NextStep.IDLE)
    pacer.sleep_after(NextStep.IDLE)
    assert slept == [pacing.BACKOFF_MIN_S, 2 * pacing.BACKOFF_MIN_S]
