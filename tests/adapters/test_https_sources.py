"""https:// adapter sources against a real TLS file server on loopback: the connection goes to the
address the guard checked while TLS verifies the URL's host name (SNI) against a CA the server
trusts (SSL_CERT_FILE, as httpx honours it); an untrusted certificate or one for another name fails
the fetch with a 502 that says the source is unreachable, and nothing is read."""
from __future__ import annotations

import datetime
import ipaddress
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from adapters.optional_parts import OPTIONAL_PARTS
from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.clients import SourceClients
from tests.source_servers import FileServer

pytestmark = pytest.mark.unit

FILES = ("adapter_config.json", "adapter_model.safetensors")
POLICY = SourcePolicy(kinds=frozenset({"https"}), http_hosts=frozenset({"127.0.0.1"}),
                      allow_private_networks=True, timeout_seconds=5.0, max_file_bytes=1 << 20)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _issue(subject_ip: str, ca_key, ca_name: x509.Name, key) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_ip)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(subject_ip))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """(the CA's PEM file, a server TLS context for 127.0.0.1, one for 127.0.0.9 (another name))."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplex test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (root / "ca.pem").write_bytes(_pem(ca))
    contexts = []
    for ip in ("127.0.0.1", "127.0.0.9"):
        key = ec.generate_private_key(ec.SECP256R1())
        (root / f"{ip}.pem").write_bytes(_pem(_issue(ip, ca_key, ca_name, key)) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(root / f"{ip}.pem")
        contexts.append(ctx)
    return root / "ca.pem", contexts[0], contexts[1]


def _serve(server: FileServer, adapter_dir) -> None:
    for f in FILES:
        server.files[f"/a/{f}"] = (adapter_dir / f).read_bytes()


def test_https_fetch_verifies_the_host_it_pinned(pki, tiny_adapters, monkeypatch):
    ca_file, good, _ = pki
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    with FileServer(tls=good) as files:
        _serve(files, tiny_adapters["r4_qv"])
        got = fetch_adapter(parse_reference(f"{files.url}/a/"), POLICY, SourceClients())
        assert got.weights == (tiny_adapters["r4_qv"] / FILES[1]).read_bytes()
        # The PEFT files, then each optional part's by name (absent here: 404s).
        optional = [f"/a/{p.folder}/{f}" for p in OPTIONAL_PARTS for f in p.files]
        assert files.requests == [f"/a/{f}" for f in FILES] + optional


def test_an_untrusted_or_misnamed_certificate_fails_before_a_byte_is_read(pki, tiny_adapters, monkeypatch):
    ca_file, good, misnamed = pki
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with FileServer(tls=good) as files:  # a CA the default trust store does not hold
        _serve(files, tiny_adapters["r4_qv"])
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(f"{files.url}/a/"), POLICY, SourceClients())
        assert e.value.status == 502 and "unreachable" in e.value.message
        assert files.requests == []
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    with FileServer(tls=misnamed) as files:  # trusted CA, but the certificate names 127.0.0.9
        _serve(files, tiny_adapters["r4_qv"])
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(f"{files.url}/a/"), POLICY, SourceClients())
        assert e.value.status == 502 and files.requests == []
