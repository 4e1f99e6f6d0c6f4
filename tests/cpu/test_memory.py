import os
import platform
import subprocess
import sys

from grpo.config import loading as config
from grpo.cpu.memory import release_free_memory, use_huge_pages


def test_release_free_memory_reports_whether_it_can_trim():
    """True exactly where malloc_trim exists (glibc on Linux), False elsewhere; never raises.
    Its effect on a training step's peak is measured in docs/performance.md."""
    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_memory() is expected


def test_importing_grpo_leaves_the_environment_alone():
    """A library must not set its caller's environment: importing grpo (the trainer, the CPU layer)
    leaves THP_MEM_ALLOC_ENABLE unset; use_huge_pages sets it, and keeps a value the user gave."""
    code = (
        "import os, grpo, grpo.training.trainer, grpo.cpu.layer\n"
        "assert 'THP_MEM_ALLOC_ENABLE' not in os.environ\n"
        "from grpo.cpu.memory import use_huge_pages\n"
        "use_huge_pages()\n"
        "assert os.environ['THP_MEM_ALLOC_ENABLE'] == '1'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_the_cli_asks_for_huge_pages_only_with_the_cpu_layer(monkeypatch):
    from grpo import cli

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    cli._before_torch(config.from_dict({}, ["cpu.enabled=false"]))
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
    cli._before_torch(config.from_dict({}))
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the user's own setting stands
    use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
