"""What this machine offers the mesh: memory, cores and a measured compute speed.

The speed is measured (a short float32 matrix product), not read from a datasheet: the planner
compares nodes by what they actually deliver under their current load.
"""

from __future__ import annotations

import os
import time

import numpy as np

from meshllm.mesh.records import Capacity

BENCH_N = 256
BENCH_REPEATS = 5


def total_ram_bytes() -> int:
    """Physical memory in bytes (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_gflops(n: int = BENCH_N, repeats: int = BENCH_REPEATS) -> float:
    """Best-of-``repeats`` float32 ``n x n`` matmul speed in GFLOP/s (about 10 ms in all)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return round(2 * n**3 / max(best, 1e-9) / 1e9, 2)


def measure_capacity() -> Capacity:
    """This machine's capacity for its peer record."""
    return Capacity(ram_bytes=total_ram_bytes(), vram_bytes=0, cpu_cores=os.cpu_count() or 1,
                    gflops=measure_gflops())
