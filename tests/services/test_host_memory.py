"""Freed heap memory handed back to the OS: what `release_free_heap` does for the learner."""

from __future__ import annotations

from pathlib import Path

from services.host_memory import release_free_heap

BLOCK = 1_000  # bytes: above Python's small-object limit, so each block is glibc's malloc
BLOCKS = 200_000  # about 200 MB
KEEP_EVERY = 64  # one kept block in every ~64 KB pins that stretch of the heap in place


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_free_memory_between_live_blocks_goes_back_to_the_os() -> None:
    blocks = [bytearray(BLOCK) for _ in range(BLOCKS)]
    kept = blocks[::KEEP_EVERY]
    del blocks  # ~98% freed, but scattered between kept blocks: glibc keeps it all mapped
    held = rss_mib()
    assert release_free_heap()
    released = held - rss_mib()
    assert released > 100, f"{released:.0f} MiB released of ~190 MiB freed"
    assert all(len(block) == BLOCK for block in kept)  # the live blocks are untouched
