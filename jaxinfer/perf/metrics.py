"""Per-request latency metrics (docs/architecture.md, decision 10): TTFT, TPOT, ITL, end-to-end.

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
    prompt_computed: int = 0  # prompt token rows computed (again after a preemption)
    prompt_reused: int = 0  # prompt token rows taken from the prefix cache
    num_preemptions: int = 0
    spec_drafted: int = 0  # draft tokens verified for this request (speculative decoding)
    spec_accepted: int = 0  # ... and accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None without speculation."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else None

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
            "prompt_computed": self.prompt_computed, "prompt_reused": self.prompt_reused,
            "num_preemptions": self.num_preemptions,
        }


PERCENTILES = (50, 90, 99)


def serving_summary(metrics: list[RequestMetrics], num_prompt_tokens: list[int],
                    duration_s: float) -> dict[str, float]:
    """Benchmark summary with `vllm bench serve`'s names and definitions.

    TTFT: arrival -> first token. TPOT: (e2e - ttft) / (output tokens - 1), per request with more
    than one token. ITL: every gap between consecutive tokens of a request, pooled. E2EL: arrival
    -> last token. Throughputs are over `duration_s` (the benchmark's wall time). Each latency
    gets mean, median (p50), p90 and p99, in milliseconds.
    """
    done = [m for m in metrics if m.token_times]
    out_tokens = sum(len(m.token_times) for m in done)
    in_tokens = sum(num_prompt_tokens)
    summary = {
        "completed": len(done), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "input_throughput": in_tokens / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    series = {
        "ttft": [m.ttft for m in done],
        "tpot": [m.tpot for m in done if len(m.token_times) > 1],
        "itl": [x for m in done for x in m.itl],
        "e2el": [m.e2e for m in done],
    }
    for name, values in series.items():
        ms = np.asarray(values, np.float64) * 1e3
        summary[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else float("nan")
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = (float(np.percentile(ms, q)) if ms.size
                                          else float("nan"))
    return summary
