"""How a worker (or any client) reaches a controller that has TLS or auth on:
TLS files, an optional client certificate for mutual TLS, and the bearer
token, from files or command-line flags. Used by the reference worker and by
``specctl``'s client commands; an engine integrating the agent SDK can build
one and pass ``channel_credentials()`` and ``token`` to ``SpeculationAgent``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import grpc


class ClientSecurityError(ValueError):
    """A client credential that cannot be used; the message names the flag and the path."""


@dataclass(frozen=True)
class ClientSecurity:
    """How a CLI client reaches the controller: TLS (optionally with a client
    certificate for mutual TLS) and a bearer token. Empty = plaintext, no token."""

    tls: bool = False
    ca_pem: bytes | None = None  # None: the system's root certificates
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    token: str = field(default="", repr=False)  # never printed

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ClientSecurity":
        """From the flags ``add_client_security_args`` adds; raises ClientSecurityError."""
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ClientSecurityError("--tls-cert and --tls-key go together (the client certificate and its key)")
        if args.token and args.token_file:
            raise ClientSecurityError("give --token or --token-file, not both")
        token = args.token or ""
        if args.token_file:
            token = _read("--token-file", args.token_file).decode("utf-8", "replace").strip()
            if not token:
                raise ClientSecurityError(f"--token-file={args.token_file!r}: the file is empty")
        tls = bool(args.tls or args.tls_ca or args.tls_cert)
        return cls(
            tls=tls,
            ca_pem=_read("--tls-ca", args.tls_ca) if args.tls_ca else None,
            cert_pem=_read("--tls-cert", args.tls_cert) if args.tls_cert else None,
            key_pem=_read("--tls-key", args.tls_key) if args.tls_key else None,
            token=token,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata presenting the token, or None without one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def channel(self, target: str) -> grpc.Channel:
        credentials = self.channel_credentials()
        return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise ClientSecurityError(f"{flag}={path!r}: cannot read: {err.strerror or err}") from None


def add_client_security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security", "when the controller has TLS or auth on")
    group.add_argument("--tls", action="store_true", help="use TLS (implied by the other --tls-* flags)")
    group.add_argument("--tls-ca", metavar="PEM", help="CA that signs the controller's certificate (default: system roots)")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--token", help="bearer token (visible to other users in the process list: prefer --token-file)")
    group.add_argument("--token-file", metavar="FILE", help="file holding the bearer token")
