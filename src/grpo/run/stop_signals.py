"""SIGINT and SIGTERM during training: the first stops the loop after the current step, with a
checkpoint; a second stops it at once."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class Interrupted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: training stopped at once, without a checkpoint of this step."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM, while training: the first asks the loop to stop at the next step's end
    (`signum`), a second stops it at once. Handlers are installed only in the main thread
    (Python allows no other) and the previous ones put back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank gets it: rank 0 says so
            return
        # os.write: no print's locks inside a signal handler
        os.write(
            2,
            f"\ngrpo: {signal.Signals(signum).name} received: stopping after this step with a checkpoint "
            "(send it again to stop at once)\n".encode(),
        )

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
