"""GET over http(s) from an allowed host: each hop (redirects included) is checked and connected to
the address the guard checked; the size is checked from Content-Length before reading, then while
reading; the whole fetch ends at its deadline, however the source drips."""
from __future__ import annotations

import socket
import ssl
import threading
import time
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from adapters.sources.address_guard import checked_address
from adapters.sources.bounded_read import read_capped, remaining, timed_out
from adapters.sources.errors import SourceError, refused, too_large
from adapters.sources.policy import SourcePolicy

_REDIRECTS = (301, 302, 303, 307, 308)


def _pinned(url: str, policy: SourcePolicy) -> tuple[str, str, str]:
    """(the URL with the checked address for its host, the Host header, the TLS server name)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not policy.allows(scheme):
        raise refused(f"adapter sources may not use {scheme or 'this'}:// URLs on this server")
    if parts.username is not None or parts.password is not None:
        raise SourceError(400, "credentials in an adapter source URL are not accepted", "invalid_source")
    host = parts.hostname
    if not host:
        raise SourceError(400, "an adapter source URL has no host", "invalid_source")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise SourceError(400, "an adapter source URL has an invalid port", "invalid_source") from None
    ip = checked_address(host, port, policy)
    netloc = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    host_header = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, "")), host_header, host


class _Cutoff:
    """Shuts a hop's socket down at the fetch's deadline. httpx's timeouts bound each read, not the
    whole: a source sending a byte just inside each read timeout would hold the fetch (and its
    loader process) for as long as it likes. A shut-down socket wakes the read blocked on it."""

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._fired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict) -> None:
        """httpcore's trace hook: the socket of each connection (and of its TLS layer, a new object)."""
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            sock = info["return_value"].get_extra_info("socket")
            with self._lock:
                self._sock = sock
                if not self._fired:
                    return
            _shut(sock)

    @property
    def fired(self) -> bool:
        with self._lock:
            return self._fired

    def _fire(self) -> None:
        with self._lock:
            self._fired = True
            sock = self._sock
        if sock is not None:
            _shut(sock)

    def __enter__(self) -> "_Cutoff":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain call on a TLS socket too: no TLS alert
    except OSError:  # closed already
        pass


def http_get(url: str, policy: SourcePolicy, cap: int, deadline: float, what: str,
             tls: ssl.SSLContext) -> bytes:
    """Blocking: call it off the event loop. `tls`: a shared context (making one per client is slow)."""
    for _ in range(policy.max_redirects + 1):
        target, host_header, server_name = _pinned(url, policy)
        timeout = httpx.Timeout(min(policy.timeout_seconds, remaining(deadline, what)))
        cutoff = _Cutoff(deadline)
        extensions = {"trace": cutoff.trace}
        if target.startswith("https:"):
            extensions["sni_hostname"] = server_name
        try:
            with cutoff, httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False,
                                      verify=tls) as client:
                with client.stream("GET", target, headers={"Host": host_header, "Accept-Encoding": "identity"},
                                   extensions=extensions) as response:
                    if response.status_code in _REDIRECTS:
                        location = response.headers.get("location")
                        if not location:
                            raise SourceError(502, f"{what}: a redirect without a Location", "source_error")
                        url = urljoin(url, location)  # checked like the first hop, on the next pass
                        continue
                    if response.status_code == 404:
                        raise SourceError(404, f"{what} was not found at its source (HTTP 404)", "source_not_found")
                    if response.status_code != 200:
                        raise SourceError(502, f"{what}: the source answered HTTP {response.status_code}",
                                          "source_error")
                    length = response.headers.get("content-length")
                    if length is not None and length.isdigit() and int(length) > cap:
                        raise too_large(what, int(length), cap)  # before reading a byte of the body
                    # As received (no re-chunking, which would wait for a full chunk of a slow drip).
                    data = read_capped(response.iter_raw(), cap, deadline, what)
                    if cutoff.fired:  # a body that ends with its connection looks whole when cut
                        raise timed_out(what)
                    return data
        except httpx.TimeoutException:
            raise timed_out(what) from None
        except httpx.HTTPError as e:
            if time.monotonic() >= deadline:  # the cutoff ended it
                raise timed_out(what) from None
            raise SourceError(502, f"{what}: the source is unreachable ({type(e).__name__})",
                              "source_unreachable") from None
    raise SourceError(502, f"{what}: more than {policy.max_redirects} redirects", "source_error")
