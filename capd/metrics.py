"""A tiny Prometheus text-format registry: counters, gauges and one latency histogram.

Small on purpose (no client library): capd exposes a handful of series and must stay
cheap on the route path (one lock, a few integer adds).
"""

from __future__ import annotations

import bisect
import math
import numbers
import threading
from collections import defaultdict
from collections.abc import Callable

ROUTE_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


def _number(value: float) -> str:
    """A sample value, exactly: a whole number as its digits (``2345678``, not ``{:g}``'s
    ``2.34568e+06``), any other float as ``repr`` (the shortest text that reads back the same),
    infinities and NaN as the text format spells them."""
    if isinstance(value, numbers.Integral):
        return str(int(value))
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return str(int(number)) if number.is_integer() else repr(number)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels)
    return "{" + inner + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
        self._help: dict[str, str] = {}
        self._bucket_counts = [0] * (len(ROUTE_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._latency_count = 0
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def inc(self, name: str, help_text: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._help.setdefault(name, help_text)
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + amount

    def observe_route(self, seconds: float) -> None:
        with self._lock:
            self._bucket_counts[bisect.bisect_left(ROUTE_BUCKETS, seconds)] += 1
            self._latency_sum += seconds
            self._latency_count += 1

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self._gauges[name] = (help_text, read)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, series in sorted(self._counters.items()):
                lines += [f"# HELP {name} {self._help[name]}", f"# TYPE {name} counter"]
                lines += [f"{name}{_labels(key)} {_number(value)}" for key, value in sorted(series.items())]
            name = "capd_route_latency_seconds"
            lines += [f"# HELP {name} Time to decide a route request, including encoding.",
                      f"# TYPE {name} histogram"]
            cumulative = 0
            for bound, count in zip(ROUTE_BUCKETS, self._bucket_counts, strict=False):
                cumulative += count
                lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {self._latency_count}')
            lines += [f"{name}_sum {_number(self._latency_sum)}", f"{name}_count {self._latency_count}"]
        for name, (help_text, read) in sorted(self._gauges.items()):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(read())}"]
        return "\n".join(lines) + "\n"
