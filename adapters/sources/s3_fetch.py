"""GET from an S3-compatible endpoint the operator named, through boto3. The endpoint is the
operator's (it is not a tenant's choice, so no address check); the bucket must be allowed. The
object's size comes from a HEAD before any byte of it is read. Credentials are the tenant's own when
it set some (tenants.source_credentials), else boto3's chain in the server's environment
(AWS_ACCESS_KEY_ID..., AWS_PROFILE, instance roles): they are never part of a reference, a response,
a log line or a metric."""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from typing import Protocol

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from adapters.sources.bounded_read import read_capped, remaining, timed_out
from adapters.sources.errors import SourceError, refused, too_large
from adapters.sources.policy import SourcePolicy
from adapters.sources.s3_key import s3_key_problem

_CHUNK = 1 << 16


class S3Keys(Protocol):
    """A tenant's own S3 credentials (tenants.source_credentials.S3Credentials)."""
    access_key_id: str
    secret_access_key: str
    session_token: str | None


def _fingerprint(keys: S3Keys | None) -> str | None:
    """Tells credentials apart in a cache key without keeping them readable there."""
    if keys is None:
        return None
    material = "\0".join((keys.access_key_id, keys.secret_access_key, keys.session_token or ""))
    return hashlib.sha256(material.encode()).hexdigest()


class S3Clients:
    """boto3 clients by endpoint and credentials, made once and shared by the fetch threads (clients
    are thread-safe; making one costs tens of milliseconds of the interpreter, which a storm of
    fetches would take from the engine thread). Clients with tenants' own credentials are kept for
    the `max_clients` most recently used, so thousands of tenants do not hold thousands."""

    def __init__(self, max_clients: int = 64) -> None:
        assert max_clients >= 1
        self._lock = threading.Lock()
        self._clients: OrderedDict[tuple, object] = OrderedDict()
        self._max = max_clients

    def get(self, policy: SourcePolicy, keys: S3Keys | None = None):
        key = (policy.s3_endpoint, policy.s3_region, policy.timeout_seconds, _fingerprint(keys))
        with self._lock:
            if key in self._clients:
                self._clients.move_to_end(key)
                return self._clients[key]
        config = botocore.config.Config(connect_timeout=policy.timeout_seconds,
                                        read_timeout=policy.timeout_seconds,
                                        retries={"max_attempts": 1}, signature_version="s3v4")
        session = (boto3.session.Session() if keys is None else boto3.session.Session(
            aws_access_key_id=keys.access_key_id, aws_secret_access_key=keys.secret_access_key,
            aws_session_token=keys.session_token))
        client = session.client("s3", endpoint_url=policy.s3_endpoint, region_name=policy.s3_region,
                                config=config)
        with self._lock:
            client = self._clients.setdefault(key, client)
            self._clients.move_to_end(key)
            while len(self._clients) > self._max:
                self._clients.popitem(last=False)
            return client


class S3Reader:
    """Reads of one fetch; the whole fetch's deadline bounds each (reads of a stream that drips, too)."""

    def __init__(self, policy: SourcePolicy, bucket: str, deadline: float, clients: S3Clients,
                 keys: S3Keys | None = None) -> None:
        if not policy.allows("s3"):
            raise refused("s3:// adapter sources are not allowed on this server")
        if policy.s3_buckets and bucket not in policy.s3_buckets:
            raise refused(f"bucket {bucket!r} is not among the allowed adapter source buckets")
        remaining(deadline, f"s3://{bucket}")
        self._client = clients.get(policy, keys)
        self._bucket = bucket
        self._deadline = deadline

    def size(self, key: str) -> int | None:
        """The object's size, None if it does not exist."""
        problem = s3_key_problem(key)
        if problem is not None:  # parse_reference refused it already; a joined key is checked again here
            raise SourceError(400, f"s3://{self._bucket}/{key[:200]}: {problem}", "invalid_source")
        try:
            head = self._client.head_object(Bucket=self._bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._failed(key, e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._failed(key, e) from None
        return int(head["ContentLength"])

    def get(self, key: str, cap: int) -> bytes:
        what = f"s3://{self._bucket}/{key}"
        size = self.size(key)
        if size is None:
            raise SourceError(404, f"{what} does not exist", "source_not_found")
        if size > cap:
            raise too_large(what, size, cap)  # from the HEAD: nothing downloaded
        try:
            body = self._client.get_object(Bucket=self._bucket, Key=key)["Body"]
            # A read blocks until a whole chunk arrives: a store that drips would hold it past the
            # deadline, so the deadline closes the stream under it.
            watchdog = threading.Timer(max(0.0, self._deadline - time.monotonic()), body.close)
            watchdog.start()
            try:
                return read_capped(body.iter_chunks(_CHUNK), cap, self._deadline, what)
            except (OSError, ValueError, AttributeError, urllib3.exceptions.HTTPError) as e:
                if time.monotonic() >= self._deadline:
                    raise timed_out(what) from None
                raise self._failed(key, e) from None
            finally:
                watchdog.cancel()
                body.close()
        except botocore.exceptions.ClientError as e:
            raise self._failed(key, e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._failed(key, e) from None

    def _failed(self, key: str, e: Exception) -> SourceError:
        what = f"s3://{self._bucket}/{key}"
        if isinstance(e, (botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError)):
            return timed_out(what)
        if isinstance(e, botocore.exceptions.ClientError):
            # The error code only (AccessDenied, NoSuchBucket, ...): never the request's signed headers.
            code = e.response.get("Error", {}).get("Code", "error")
            return SourceError(502, f"{what}: the object store answered {code}", "source_error")
        return SourceError(502, f"{what}: the object store is unreachable ({type(e).__name__})",
                           "source_unreachable")
