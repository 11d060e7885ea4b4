"""A program's stop as a signal: the first stop signal is kept (it says why the program stops) and sets an
event the program's loops wait on; later ones are only logged.

One owner for this, because two programs stop this way: an extra rollout job's node program
(:mod:`beam_hpc.elastic.extra_node`) and the outside worker it may be started as
(:mod:`beam_hpc.backends.reference.rollouts.outside_worker`). ``USR1`` is Slurm's early warning (walltime lead,
preemption grace), ``TERM`` the end itself or a plain ``scancel``, ``USR2``/``INT`` a user's removal.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from beam_hpc.logging_setup import module_logger

log = module_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Stopper:
    """The program's stop: ``event`` is set by the first stop signal, whose number is kept in ``signal``."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
            log.info("signal %d: stopping", signum)
        else:
            log.info("signal %d: already stopping (on signal %d)", signum, self.signal)
        self.event.set()

    def install(self) -> None:
        """Handle every stop signal in this process (call from the main thread)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
