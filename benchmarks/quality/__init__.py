"""Routing-quality report (``make quality``): see :mod:`benchmarks.quality.run`."""
