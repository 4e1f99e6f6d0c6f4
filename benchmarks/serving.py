"""`grpo serve` for a benchmark: started in a process of its own, its output in a log file (a pipe
nobody reads would fill and stall the server), its address read from that log, stopped at the end.

    with served(config, ["--engine", "hf"], env, core=0) as url:
        ...   # grpo train ... rollout.engine=server rollout.server.url={url}
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_SECONDS = 900
"""How long a server may take to start (a model converted the first time, kernels built)."""
ADDRESS = re.compile(r"at (http://127\.0\.0\.1:(\d+));")


def pinned(core: int | None) -> list[str]:
    """`taskset -c core` where taskset is there and a core is named."""
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


@contextlib.contextmanager
def served(
    config: Path, arguments: list[str], env: dict[str, str], core: int | None = None
) -> Iterator[str]:
    """The URL of `grpo serve config --port 0 *arguments` (under `taskset -c core`), running
    until the block ends."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [*pinned(core), sys.executable, "-m", "grpo", "serve", str(config)]
                + ["--port", "0", *arguments],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            yield _address(server, log_path)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _address(server: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        found = ADDRESS.search(log_path.read_text())
        if found:
            return found.group(1)
        if server.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"grpo serve did not start:\n{log_path.read_text()[-2000:]}")
