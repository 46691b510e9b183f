"""How `kvbridge up` and `kvbridge up --ray` wait for Ctrl-C or SIGTERM on their main thread.

Two ways a stop signal used to be lost:

- **Inherited SIG_IGN.** A shell without job control starts a background command (`cmd &`) with
  SIGINT ignored, and CPython installs its KeyboardInterrupt handler at start-up only where SIGINT
  is not ignored: such a `kvbridge up --ray` (or one started by a process that was) ignored
  `kill -INT` for good. `handle_stop_signals` installs the handler for SIGINT and SIGTERM
  explicitly, as uvicorn does for `kvbridge serve`.
- **A signal taken by another thread.** The kernel hands a process-directed signal to any thread
  that does not block it (Ray's driver runs many); CPython then only flags it, and the handler runs
  when the main thread next executes Python code, which an untimed wait (`Event().wait()`) never
  does. `wait_for_interrupt` wakes every `poll_s`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def handle_stop_signals() -> dict[int, Callable[..., Any] | int | None]:
    """On the main thread: SIGINT and SIGTERM raise KeyboardInterrupt from now on. Returns the
    handlers they had (to restore), or {} off the main thread, where signal.signal cannot be used."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    return previous


def ignore_stop_signals(previous: dict[int, Callable[..., Any] | int | None]) -> None:
    """During a cleanup: a second Ctrl-C must not cut it (for the signals handle_stop_signals took)."""
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)


def restore_stop_signals(previous: dict[int, Callable[..., Any] | int | None]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def wait_for_interrupt(poll_s: float = 1.0) -> None:
    """Block until KeyboardInterrupt is raised in this, the main, thread (see the module's doc)."""
    while True:
        time.sleep(poll_s)
