"""`kvbridge up` and `kvbridge up --ray` serve until Ctrl-C or SIGTERM on their main thread
(kvbridge/launcher/stop_signals.py). Two ways a stop signal was lost, each injected here into a
real process that waits as those commands do:

- started with SIGINT ignored (what a shell without job control does to `cmd &`, and what every
  child of such a process inherits): CPython then installs no KeyboardInterrupt handler, and
  `kill -INT` did nothing. A full-suite run started in the background hung
  tests/ray/test_up_ray.py for 300 s this way;
- the signal taken by a thread other than the main one (Ray's driver runs many): CPython only
  flags it, and a main thread in an untimed wait (`threading.Event().wait()`, what `up --ray` did)
  never ran the handler."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

WAITER = textwrap.dedent("""
    import signal, sys, threading, time
    from kvbridge.launcher.stop_signals import handle_stop_signals, wait_for_interrupt

    previous = handle_stop_signals()
    try:  # "waiting" is said from inside the try: a signal sent as soon as it is read is caught here
        if sys.argv[1] == "other-thread":
            sig = getattr(signal, sys.argv[2])
            threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(threading.get_ident(), sig)),
                             daemon=True).start()
        print("waiting", flush=True)
        wait_for_interrupt(poll_s=0.2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_taken_by_another_thread_interrupts_the_wait(sig: str) -> None:
    done = subprocess.run([sys.executable, "-c", WAITER, "other-thread", sig], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["waiting", "interrupted"], done.stdout + done.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_process_started_with_sigint_ignored_still_stops_on_it(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WAITER, "outside"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip() == "interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_off_the_main_thread_nothing_is_installed() -> None:
    import threading

    from kvbridge.launcher.stop_signals import handle_stop_signals

    before = signal.getsignal(signal.SIGINT)
    got: list[dict] = []
    t = threading.Thread(target=lambda: got.append(handle_stop_signals()))
    t.start()
    t.join(10)
    assert got == [{}] and signal.getsignal(signal.SIGINT) is before
