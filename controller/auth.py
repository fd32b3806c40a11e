"""Who may call the controller, and as whom.

When the config has a ``security.auth`` section every call of the
SpeculationController service carries ``authorization: Bearer <token>``
metadata, and the token decides what the call may do:

==============================  ===========================================
method                          needs
==============================  ===========================================
Connect, Decide                 a worker token; every Hello (and Decide's
                                ``worker_id``) must name the token's worker
GetStatus, WatchAlerts          any valid token, worker or admin (read-only)
ReloadPolicy, AckAlert          an admin token
any method not listed here      an admin token (new RPCs are closed until
                                they are listed in ``METHOD_ROLES``)
==============================  ===========================================

No token, a malformed header or an unknown token is UNAUTHENTICATED; a valid
token on a call it may not make, or naming another worker, is
PERMISSION_DENIED. With ``bind_client_cert`` (mutual TLS) a worker token is
accepted only over a connection whose client certificate names that worker
id in its CN or a SAN, so a leaked token is useless without the key.

The config holds only SHA-256 digests. A presented token is hashed and
compared with every digest by ``hmac.compare_digest``, all of them every
time, so timing tells neither whether nor where it matched. Tokens are never
logged and never echoed in an error. The health and reflection services stay
open (they tell nothing of the fleet).

``Authenticator`` is plain logic; ``guard_handlers`` wraps the servicer's
method handlers with it, and the servicer reads the caller with
``current_identity()`` to bind Hello and Decide to the token's worker.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import inspect
import logging
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable, Mapping

import grpc

from controller.config import AuthSettings

log = logging.getLogger("specctl.auth")


class Role(enum.Enum):
    WORKER = "worker"  # acts as one worker: a worker token, bound to the messages' worker id
    READ = "read"  # any valid token
    ADMIN = "admin"  # an admin token


METHOD_ROLES: Mapping[str, Role] = {
    "Connect": Role.WORKER,
    "Decide": Role.WORKER,
    "GetStatus": Role.READ,
    "WatchAlerts": Role.READ,
    "ReloadPolicy": Role.ADMIN,
    "AckAlert": Role.ADMIN,
}


@dataclass(frozen=True)
class Identity:
    """An authenticated caller: a worker (``name`` = worker id) or an admin."""

    kind: Role  # Role.WORKER or Role.ADMIN
    name: str

    def __str__(self) -> str:
        return f"{self.kind.value} {self.name!r}"


class AuthError(Exception):
    """A refused call: the gRPC status to answer with and a message safe to send back."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # short counter key, e.g. "unknown_token"
        self.message = message


