"""Where adapters come from besides an upload: S3-compatible object storage, http(s) URLs and a
directory under the operator's root. Each source is allowed by the operator (SourcePolicy); what a
source yields is the two PEFT files' bytes, which the caller validates exactly as an upload."""
from adapters.sources.errors import SourceError
from adapters.sources.fetch import AdapterFiles, fetch_adapter
from adapters.sources.policy import SOURCE_KINDS, SourcePolicy
from adapters.sources.reference import SourceRef, parse_reference

__all__ = ["AdapterFiles", "SOURCE_KINDS", "SourceError", "SourcePolicy", "SourceRef", "fetch_adapter",
           "parse_reference"]
