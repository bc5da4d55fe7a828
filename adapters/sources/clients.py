"""SourceClients: what a server's fetches share for its whole life, because making them is slow
interpreter work under the GIL that a storm of cold loads would otherwise repeat per fetch and per
hop, taking it from the engine thread: boto3 clients (tens of milliseconds each) and one TLS context
(loading the CA bundle: ~0.1-0.3 s each on a 2-core machine)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import httpx

from adapters.sources.s3_fetch import S3Clients


@dataclass
class SourceClients:
    s3: S3Clients = field(default_factory=S3Clients)
    tls: ssl.SSLContext = field(default_factory=httpx.create_ssl_context)  # thread-safe once made
