"""One default TLS context for the tests' HTTP clients. httpx builds a fresh ssl.SSLContext for every
Client (loading certifi's CA bundle: ~20 ms of CPU), and each httpx.get/post, ServerHandle.http and
openai.OpenAI makes a Client: in the API tests that was about a quarter of the CPU the tests spent.
The clients all talk plain http to 127.0.0.1, where the context is never used; one built as httpx
builds it serves them all. Cached per SSL_CERT_FILE / SSL_CERT_DIR (as httpx reads them, file
changes included), so a test that trusts its own CA still gets a context that trusts it."""
from __future__ import annotations

import os
import ssl
from collections.abc import Iterator

import httpx._transports.default as httpx_transport
import pytest


def _env_key(name: str, trust_env: bool) -> tuple[str, int] | None:
    path = os.environ.get(name) if trust_env else None
    if not path:
        return None
    try:
        return path, os.stat(path).st_mtime_ns
    except OSError:  # httpx's own load reports it
        return path, -1


@pytest.fixture(scope="session", autouse=True)
def one_default_tls_context() -> Iterator[None]:
    build = httpx_transport.create_ssl_context
    contexts: dict[tuple, ssl.SSLContext] = {}

    def cached(verify=True, cert=None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:  # a caller's own context, path or certificate: as asked
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (_env_key("SSL_CERT_FILE", trust_env), _env_key("SSL_CERT_DIR", trust_env))
        if key not in contexts:
            contexts[key] = build(verify=True, trust_env=trust_env)
        return contexts[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx_transport, "create_ssl_context", cached)
        yield
