"""``specctl token new``: bearer tokens for workers and admins. (The client
side of TLS and tokens, for the CLI and workers, is ``worker.sdk.security``.)

A token is 32 random bytes (URL-safe base64). The controller's config keeps
only its SHA-256 digest, so the config file is no secret; the token itself is
shown once, or written to a file only its owner can read.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import yaml

from controller.auth import token_digest


def new_token() -> str:
    """A fresh bearer token.

    >>> len(new_token()) >= 43
    True
    """
    return secrets.token_urlsafe(32)


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
