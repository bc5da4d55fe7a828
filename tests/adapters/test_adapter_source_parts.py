"""An adapter's optional parts (adapters.optional_parts: `medusa/` heads, a `draft/` LoRA) from every source
kind: a local directory's folders, an archive's members, and an http(s) or s3 directory's files fetched by
their known names, where a 404 means the part is absent. Both files of a part or neither (a 400 naming the
missing one), each under the source's bounds, and a new part makes new content (sha256). Real files, a
loopback HTTP file server and moto's S3 server on loopback."""
from __future__ import annotations

import boto3
import pytest

from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.archive import extract_adapter_archive
from tests.adapters.test_adapter_sources import zipped
from tests.source_servers import FileServer, moto_s3

pytestmark = pytest.mark.unit

FILES = ("adapter_config.json", "adapter_model.safetensors")
HEADS = {"medusa/medusa_config.json": b"{}", "medusa/medusa_heads.safetensors": b"w"}
DRAFT = {"draft/adapter_config.json": b'{"r": 4}', "draft/adapter_model.safetensors": b"d" * 100}
CAP = 1 << 20
BUCKET = "parts"


def _peft(tiny_adapters) -> dict[str, bytes]:
    return {f: (tiny_adapters["r4_qv"] / f).read_bytes() for f in FILES}


def _check(fetch, store) -> None:
    """`store(files)` puts a directory's files (relative path -> bytes) where `fetch()` reads them."""
    peft = store.peft
    store({})
    bare = fetch()
    assert bare.medusa is None and bare.draft is None
    store(DRAFT)
    drafted = fetch()
    assert drafted.draft == tuple(DRAFT.values()) and drafted.medusa is None
    assert (drafted.config_json, drafted.weights) == tuple(peft.values()) and drafted.sha256 != bare.sha256
    store(DRAFT | HEADS)
    both = fetch()
    assert both.draft == tuple(DRAFT.values()) and both.medusa == tuple(HEADS.values())
    store({"draft/adapter_config.json": b"{}"})
    with pytest.raises(SourceError) as e:
        fetch()
    assert e.value.status == 400 and "draft/ folder has no adapter_model.safetensors" in e.value.message
    store({"draft/adapter_config.json": b"{}", "draft/adapter_model.safetensors": b"x" * (CAP + 1)})
    with pytest.raises(SourceError) as e:
        fetch()
    assert e.value.status == 413


class _Store:
    def __init__(self, peft, put, clear) -> None:
        self.peft, self.put, self.clear = peft, put, clear

    def __call__(self, parts: dict[str, bytes]) -> None:
        self.clear()
        for name, data in (self.peft | parts).items():
            self.put(name, data)


def test_a_local_directorys_draft_folder(tmp_path, tiny_adapters):
    root = tmp_path / "root"
    d = root / "a"
    d.mkdir(parents=True)

    def put(name, data):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)

    def clear():
        for sub in ("draft", "medusa"):
            for f in (d / sub).glob("*") if (d / sub).exists() else ():
                f.unlink()
            if (d / sub).exists():
                (d / sub).rmdir()

    policy = SourcePolicy(kinds=frozenset({"local"}), local_root=root, max_file_bytes=CAP)
    _check(lambda: fetch_adapter(parse_reference("a"), policy), _Store(_peft(tiny_adapters), put, clear))


def test_an_http_directorys_parts_are_fetched_by_name_a_404_meaning_absent(tiny_adapters):
    with FileServer() as files:
        policy = SourcePolicy(kinds=frozenset({"http"}), allow_private_networks=True, max_file_bytes=CAP)
        store = _Store(_peft(tiny_adapters), lambda name, data: files.files.__setitem__(f"/dir/{name}", data),
                       files.files.clear)
        _check(lambda: fetch_adapter(parse_reference(f"{files.url}/dir/"), policy), store)
        store({})
        files.requests.clear()
        fetch_adapter(parse_reference(f"{files.url}/dir"), policy)
        assert files.requests == ["/dir/" + f for f in FILES] + [
            "/dir/medusa/medusa_config.json", "/dir/medusa/medusa_heads.safetensors",
            "/dir/draft/adapter_config.json", "/dir/draft/adapter_model.safetensors"]


def test_an_s3_directorys_parts_are_fetched_by_name_a_missing_key_meaning_absent(tiny_adapters, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "loraplex-test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "loraplex-test-secret")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto_s3() as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)

        def clear():
            for item in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []):
                s3.delete_object(Bucket=BUCKET, Key=item["Key"])

        policy = SourcePolicy(kinds=frozenset({"s3"}), s3_endpoint=url, s3_buckets=frozenset({BUCKET}),
                              max_file_bytes=CAP)
        store = _Store(_peft(tiny_adapters), lambda name, data: s3.put_object(Bucket=BUCKET, Key=f"team/a/{name}",
                                                                                Body=data), clear)
        _check(lambda: fetch_adapter(parse_reference(f"s3://{BUCKET}/team/a"), policy), store)


def test_an_archives_draft_folder_beside_the_picked_files_comes_with_them(tiny_adapters):
    peft = {f"top/{f}": data for f, data in _peft(tiny_adapters).items()}
    decoys = {f"top/deeper/{f}": b"decoy" for f in DRAFT}  # not beside the picked files
    assert extract_adapter_archive(zipped(peft | decoys), "a.zip", CAP, "a")[2:] == (None, None)
    drafted = peft | {f"top/{f}": data for f, data in (DRAFT | HEADS).items()}
    assert extract_adapter_archive(zipped(drafted), "a.zip", CAP, "a")[2:] == (tuple(HEADS.values()),
                                                                               tuple(DRAFT.values()))
    with pytest.raises(SourceError) as e:
        extract_adapter_archive(zipped(peft | {"top/draft/adapter_model.safetensors": b"d"}), "a.zip", CAP, "a")
    assert e.value.status == 400 and "draft/ folder has no adapter_config.json" in e.value.message
