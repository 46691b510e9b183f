"""Session fixtures that stop right after the last test using them (tests/e2e/conftest.py,
tests/ray/conftest.py): each conftest notes, once the session is collected, which test is the last
to use each of its shared fixtures, in the order pytest runs them."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def last_users(items: Iterable[pytest.Item], names: Iterable[str]) -> dict[str, str]:
    """name -> the node id of the last item using that fixture (item.fixturenames holds the
    fixtures it uses through others too)."""
    names = tuple(names)
    last: dict[str, str] = {}
    for item in items:
        for name in names:
            if name in getattr(item, "fixturenames", ()):
                last[name] = item.nodeid
    return last
