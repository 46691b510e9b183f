"""A kernel build killed mid-way (Ctrl-C at the first start, a test's timeout) leaves torch's
`lock` file in the build folder, and torch waits for that file to go before it even loads a
finished build: every later start hung, forever. kvbridge's builders take turns on an flock (the
OS drops it with its holder) and, holding it, remove the stale file. The kernels are built by
scripts/install.sh, so this loads the real build in a fresh process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from kvbridge.engine.layers import cpu_kernels
from kvbridge.engine.setup.cache_dir import default_cache_dir


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path) -> None:
    # A copy of the installed build in a cache of this test's own: an engine another test starts
    # at the same time loads the shared one, and would find (and remove) a stale lock left there.
    built = cpu_kernels.build_dir()
    directory = tmp_path / built.relative_to(default_cache_dir())
    shutil.copytree(built, directory, ignore=shutil.ignore_patterns("lock", "kvbridge-build.lock"))
    stale = directory / "lock"
    stale.touch()  # what torch's lock leaves when its builder is killed
    done = subprocess.run(
        [sys.executable, "-c", "from kvbridge.engine.layers import cpu_kernels; cpu_kernels.load()"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "KVBRIDGE_CACHE_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a kernel build that was killed" in done.stderr
    assert not stale.exists()


def test_other_kernel_sources_build_in_their_own_folder(tmp_path, monkeypatch) -> None:
    here = cpu_kernels.build_dir()
    changed = tmp_path / "paged_decode.cpp"
    changed.write_bytes(cpu_kernels.SOURCES[0].read_bytes() + b"\n// another version\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", [changed, *cpu_kernels.SOURCES[1:]])
    assert cpu_kernels.build_dir() != here and cpu_kernels.build_dir().parent == here.parent


def test_a_changed_header_builds_in_its_own_folder(tmp_path, monkeypatch) -> None:
    """The sources include csrc/*.h: another version of a header is another build, not the old one's."""
    here = cpu_kernels.build_dir()
    headers = sorted(p.name for p in (cpu_kernels.SOURCES[0].parent).glob("*.h"))
    assert sorted(h.name for h in cpu_kernels.HEADERS) == headers  # every header is in the identity
    changed = tmp_path / "vec_math.h"
    changed.write_bytes(cpu_kernels.HEADERS[0].read_bytes() + b"\n// another version\n")
    monkeypatch.setattr(cpu_kernels, "HEADERS", [changed, *cpu_kernels.HEADERS[1:]])
    assert cpu_kernels.build_dir() != here and cpu_kernels.build_dir().parent == here.parent
