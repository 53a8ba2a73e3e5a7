"""Python's thread switch interval, shortened while an ``Evaluator`` that asks for it runs
(``Evaluator(switch_interval=...)``)."""

from __future__ import annotations

import sys
import threading
from typing import Optional

__all__ = ["SWITCH_INTERVAL", "SwitchInterval"]


class SwitchInterval:
    """Python's thread switch interval, shortened while any Evaluator that asked for it runs.

    Every torch call of the launch stage lets go of the GIL and takes it back; while another
    thread of the process runs Python (the finish stage's loops, the workers' answers unpickled, the
    caller's own threads), taking it back can wait a whole switch interval (5 ms by default),
    and a launch makes three such calls a batch.  A shorter interval bounds each wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: Optional[float] = None

    def shorten(self, seconds: float) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                if seconds < self._saved:
                    sys.setswitchinterval(seconds)
            self._users += 1

    def restore(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


SWITCH_INTERVAL = SwitchInterval()
