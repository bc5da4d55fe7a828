"""Peer servers for side-by-side runs (vLLM's CPU server), with the shims put on their PYTHONPATH."""
