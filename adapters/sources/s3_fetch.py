"""GET from an S3-compatible endpoint the operator named, through boto3. The endpoint is the
operator's (it is not a tenant's choice, so no address check); the bucket must be allowed. The
object's size comes from a HEAD before any byte of it is read. Credentials come from boto3's own
chain in the server's environment (AWS_ACCESS_KEY_ID..., AWS_PROFILE, instance roles): they are
never part of a reference, a response, a log line or a metric."""
from __future__ import annotations

import threading
import time

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from adapters.sources.bounded_read import read_capped, remaining, timed_out
from adapters.sources.errors import SourceError, refused, too_large
from adapters.sources.policy import SourcePolicy

_CHUNK = 1 << 16


class S3Clients:
    """boto3 clients by endpoint, made once and shared by the fetch threads (clients are thread-safe;
    making one costs tens of milliseconds of the interpreter, which a storm of fetches would take
    from the engine thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple, object] = {}

    def get(self, policy: SourcePolicy):
        key = (policy.s3_endpoint, policy.s3_region, policy.timeout_seconds)
        with self._lock:
            if key not in self._clients:
                config = botocore.config.Config(connect_timeout=policy.timeout_seconds,
                                                read_timeout=policy.timeout_seconds,
                                                retries={"max_attempts": 1}, signature_version="s3v4")
                self._clients[key] = boto3.session.Session().client(
                    "s3", endpoint_url=policy.s3_endpoint, region_name=policy.s3_region, config=config)
            return self._clients[key]


class S3Reader:
    """Reads of one fetch; the whole fetch's deadline bounds each (reads of a stream that drips, too)."""

    def __init__(self, policy: SourcePolicy, bucket: str, deadline: float, clients: S3Clients) -> None:
        if not policy.allows("s3"):
            raise refused("s3:// adapter sources are not allowed on this server")
        if policy.s3_buckets and bucket not in policy.s3_buckets:
            raise refused(f"bucket {bucket!r} is not among the allowed adapter source buckets")
        remaining(deadline, f"s3://{bucket}")
        self._client = clients.get(policy)
        self._bucket = bucket
        self._deadline = deadline

    def size(self, key: str) -> int | None:
        """The object's size, None if it does not exist."""
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
