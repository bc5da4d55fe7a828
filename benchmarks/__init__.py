"""Benchmarks, evaluations, profilers and build checks: tooling that the installed package does not ship.

Run each from the repository root as a module, `python -m benchmarks.<topic>.<script> --help`;
tests import them through pytest's `pythonpath = ["."]`. `loraplex bench` itself stays in server.bench."""
