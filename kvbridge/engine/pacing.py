"""How soon the engine's next step is due, and how a loop that steps it waits: the one place.

`LLMEngine.step()` never sleeps. It answers with a `NextStep`, decided by `next_step` from what
the step did and from one answer of the connector's worker half (its WorkerStatus):

    NOW   the step computed tokens or made outputs, or commands wait to ride the next step to
          the ranks (reads D planned after the ranks ran): step again at once;
    SOON  KV transfers are in flight that complete only while this engine polls (loads on D,
          watched reads of its blocks on P): step again after a short wait;
    IDLE  nothing moved: back off while work is pending (leases held, a load waiting for its
          handshake), wait for a request or a wake-up while none is.

A loop maps the answers to waits with a `Pacer` (the async engine's thread, `LLMEngine.generate`,
the benchmarks); every constant that tunes the pace is below.
"""

from __future__ import annotations

import enum
import time

from kvbridge.kv_transfer.connector.base import WorkerStatus

# SOON: the wait between polls while transfers are in flight; IDLE with work pending: the first wait,
# doubling up to BACKOFF_MAX_S. Short against a forward pass, long enough not to burn a core while
# a transfer runs; the cap bounds how late an idle P notices a lease to expire or D a handshake's answer.
BACKOFF_MIN_S = 0.0005
BACKOFF_MAX_S = 0.01
# IDLE with no work pending: the loop sleeps on its command queue, and re-checks the engine this
# often anyway (work may appear without a command, e.g. from a connector).
IDLE_WAIT_S = 1.0


class NextStep(enum.Enum):
    NOW = "now"
    SOON = "soon"
    IDLE = "idle"


def next_step(made_progress: bool, worker: WorkerStatus | None) -> NextStep:
    """The decision. `made_progress`: the step scheduled tokens or made outputs; `worker`: the
    worker half's status after the step (None: no connector)."""
    if made_progress or (worker is not None and worker.rank_commands_waiting):
        return NextStep.NOW
    if worker is not None and worker.transfers_in_flight:
        return NextStep.SOON
    return NextStep.IDLE


class Pacer:
    """Turns a loop's sequence of NextStep answers into waits: NOW 0, SOON BACKOFF_MIN_S, IDLE a
    back-off from BACKOFF_MIN_S doubling to BACKOFF_MAX_S (any NOW starts it over). With no work
    pending at all the loop waits IDLE_WAIT_S, or until a command comes (`wait_s(busy=False)`)."""

    def __init__(self) -> None:
        self._backoff = 0.0

    def after(self, due: NextStep) -> float:
        """The wait before the next step, given the last step's answer."""
        if due is NextStep.NOW:
            self._backoff = 0.0
        elif due is NextStep.SOON:
            self._backoff = BACKOFF_MIN_S
        else:
            self._backoff = min(max(2 * self._backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
        return self._backoff

    def wait_s(self, busy: bool) -> float:
        """How long a loop waits for a command before stepping: the back-off while the engine has
        work pending (`busy`), IDLE_WAIT_S while it has none."""
        return self._backoff if busy else IDLE_WAIT_S

    def sleep_after(self, due: NextStep) -> None:
        """For a loop with no command queue (LLMEngine.generate, benchmarks): sleep the wait."""
        wait = self.after(due)
        if wait > 0:
            time.sleep(wait)
