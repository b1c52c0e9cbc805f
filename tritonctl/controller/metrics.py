"""Triton's and HAProxy's metrics: parsing their Prometheus text, scraping, arrival rates and queueing per model."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from tritonctl.deploy.runtime import InstanceRecord

PENDING = "nv_inference_pending_request_count"  # requests queued or running in the instance (a gauge)


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Triton's Prometheus text -> model -> metric -> value, summed over versions (Triton's counters and
    gauges named nv_inference_*; ValueError for text that is not Prometheus exposition)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("nv_inference_"):
            continue
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is not None and sample.name in (family.name, f"{family.name}_total"):
                metrics = out.setdefault(model, {})
                metrics[family.name] = metrics.get(family.name, 0.0) + sample.value
    return out


def scrape(record: InstanceRecord) -> dict[str, float] | None:
    """The instance's counters for its model, None when its metrics endpoint does not answer."""
    url = f"http://{record.host}:{record.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return parse_metrics(response.read().decode()).get(record.model, {})
    except (urllib.error.URLError, OSError, ValueError):
        return None


PROXY_COUNTERS = {  # HAProxy's per-backend samples -> what the controller calls them
    "haproxy_backend_http_requests_total": "requests",
    "haproxy_backend_connection_errors_total": "errors",
    "haproxy_backend_response_errors_total": "errors",
    "haproxy_backend_current_queue": "queued",
}


def parse_proxy_metrics(text: str) -> dict[int, dict[str, float]]:
    """HAProxy's Prometheus text -> model port -> requests and errors (counters) and queued (a gauge), from the
    backends tritonctl names `port<N>`; 5xx answers count as errors (ValueError for text that is not Prometheus)."""
    out: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            proxy = sample.labels.get("proxy", "")
            if not (proxy.startswith("port") and proxy[4:].isdigit()):
                continue
            name = PROXY_COUNTERS.get(sample.name)
            if sample.name == "haproxy_backend_http_responses_total" and sample.labels.get("code") == "5xx":
                name = "errors"
            if name is not None:
                values = out.setdefault(int(proxy[4:]), {"requests": 0.0, "errors": 0.0, "queued": 0.0})
                values[name] += sample.value
    return out


def scrape_proxy(url: str | None) -> dict[int, dict[str, float]] | None:
    """HAProxy's counters per model port, None when there is no proxy or its metrics do not answer."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return parse_proxy_metrics(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class ProxyRates:
    """Requests and errors per second at the proxy, per model port, over a window of its counters."""

    window_s: float
    samples: dict[int, deque] = field(default_factory=dict)  # port -> (time, requests, errors)

    def update(self, now: float, counters: dict[int, dict[str, float]]) -> None:
        for port, values in counters.items():
            series = self.samples.setdefault(port, deque())
            if series and values["requests"] < series[-1][1]:  # a restarted proxy counts from 0 again
                series.clear()
            series.append((now, values["requests"], values["errors"]))
            while len(series) > 1 and series[0][0] < now - self.window_s:
                series.popleft()

    def rates(self, port: int) -> tuple[float, float] | None:
        """(requests/s, errors/s) over the window; None until it spans two samples."""
        series = self.samples.get(port)
        if not series or len(series) < 2 or series[-1][0] <= series[0][0]:
            return None
        span = series[-1][0] - series[0][0]
        return (series[-1][1] - series[0][1]) / span, (series[-1][2] - series[0][2]) / span


@dataclass
class RateEstimator:
    """Arrival rates and queueing per model from cumulative counters of instances that come and go."""

    window_s: float
    last: dict[str, dict[str, float]] = field(default_factory=dict)  # uid -> counters at the previous tick
    samples: dict[str, deque] = field(default_factory=dict)  # model -> (time, requests, queue_us)

    def update(self, now: float, counters: dict[str, tuple[str, dict[str, float]]]) -> None:
        """`counters`: uid -> (model, counters). A new instance counts from its first sample on.

        Arrivals are completions plus the growth of the pending queue, so an overloaded
        instance (which completes fewer than arrive) does not hide its load.
        """
        arrived: dict[str, float] = {}
        queued: dict[str, float] = {}
        for uid, (model, values) in counters.items():
            before = self.last.get(uid, values)
            done = values.get("nv_inference_request_success", 0) + values.get("nv_inference_request_failure", 0)
            earlier = before.get("nv_inference_request_success", 0) + before.get("nv_inference_request_failure", 0)
            growth = values.get(PENDING, 0) - before.get(PENDING, 0)
            arrived[model] = arrived.get(model, 0.0) + max(0.0, done - earlier + growth)
            queue = values.get("nv_inference_queue_duration_us", 0) - before.get("nv_inference_queue_duration_us", 0)
            queued[model] = queued.get(model, 0.0) + max(0.0, queue)
        self.last = {uid: values for uid, (_, values) in counters.items()}
        for model in arrived:
            series = self.samples.setdefault(model, deque())
            series.append((now, arrived[model], queued[model]))
            while series and series[0][0] < now - self.window_s:
                series.popleft()

    def span(self, model: str) -> float:
        series = self.samples.get(model)
        return series[-1][0] - series[0][0] if series and len(series) > 1 else 0.0

    def rate(self, model: str) -> float | None:
        """Requests per second over the window (None until it spans one tick)."""
        span = self.span(model)
        if span <= 0:
            return None
        return sum(s[1] for s in list(self.samples[model])[1:]) / span

    def queue_ms(self, model: str) -> float | None:
        """Average time a request waited in Triton's queue over the window."""
        series = list(self.samples.get(model, ()))[1:]
        requests = sum(s[1] for s in series)
        return sum(s[2] for s in series) / requests / 1000 if requests else None
