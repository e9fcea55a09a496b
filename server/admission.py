"""Admission control: a new stream is refused while the engines have no headroom, rather than every stream slowing
down together past capacity.

The signal is measured, not a fixed count: the engine pool's `headroom` (qasr.engine.pool: the p90 latency of recent
finals, submit to result, against the latency target, and the decode rows in use; 1 idle, 0 at the target, below 0
past it). Refusing is the first response to load; thinning partials (the pool's) comes only past the target, since
it breaks the partial cadence.
With hysteresis so it does not flap: refusing starts once the headroom is 0 or less, and stops only once it is back
to `resume_headroom`. Refused: at the handshake HTTP 503 with Retry-After (a load balancer retries another replica);
on a socket already upgraded, 1013 `server_full` whose error message ends with "retry after N s". Streams already
admitted are never cut. An engine that reports no headroom (not a pool) is never refused on it.

    admission = Admission(AdmissionSettings())
    if not admission.admits(engine.stats()): refuse(admission.refusal, retry_after_s=admission.retry_after_s)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("qasr.server")


@dataclass(frozen=True)
class AdmissionSettings:
    enabled: bool = True  # qasr-server --admission-target-ms 0 turns it off
    resume_headroom: float = 0.2  # refusing stops once the headroom is back to this (it starts at 0)
    retry_after_s: int = 2  # what a refused client is told to wait: about how fast the signal's window moves

    def __post_init__(self):
        if not 0 < self.resume_headroom <= 1:
            raise ValueError(f"resume_headroom must be in (0, 1], got {self.resume_headroom}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")


class Admission:
    """Whether a new stream may start now. On the event loop only."""

    def __init__(self, settings: AdmissionSettings = AdmissionSettings()):
        self.settings = settings
        self.refusing = False

    @property
    def retry_after_s(self) -> int:
        return self.settings.retry_after_s

    @property
    def refusal(self) -> str:
        """What a refused client is told (the 503's body; the `server_full` error's message)."""
        return (f"the server is at its latency target and takes no new stream now: retry after "
                f"{self.settings.retry_after_s} s")

    def admits(self, engine_stats: dict) -> bool:
        headroom = engine_stats.get("headroom")
        if not self.settings.enabled or headroom is None:
            return True
        if self.refusing and headroom >= self.settings.resume_headroom:
            self.refusing = False
            log.warning("admitting new streams again (engine headroom %.2f)", headroom)
        elif not self.refusing and headroom <= 0:
            self.refusing = True
            log.warning("refusing new streams: the engines have no headroom (%.2f) at their latency target",
                        headroom)
        return not self.refusing
