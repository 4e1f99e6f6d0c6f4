"""A run's hold on its output_dir (grpo.run.run_lock), the same on every rank.

Rank 0 checks that the directory may be written into (`check_claimable`: nothing is written
into a directory that is not a run unless asked to) and claims it (created, checked writable,
locked against another run); every rank fails with rank 0's refusal, so no rank waits on
another. The claim comes before anything in the directory is read or changed; a start that
fails abandons it (removing the directory if the claim created it and it holds nothing), a
finished run releases it.
"""

from __future__ import annotations

from grpo.config.errors import ConfigError
from grpo.run import run_lock
from grpo.run.run_lock import RunLock


class OutputDir:
    """The claim on `cfg.output_dir` of one run."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend
        self.lock: RunLock | None = None
        """Rank 0's lock; None on the other ranks."""
        self.held = False
        """Whether the run holds output_dir (on every rank)."""

    def claim(self) -> None:
        """Rank 0 claims output_dir; every rank fails with its refusal, if any."""
        refusal = None
        if self.backend.is_main:
            try:
                # nothing is written into a directory that is not a run unless asked to
                run_lock.check_claimable(self.cfg.output_dir, self.cfg.overwrite_output_dir)
                self.lock = run_lock.claim(self.cfg.output_dir)
            except ConfigError as error:
                refusal = error
        # no rank waits on another
        said = self.backend.all_gather_object(None if refusal is None else str(refusal))[0]
        if refusal is not None:
            raise refusal
        if said is not None:
            raise ConfigError(said)
        self.held = True

    def release(self) -> None:
        """The run is over: the directory is free for another."""
        if self.lock is not None:
            self.lock.release()
        self.held = False

    def abandon(self) -> None:
        """After a failed start: released, and the directory removed if the claim created it and
        it holds nothing but the lock file."""
        if self.lock is not None:
            self.lock.abandon()
