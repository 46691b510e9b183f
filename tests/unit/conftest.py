"""Fixtures of the unit tests that several modules use."""

from __future__ import annotations

import pytest

from kvbridge.launcher import cluster


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of each run_cluster call `kvbridge up` makes."""
    calls: list[dict] = []
    monkeypatch.delenv("KVBRIDGE_API_KEY", raising=False)
    monkeypatch.setattr(cluster, "run_cluster", lambda **kwargs: calls.append(kwargs) or 0)
    return calls
