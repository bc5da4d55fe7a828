"""Serving benchmarks over HTTP: `loraplex bench` with model shapes and peers, the first start,
cold adapter sources, lease heartbeats."""
