"""What a process-isolated tool call's memory limit (grpo.rollout.tool_memory) costs and holds.

    python benchmarks/tool_memory.py [--rounds 60]

Three ways to run a forked call of a tool that returns at once, alternated round by round:
its cgroup and RLIMIT_DATA (what grpo does as root with writable cgroups), RLIMIT_DATA alone
(the fallback), and no limit (rollout.tool_memory_mb: 0); the median wall time of one call
and of a batch of 8 (one ToolRunner.run). Then what each limit lets a call with a 32 MiB limit
write, 1 MiB at a time, when the trainer's heap holds 200 MiB it freed (glibc keeps it mapped).
The cgroup rows need root and a writable cgroup hierarchy.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

from grpo.rollout import tool_memory
from grpo.rollout.tools import ToolCall, ToolRunner, as_tool


def echo(x: int) -> str:
    """Returns x.

    Args:
        x: A number.
    """
    return str(x)


def hog(mib: int) -> str:
    """Holds `mib` MiB, written to, one MiB at a time.

    Args:
        mib: How many MiB.
    """
    held = [bytearray(1 << 20) for _ in range(mib)]
    return f"held {len(held)} MiB"


MODES = {  # name: (rollout.tool_memory_mb, with the cgroup)
    "cgroup + RLIMIT_DATA": (32, True),
    "RLIMIT_DATA alone": (32, False),
    "no limit": (0, False),
}


_usable = tool_memory.cgroups_usable


def _use(with_cgroup: bool) -> None:
    """The next calls with their cgroup (where one can be made) or without."""
    tool_memory.cgroups_usable = _usable if with_cgroup else (lambda: False)


def cost(rounds: int) -> None:
    tools = {"echo": as_tool(echo)}
    one = {mode: [] for mode in MODES}
    eight = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in list(MODES)[:: 1 if r % 2 == 0 else -1]:
            mb, with_cgroup = MODES[mode]
            _use(with_cgroup)
            runner = ToolRunner(tools, 10.0, 100, "process", memory_mb=mb)
            start = time.perf_counter()
            (result,) = runner.run([ToolCall("echo", {"x": 1})])
            one[mode].append(time.perf_counter() - start)
            assert result.content == "1", result
            start = time.perf_counter()
            results = runner.run([ToolCall("echo", {"x": i}) for i in range(8)])
            eight[mode].append(time.perf_counter() - start)
            assert [r.content for r in results] == [str(i) for i in range(8)], results
    print(f"| limit | one call (median ms) | 8 calls at once (median ms) |  ({rounds} rounds)")
    print("|---|---|---|")
    for mode in MODES:
        print(
            f"| {mode} | {statistics.median(one[mode]) * 1e3:.1f} "
            f"| {statistics.median(eight[mode]) * 1e3:.1f} |"
        )


def _data_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmData:"))


def hole() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
    before = _data_mib()
    libc.free(libc.malloc(16 << 20))  # glibc's mmap threshold past 16 MiB: what follows is heap
    chunks = [libc.malloc(5 << 18) for _ in range(320)]
    for chunk in chunks[::2]:
        libc.free(chunk)
    print(
        f"\nthe trainer's heap: {_data_mib() - before} MiB mapped, 200 of it freed; "
        "a call limited to 32 MiB writes 128 MiB, 1 MiB at a time:"
    )
    tools = {"hog": as_tool(hog)}
    for mode in ("cgroup + RLIMIT_DATA", "RLIMIT_DATA alone"):
        _use(MODES[mode][1])
        (result,) = ToolRunner(tools, 20.0, 200, "process", memory_mb=32).run(
            [ToolCall("hog", {"mib": 128})]
        )
        print(f"  {mode}: {result.content}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    print(f"cgroups for forked calls here: {_usable()} (euid {os.geteuid()})")
    if not _usable():
        del MODES["cgroup + RLIMIT_DATA"]
    cost(args.rounds)
    if _usable():
        hole()


if __name__ == "__main__":
    main()
