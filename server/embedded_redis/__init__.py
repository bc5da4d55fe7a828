"""The embedded Redis: a supervised, password-protected redis-server child bound to loopback
(server.py), the binary its data dir belongs to (binary.py), its restart policy (supervisor.py) and
its password file (password.py)."""

DATA_SUBDIR = "redis"  # `loraplex serve` keeps the embedded Redis in DATA_DIR/redis
