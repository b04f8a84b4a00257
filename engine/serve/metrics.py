"""Prometheus text exposition of the generation engine's counters (no client library needed for a dozen
series; the format is https://prometheus.io/docs/instrumenting/exposition_formats/)."""

from __future__ import annotations

import threading

from engine.serve.generate import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative histogram with fixed buckets, as Prometheus expects."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.total += 1
            self.sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        with self._lock:
            out = [
                f'{name}_bucket{{{labels},le="{b}"}} {c}'
                for b, c in zip(self.buckets, self.counts, strict=True)
            ]
            out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.total}')
            out.append(f"{name}_sum{{{labels}}} {self.sum}")
            out.append(f"{name}_count{{{labels}}} {self.total}")
        return out


class ServerMetrics:
    """Collects what /metrics shows: engine gauges and counters plus the HTTP-level request counts."""

    def __init__(self, stats: EngineStats, model_name: str):
        self.stats = stats
        self.model_name = model_name
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.per_token = Histogram(TPOT_BUCKETS)
        self.http_requests: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.http_requests[(route, status)] = self.http_requests.get((route, status), 0) + 1

    def render(self) -> str:
        s = self.stats
        # The engine thread appends; observations move into the histograms here.
        for queue_, hist in ((s.ttft, self.ttft), (s.e2e, self.e2e), (s.per_token, self.per_token)):
            while queue_:
                hist.observe(queue_.popleft())
        lbl = f'model_name="{self.model_name}"'
        lines = [
            "# HELP ernie_num_requests_running Requests in the running decode batch.",
            "# TYPE ernie_num_requests_running gauge",
            f"ernie_num_requests_running{{{lbl}}} {s.running}",
            "# HELP ernie_num_requests_waiting Requests queued for a free batch slot.",
            "# TYPE ernie_num_requests_waiting gauge",
            f"ernie_num_requests_waiting{{{lbl}}} {s.waiting}",
            "# HELP ernie_generation_tokens_per_second Generated tokens per second over the last 10 s.",
            "# TYPE ernie_generation_tokens_per_second gauge",
            f"ernie_generation_tokens_per_second{{{lbl}}} {s.tokens_per_second():.3f}",
            "# HELP ernie_prompt_tokens_total Prompt tokens prefilled.",
            "# TYPE ernie_prompt_tokens_total counter",
            f"ernie_prompt_tokens_total{{{lbl}}} {s.prompt_tokens_total}",
            "# HELP ernie_generation_tokens_total Tokens generated.",
            "# TYPE ernie_generation_tokens_total counter",
            f"ernie_generation_tokens_total{{{lbl}}} {s.generation_tokens_total}",
            "# HELP ernie_request_success_total Finished requests by finish reason.",
            "# TYPE ernie_request_success_total counter",
        ]
        for reason, n in sorted(dict(s.requests_finished).items()):
            lines.append(f'ernie_request_success_total{{{lbl},finished_reason="{reason}"}} {n}')
        lines += [
            "# HELP ernie_time_to_first_token_seconds Time from request arrival to its first generated token.",
            "# TYPE ernie_time_to_first_token_seconds histogram",
            *self.ttft.lines("ernie_time_to_first_token_seconds", lbl),
            "# HELP ernie_e2e_request_latency_seconds Time from request arrival to its last token.",
            "# TYPE ernie_e2e_request_latency_seconds histogram",
            *self.e2e.lines("ernie_e2e_request_latency_seconds", lbl),
            "# HELP ernie_time_per_output_token_seconds Mean time between a request's tokens after the first.",
            "# TYPE ernie_time_per_output_token_seconds histogram",
            *self.per_token.lines("ernie_time_per_output_token_seconds", lbl),
            "# HELP ernie_http_requests_total HTTP requests by route and status code.",
            "# TYPE ernie_http_requests_total counter",
        ]
        with self._lock:
            for (route, status), n in sorted(self.http_requests.items()):
                lines.append(f'ernie_http_requests_total{{route="{route}",status="{status}"}} {n}')
        return "\n".join(lines) + "\n"
