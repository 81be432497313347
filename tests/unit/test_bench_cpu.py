"""bench._cpu: CPU seconds of a process tree, including children that exit before the end."""

from __future__ import annotations

import subprocess
import sys
import time

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench._cpu import CpuSampler  # noqa: E402

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_counts_children_that_exit_before_stop() -> None:
    sampler = CpuSampler(interval_s=0.05)
    sampler.start()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.6)], check=True)
    time.sleep(0.1)
    used = sampler.stop()
    # the child burnt 0.6 s of CPU; its last sample came at most one interval (0.05 s) early
    assert 0.45 <= used["total_s"] <= 5.0
    assert sum(used["by_process"].values()) <= used["total_s"] + 0.05
