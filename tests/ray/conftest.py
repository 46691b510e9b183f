"""tests/ray: Ray must bind loopback only, in this process and in every process it starts (Ray
turns 127.0.0.1 into this host's routable address unless its single-machine mode is on, read when
ray is first imported: kvbridge/ray/app.py, start_local_ray)."""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The machine's memory is shared with other work: Ray's own OOM killer, which judges the whole
# host's usage, would kill the replicas under test for memory others use.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