def token_digest(token: str) -> str:
    """The config form of a token: ``sha256:<hex>``.

    >>> token_digest("abc")[:15]
    'sha256:ba7816bf'
    """
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    """Turns a call's metadata and TLS auth context into an ``Identity`` or an ``AuthError``.

    ``failures`` counts refusals by reason (``missing_token``, ``malformed_header``,
    ``unknown_token``, ``certificate_mismatch``, ``not_allowed``, ``wrong_worker``).
    """

    def __init__(self, settings: AuthSettings | None) -> None:
        self.enabled = settings is not None
        self.bind_client_cert = bool(settings and settings.bind_client_cert)
        self._digests: list[tuple[bytes, Identity]] = []
        if settings is not None:
            for kind, table in ((Role.WORKER, settings.workers), (Role.ADMIN, settings.admins)):
                for name, digests in table.items():
                    for d in digests:
                        self._digests.append((bytes.fromhex(d.removeprefix("sha256:")), Identity(kind, name)))
        self.failures: Counter[str] = Counter()

    # ------------------------------------------------------------ per call
    def admit(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None,
              auth_context: Mapping[str, list[bytes]] | None) -> Identity:
        """Authenticate a call of ``method`` and check its role may make it."""
        try:
            identity = self._authenticate(metadata or (), auth_context or {})
            needed = METHOD_ROLES.get(method, Role.ADMIN)
            if needed is not Role.READ and identity.kind is not needed:
                raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "not_allowed",
                                f"{method} needs {_article(needed)} token; this is the token of {identity}")
        except AuthError as err:
            self.failures[err.reason] += 1
            raise
        return identity

    def check_worker(self, identity: Identity | None, worker_id: str) -> AuthError | None:
        """The refusal for ``identity`` acting as ``worker_id``, or None when it may."""
        if not self.enabled:
            return None
        if identity is None:
            err = AuthError(grpc.StatusCode.UNAUTHENTICATED, "missing_token", "no authenticated caller")
        elif identity.kind is not Role.WORKER or identity.name != worker_id:
            err = AuthError(grpc.StatusCode.PERMISSION_DENIED, "wrong_worker",
                            f"the token of {identity} cannot act as worker {worker_id!r}")
        else:
            return None
        self.failures[err.reason] += 1
        log.warning("refused: %s", err.message)
        return err

    def _authenticate(self, metadata: Iterable[tuple[str, str | bytes]],
                      auth_context: Mapping[str, list[bytes]]) -> Identity:
        values = [v for k, v in metadata if k.lower() == "authorization"]
        if not values:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "missing_token",
                            "missing 'authorization: Bearer <token>' metadata")
        if len(values) > 1:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "malformed_header",
                            "more than one authorization metadata entry")
        value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "malformed_header",
                            "authorization metadata must be 'Bearer <token>'")
        identity = self._lookup(token)
        if identity is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown_token", "unknown bearer token")
        if self.bind_client_cert and identity.kind is Role.WORKER:
            names = certificate_names(auth_context)
            if identity.name not in names:
                raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "certificate_mismatch",
                                f"the client certificate (names {sorted(names)}) does not name worker "
                                f"{identity.name!r}")
        return identity

    def _lookup(self, token: str) -> Identity | None:
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, identity in self._digests:  # no early exit: every call compares every digest
            if hmac.compare_digest(presented, digest):
                found = identity
        return found


def certificate_names(auth_context: Mapping[str, list[bytes]]) -> set[str]:
    """CN and subject alternative names of the verified client certificate."""
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode("utf-8", "replace") for v in auth_context.get(key, ()))
    return names


def _article(role: Role) -> str:
    return "an admin" if role is Role.ADMIN else "a worker"


# ------------------------------------------------------------------ gRPC glue
_CALLER: ContextVar[Identity | None] = ContextVar("specctl_caller", default=None)


def current_identity() -> Identity | None:
    """The caller of the RPC this task is serving (None when auth is off)."""
    return _CALLER.get()


def guard_handlers(handlers: dict[str, grpc.RpcMethodHandler], auth: Authenticator) -> dict[str, grpc.RpcMethodHandler]:
    """Wrap every method handler so a call is admitted before any of its
    payload is read; unchanged when auth is off."""
    if not auth.enabled:
        return handlers
    return {name: _guard(name, handler, auth) for name, handler in handlers.items()}


def _guard(method: str, handler: grpc.RpcMethodHandler, auth: Authenticator) -> grpc.RpcMethodHandler:
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    behaviour = getattr(handler, kind)

    async def admit(context: grpc.aio.ServicerContext) -> None:
        try:
            identity = auth.admit(method, context.invocation_metadata(), context.auth_context())
        except AuthError as err:
            log.warning("refused %s from %s: %s", method, context.peer(), err.message)
            await context.abort(err.code, err.message)
        # Each RPC runs in its own task, so this is seen by this call only.
        _CALLER.set(identity)

    if inspect.isasyncgenfunction(behaviour):
        async def guarded_stream(request, context):
            await admit(context)
            responses = behaviour(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()

        return handler._replace(**{kind: guarded_stream})
    if inspect.iscoroutinefunction(behaviour):
        async def guarded_call(request, context):
            await admit(context)
            return await behaviour(request, context)

        return handler._replace(**{kind: guarded_call})
    raise TypeError(f"{method}: auth guards async handlers only, got {behaviour!r}")
