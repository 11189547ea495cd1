"""Per-request latency metrics (DESIGN.md decision 10): TTFT, TPOT, ITL, end-to-end.

Times are host `time.perf_counter()` seconds taken when a token reaches the host, i.e. after the
device work that produced it has finished.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
    arrival: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (seconds) between consecutive generated tokens."""
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    def as_dict(self) -> dict:
        itl = self.itl
        return {
            "ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e,
            "num_tokens": len(self.token_times),
            "itl_p50_s": float(np.median(itl)) if itl else None,
            "itl_p99_s": float(np.percentile(itl, 99)) if itl else None,
        }
