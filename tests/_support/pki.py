"""Certificates made locally for the handshake's TLS tests (`cryptography`): a CA, another
CA, a server certificate for 127.0.0.1/localhost, an expired one, and a client certificate."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NOW = dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    expired: bool = False,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    start, end = (NOW - dt.timedelta(days=30), NOW - dt.timedelta(days=1)) if expired else (
        NOW - dt.timedelta(minutes=5), NOW + dt.timedelta(days=1))  # fmt: skip
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                + [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
            ),
            critical=False,
        )
    return b.sign(issuer[1] if issuer else key, hashes.SHA256())


def make_pki(d: Path, hosts: tuple[str, ...] = ()) -> dict[str, str]:
    """Files in `d`: ca, other_ca, server (+key), expired server (+key), client (+key); the
    certificates name localhost, 127.0.0.1 and the addresses in `hosts`."""
    out: dict[str, str] = {}

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[name] = str(d / f"{name}.pem")
        if key is not None:
            (d / f"{name}.key").write_bytes(_pem_key(key))
            out[f"{name}_key"] = str(d / f"{name}.key")

    ca_key, other_key = _key(), _key()
    ca = _cert("isoexec test CA", ca_key, None, ca=True)
    write("ca", ca, None)
    write("other_ca", _cert("another CA", other_key, None, ca=True), None)
    for name, expired in (("server", False), ("expired", True), ("client", False)):
        k = _key()
        write(name, _cert(name, k, (ca, ca_key), expired=expired, hosts=hosts), k)
    return out
