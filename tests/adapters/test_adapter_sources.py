"""The source layer on its own, on real files and a real loopback HTTP server: archives read with
every size bounded and only regular files, references parsed strictly, the local root not left by
links, redirect chains bounded."""
from __future__ import annotations

import gzip
import io
import os
import tarfile
import zipfile

import pytest

from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.archive import extract_adapter_archive, extract_adapter_files
from tests.source_servers import FileServer

pytestmark = pytest.mark.unit

FILES = ("adapter_config.json", "adapter_model.safetensors")
CAP = 1 << 20


def _files(adapter_dir) -> dict[str, bytes]:
    return {f: (adapter_dir / f).read_bytes() for f in FILES}


def test_zip_and_tar_archives(tiny_adapters):
    files = _files(tiny_adapters["r4_qv"])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("README.md", "x")
        for f, data in files.items():
            zf.writestr(f"deep/er/{f}", b"decoy")
            zf.writestr(f"top/{f}", data)
    assert extract_adapter_files(buf.getvalue(), "a.zip", CAP, "a.zip") == tuple(files.values())
    assert extract_adapter_files(_tar(files), "a.tar", CAP, "a.tar") == tuple(files.values())


def _tar(members: dict[str, bytes], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_archives_that_are_refused():
    def tar(members) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for info, data in members:
                tf.addfile(info, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()

    def reg(name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        return info, data

    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(SourceError) as e:  # a link is never read, so the pair is incomplete
        extract_adapter_files(tar([reg("adapter_config.json", b"{}"), (link, None)]), "a.tar", CAP, "a")
    assert e.value.status == 400
    with pytest.raises(SourceError) as e:
        extract_adapter_files(tar([reg("adapter_config.json", b"{}"), reg("adapter_model.bin", b"x")]),
                              "a.tar", CAP, "a")
    assert e.value.status == 400 and "pickle" in e.value.message
    big = tar([reg("adapter_config.json", b"{}"), reg("adapter_model.safetensors", b"\0" * (CAP + 1))])
    with pytest.raises(SourceError) as e:
        extract_adapter_files(big, "a.tar", CAP, "a")
    assert e.value.status == 413
    bomb = gzip.compress(b"\0" * (4 * CAP))  # a few KiB that inflate past every cap
    with pytest.raises(SourceError) as e:
        extract_adapter_files(bomb, "a.tgz", CAP, "a")
    assert e.value.status == 413 and "decompressed" in e.value.message
    with pytest.raises(SourceError) as e:
        extract_adapter_files(b"not an archive", "a.zip", CAP, "a")
    assert e.value.status == 400


@pytest.mark.parametrize("text", ["s3://bucket", "s3://bucket/", "ftp://h/x", "hf://org/m", "s3://u@b/k",
                                  "http:///x", "https://h/x#frag", "", "x" * 3000, "a\nb"])
def test_references_refused(text):
    with pytest.raises(SourceError) as e:
        parse_reference(text)
    assert e.value.status == 400


def test_local_root_is_not_left_by_links(tmp_path, tiny_adapters):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    for f, data in _files(tiny_adapters["r4_qv"]).items():
        (outside / f).write_bytes(data)
    os.symlink(outside, root / "linked-dir")
    (root / "mixed").mkdir()
    (root / "mixed" / "adapter_config.json").write_bytes(_files(tiny_adapters["r4_qv"])["adapter_config.json"])
    os.symlink(outside / "adapter_model.safetensors", root / "mixed" / "adapter_model.safetensors")
    policy = SourcePolicy(kinds=frozenset({"local"}), local_root=root)
    for ref in ("linked-dir", str(outside), "../outside"):
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(ref), policy)
        assert e.value.status == 403, ref
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference("mixed"), policy)
    assert e.value.status == 404  # the weights file is a link out of the root: not read
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference("mixed"), SourcePolicy(kinds=frozenset({"s3"})))
    assert e.value.status == 403


def test_a_local_directorys_medusa_folder_comes_with_its_files_bounded_and_inside_the_root(tmp_path, tiny_adapters):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    for f, data in _files(tiny_adapters["r4_qv"]).items():
        (root / "a" / f).write_bytes(data)
    policy = SourcePolicy(kinds=frozenset({"local"}), local_root=root, max_file_bytes=CAP)
    without = fetch_adapter(parse_reference("a"), policy)
    (root / "a" / "medusa").mkdir()
    (root / "a" / "medusa" / "medusa_config.json").write_bytes(b"{}")
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference("a"), policy)
    assert e.value.status == 400 and "medusa/ folder has no medusa_heads.safetensors" in e.value.message
    (outside / "medusa_heads.safetensors").write_bytes(b"w")
    os.symlink(outside / "medusa_heads.safetensors", root / "a" / "medusa" / "medusa_heads.safetensors")
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference("a"), policy)
    assert e.value.status == 404  # a link out of the root: not read
    (root / "a" / "medusa" / "medusa_heads.safetensors").unlink()
    (root / "a" / "medusa" / "medusa_heads.safetensors").write_bytes(b"w" * (CAP + 1))
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference("a"), policy)
    assert e.value.status == 413
    (root / "a" / "medusa" / "medusa_heads.safetensors").write_bytes(b"w")
    heads = fetch_adapter(parse_reference("a"), policy)
    assert heads.medusa == (b"{}", b"w") and without.medusa is None  # checked against the base by the store
    assert (heads.config_json, heads.weights) == (without.config_json, without.weights)
    assert heads.sha256 != without.sha256  # new heads: a new version


def zipped(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_an_archives_medusa_folder_beside_the_picked_files_comes_with_them(tiny_adapters):
    files = _files(tiny_adapters["r4_qv"])
    heads = {"medusa_config.json": b"{}", "medusa_heads.safetensors": b"w"}
    peft = {f"top/{f}": data for f, data in files.items()}
    decoys = {f"top/deeper/medusa/{f}": b"decoy" for f in heads}  # not beside the picked files
    assert extract_adapter_archive(zipped(peft | decoys), "a.zip", CAP, "a")[2] is None
    with_heads = peft | decoys | {f"top/medusa/{f}": data for f, data in heads.items()}
    assert extract_adapter_archive(zipped(with_heads), "a.zip", CAP, "a") == (
        *files.values(), tuple(heads.values()), None)
    half = peft | {"top/medusa/medusa_config.json": b"{}"}
    with pytest.raises(SourceError) as e:
        extract_adapter_archive(zipped(half), "a.zip", CAP, "a")
    assert e.value.status == 400 and "medusa/ folder has no medusa_heads.safetensors" in e.value.message
    assert extract_adapter_archive(_tar(with_heads, "w:gz"), "a.tgz", CAP, "a")[2] == tuple(heads.values())


def test_redirect_chains_are_bounded():
    with FileServer() as files:
        for i in range(10):
            files.redirects[f"/r{i}.tar"] = f"/r{i + 1}.tar"
        policy = SourcePolicy(kinds=frozenset({"http"}), allow_private_networks=True, max_redirects=3)
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(f"{files.url}/r0.tar"), policy)
        assert e.value.status == 502 and "redirects" in e.value.message
        assert files.requests == ["/r0.tar", "/r1.tar", "/r2.tar", "/r3.tar"]
        files.redirects["/meta.tar"] = "http://169.254.169.254/latest/meta-data/"
        with pytest.raises(SourceError) as e:  # link-local (cloud metadata) stays refused even so
            fetch_adapter(parse_reference(f"{files.url}/meta.tar"), policy)
        assert e.value.status == 403 and "169.254.169.254" in e.value.message
