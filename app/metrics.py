"""Prometheus metrics (prometheus-client), safe with several workers.

With `PROMETHEUS_MULTIPROC_DIR` set (`python -m app` sets it when it starts
more than one worker), every worker writes its samples to that directory and
`GET /metrics` on any worker aggregates all of them.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DURATION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The server's metrics, registered in a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        r = self.registry
        self.generations_active = Gauge(
            "searchchat_generations_active",
            "Generations running now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.connections_active = Gauge(
            "searchchat_connections_active",
            "Open streaming connections by transport",
            ["transport"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.events_sent = Counter(
            "searchchat_events_sent_total", "Events written to clients", ["transport"], registry=r
        )
        self.generations = Counter(
            "searchchat_generations_total", "Generations ended, by status", ["status"], registry=r
        )
        self.errors = Counter(
            "searchchat_errors_total", "Errors sent to clients, by key", ["key"], registry=r
        )
        self.cancels = Counter("searchchat_cancels_total", "Cancel requests accepted", registry=r)
        self.resumes = Counter("searchchat_resumes_total", "Streams resumed", registry=r)
        self.time_to_first_token = Histogram(
            "searchchat_time_to_first_token_seconds",
            "Request accepted to the first answer or reasoning token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.generation_duration = Histogram(
            "searchchat_generation_duration_seconds",
            "Whole generation",
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.tokens = Counter(
            "searchchat_tokens_total",
            "Tokens the answering model counted (or was estimated to), by model and kind",
            ["model", "kind"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "searchchat_upstream_latency_seconds",
            "Model request sent to its first delta",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text (all workers' samples in multiprocess mode)."""
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
