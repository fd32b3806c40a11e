"""Client side of the controller's security: bearer tokens and TLS files for
the CLI's gRPC calls, and ``specctl token new``.

A token is 32 random bytes (URL-safe base64). The controller's config keeps
only its SHA-256 digest, so the config file is no secret; the token itself is
shown once, or written to a file only its owner can read.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from controller.auth import token_digest


class ClientSecurityError(ValueError):
    """A client credential that cannot be used; the message names the flag and the path."""


def new_token() -> str:
    """A fresh bearer token.

    >>> len(new_token()) >= 43
    True
    """
    return secrets.token_urlsafe(32)


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


def config_line(kind: str, name: str, token: str) -> str:
    """The YAML to add under ``security.auth.workers`` (or ``admins``).

    >>> config_line("workers", "gpu-17", "abc")
    'gpu-17: sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'
    """
    return yaml.safe_dump({name: token_digest(token)}, default_flow_style=False, width=200).strip()


def run_token_new(args: argparse.Namespace) -> int:
    """``specctl token new --worker ID | --admin NAME [--out FILE]``."""
    kind, name = ("workers", args.worker) if args.worker is not None else ("admins", args.admin)
    if not name.strip():
        print(f"specctl token new: --{kind[:-1]}={name!r}: must be a non-empty name", file=sys.stderr)
        return 2
    token = new_token()
    if args.out:
        try:
            fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            print(f"specctl token new: --out={args.out!r}: {err.strerror or err}", file=sys.stderr)
            return 2
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        print(f"token for {kind[:-1]} {name!r} written to {args.out} (mode 600)")
    else:
        print(f"token for {kind[:-1]} {name!r} (shown once: the controller keeps only its digest):")
        print(token)
    print(f"add under security.auth.{kind} in the controller config:")
    print("    " + config_line(kind, name, token))
    return 0


def add_token_command(sub: argparse._SubParsersAction) -> None:
    token = sub.add_parser("token", help="bearer tokens for workers and admins")
    actions = token.add_subparsers(dest="token_command", required=True)
    new = actions.add_parser("new", help="make a token; prints it and the config line with its digest")
    who = new.add_mutually_exclusive_group(required=True)
    who.add_argument("--worker", metavar="ID", help="the worker id the token acts as")
    who.add_argument("--admin", metavar="NAME", help="an admin token (policy reload, alert ack)")
    new.add_argument("--out", metavar="FILE", help="write the token to this new file (mode 600) instead of printing it")
    new.set_defaults(func=run_token_new)
