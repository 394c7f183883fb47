"""The faults config.faults describes, struck on the rank they name: the rank loop calls
`after_step` once as it starts (step 0) and after every step that ran a forward."""

from __future__ import annotations

import os
import signal
import time

DROP_NAP_S = 1.0  # a rank whose messages are dropped naps this long at a time until it is stopped


class RankFaults:
    def __init__(self, injection, rank: int):
        self.faults = injection.on_rank(rank) if injection is not None else []
        self.steps = 0

    def __bool__(self) -> bool:
        return bool(self.faults)

    def after_step(self, ran: bool = True) -> None:
        """Count a step that ran (not the call at the start), then strike what is due."""
        if ran:
            self.steps += 1
        for f in self.faults:
            if self.steps < f.step:
                continue
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "delay" and ran:
                time.sleep(f.ms / 1000)
            elif f.kind == "drop":
                while True:  # alive and beating, but nothing more goes out: the peers wait on it
                    time.sleep(DROP_NAP_S)
