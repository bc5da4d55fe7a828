"""An adapter reference as a client writes it (`s3://bucket/prefix`, `https://host/dir/`,
`https://host/a.tar.gz`, `/dir` or `file:///dir`), parsed into what the fetchers need."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from adapters.sources.errors import SourceError
from adapters.sources.s3_key import s3_key_problem

MAX_REFERENCE_CHARS = 2048
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


@dataclass(frozen=True)
class SourceRef:
    kind: str           # one of policy.SOURCE_KINDS
    location: str       # s3: the key prefix or archive key; http(s): the URL; local: the path as given
    bucket: str = ""    # s3 only

    @property
    def is_archive(self) -> bool:
        return self.location.lower().split("?", 1)[0].endswith(ARCHIVE_SUFFIXES)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.location}" if self.kind == "s3" else self.location


def _invalid(text: str, why: str) -> SourceError:
    return SourceError(400, f"adapter source {text[:200]!r}: {why}", "invalid_source")


def _split(text: str) -> SplitResult:
    """urlsplit, with what it refuses (an unclosed `[`, a bad port) a 400 instead of a ValueError."""
    try:
        parts = urlsplit(text)
        _ = (parts.hostname, parts.port)  # both parse lazily and raise on a malformed host or port
    except ValueError as e:
        raise _invalid(text, f"not a well-formed URL ({e})") from None
    return parts


def parse_reference(text: str) -> SourceRef:
    if not isinstance(text, str) or not text or len(text) > MAX_REFERENCE_CHARS or not text.isascii() \
            or not text.isprintable():
        raise SourceError(400, f"an adapter source is 1-{MAX_REFERENCE_CHARS} printable ASCII characters "
                               "(percent-encode the rest of a URL)",
                          "invalid_source")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme == "s3":
        parts = _split(text)
        key = parts.path.removeprefix("/")
        if not parts.netloc or not key or parts.query or parts.fragment or "@" in parts.netloc:
            raise _invalid(text, "write s3://BUCKET/PREFIX (a PEFT directory's prefix or an archive's key)")
        problem = s3_key_problem(key.removesuffix("/"))
        if problem is not None:
            raise _invalid(text, problem)
        return SourceRef("s3", key.rstrip("/") if not key.endswith(ARCHIVE_SUFFIXES) else key, parts.netloc)
    if scheme in ("http", "https"):
        parts = _split(text)
        if not parts.hostname:
            raise _invalid(text, "the URL has no host")
        if parts.username is not None or parts.password is not None:
            # A credential in a URL would be stored, listed and logged with it (so it is not quoted here).
            raise SourceError(400, "adapter source URL: credentials in the URL are not accepted", "invalid_source")
        if parts.fragment:
            raise _invalid(text, "a URL fragment is not accepted")
        return SourceRef(scheme, text)
    if scheme == "file":
        parts = _split(text)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise _invalid(text, "write file:///ABSOLUTE/DIR")
        return SourceRef("local", parts.path)
    if scheme:
        raise _invalid(text, f"unsupported scheme {scheme!r}: use s3://, https://, http:// or a local directory")
    return SourceRef("local", text)
