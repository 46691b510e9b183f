"""`kvbridge up --ray` serves until Ctrl-C or SIGTERM (kvbridge/ray/app.py, run_up). The kernel
hands a process-directed signal to any thread that does not block it, and Ray's driver has many
threads: when the signal lands on one of them, CPython only flags it, and a main thread blocked
in an untimed wait (`threading.Event().wait()`, what run_up did) never returns to run the handler.
`kvbridge up --ray` then ignored Ctrl-C for good (a full-suite run of tests/ray/test_up_ray.py
waited 300 s for it to exit after SIGINT). wait_for_interrupt wakes every `poll_s`, so a signal
taken by any thread interrupts it within that time. The test delivers the signal to a thread
other than the main one, which is the case that hung."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    from kvbridge.ray.app import wait_for_interrupt

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sig = getattr(signal, sys.argv[1])
    ready = threading.Event()

    def other_thread():
        ready.wait()
        time.sleep(0.2)  # the main thread is inside the wait by now
        signal.pthread_kill(threading.get_ident(), sig)  # taken by this thread, not the main one

    threading.Thread(target=other_thread, daemon=True).start()
    ready.set()
    try:
        wait_for_interrupt(poll_s=0.2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_taken_by_another_thread_interrupts_the_wait(sig: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, sig], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done.stdout + done.stderr
