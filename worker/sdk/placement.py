"""Which controller replica a worker talks to (issue #30).

A worker is given one or several controller addresses. :class:`Targets`
turns them into the set of replicas (:class:`Endpoint`), resolving a name
with ``getaddrinfo`` when it stands for several; :class:`Placement` ranks
that set for one worker id by rendezvous (highest-random-weight) hashing and
keeps, per replica, whether it failed, when it may be retried and since when
it has answered health probes.

The hash (stable across processes, hosts and languages)::

    weight(address, worker_id) = first 8 bytes, read big-endian as an unsigned
                                 64-bit integer, of
                                 SHA-256(UTF-8(address) || 0x00 || UTF-8(worker_id))

A worker's replicas in order are the addresses by weight, highest first
(equal weights, which 64 bits make unheard of, by address string). Its
preferred replica is the first in that order that has not failed. Removing
a replica moves only the workers whose first choice it was, and each of them
to its own second choice, so they spread over the remaining replicas; adding
one takes about ``1 / (n + 1)`` of the workers, all of them to the new one.

Address strings are hashed exactly as the worker holds them (``10.0.0.5:50051``,
``[fd00::5]:50051``, ``ctl-a.example:50051``): workers that spell a replica
differently rank it differently, which changes who lands where but not the
spread.
"""

from __future__ import annotations

import hashlib
import ipaddress
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

# Schemes gRPC dials itself: such an entry is one replica, used as given.
_LITERAL_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_DEFAULT_PORT = 443  # gRPC's own default for a target without a port


def rendezvous_weight(address: str, worker_id: str) -> int:
    """The rendezvous weight of ``worker_id`` on the replica at ``address``.

    Parameters
    ----------
    address : str
        The replica's address as the worker dials it.
    worker_id : str
        ``Hello.worker_id``.

    Returns
    -------
    int
        The first 8 bytes of ``SHA-256(address || 0x00 || worker_id)`` (both
        UTF-8), big-endian: an integer in ``[0, 2**64)``.

    Examples
    --------
    >>> rendezvous_weight("10.0.0.1:50051", "gpu-17") == int.from_bytes(
    ...     hashlib.sha256(b"10.0.0.1:50051\\x00gpu-17").digest()[:8], "big")
    True
    """
    digest = hashlib.sha256(address.encode("utf-8") + b"\x00" + worker_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def rendezvous_order(addresses: Iterable[str], worker_id: str) -> list[str]:
    """``addresses`` (duplicates dropped) by rendezvous weight for ``worker_id``, highest first.

    Examples
    --------
    >>> order = rendezvous_order(["a:1", "b:1", "c:1"], "w")
    >>> sorted(order) == ["a:1", "b:1", "c:1"]
    True
    >>> rendezvous_order([a for a in order if a != order[0]], "w") == order[1:]
    True
    """
    return sorted(set(addresses), key=lambda a: (-rendezvous_weight(a, worker_id), a))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One controller replica as the agent dials it.

    Attributes
    ----------
    address : str
        The gRPC target the channel dials and the hash weighs.
    authority : str
        When ``address`` is an IP the agent resolved from a name: that name,
        which TLS checks the replica's certificate against (empty otherwise).
    """

    address: str
    authority: str = ""


def split_targets(spec: str | Sequence[str]) -> list[str]:
    """The entries of a target specification: a list, or one string whose
    commas separate entries (``--controller a:1,b:1``). Blanks and duplicates
    are dropped; ValueError when nothing is left.

    Examples
    --------
    >>> split_targets(" a:1, b:1,,a:1 ")
    ['a:1', 'b:1']
    >>> split_targets(["dns:///ctl:50051"])
    ['dns:///ctl:50051']
    """
    items = spec.split(",") if isinstance(spec, str) else [part for s in spec for part in str(s).split(",")]
    out: list[str] = []
    for item in (i.strip() for i in items):
        if item and item not in out:
            out.append(item)
    if not out:
        raise ValueError(f"no controller address in {spec!r}")
    return out


def _host_port(entry: str) -> tuple[str, int, str]:
    """(host, port, how the entry names it without a ``dns:`` prefix) of a
    ``host[:port]`` / ``[v6][:port]`` / ``dns:///host[:port]`` entry."""
    rest = entry
    if entry.startswith("dns:"):
        rest = entry[4:]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if authority or not slash:
                # getaddrinfo asks the system's resolver; a named DNS server would be silently ignored.
                raise ValueError(f"{entry!r}: only the system resolver is supported (write dns:///NAME:PORT)")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"{entry!r}: an IPv6 address is written [ADDRESS]:PORT")
        port_text = tail[1:]
    else:
        host, _, port_text = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    if not host:
        raise ValueError(f"{entry!r} names no host")
    try:
        port = int(port_text) if port_text else _DEFAULT_PORT
    except ValueError:
        raise ValueError(f"{entry!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{entry!r}: port {port} is out of range")
    return host, port, rest


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class Targets:
    """The replicas a worker may talk to, from its target entries.

    An entry is one replica unless it is a host name (``ctl:50051`` or
    ``dns:///ctl:50051``) that resolves to several addresses: then each
    address is a replica (``10.0.0.5:50051``, TLS still checked against the
    name). A name that resolves to one address stays as written, so gRPC
    resolves it itself as it would without this class. When a name resolves
    to IPv4 and IPv6 addresses only the IPv4 ones count: a dual-stack host
    (``localhost``) is one replica, not two. A name that does not resolve
    stays as written (gRPC retries it); IP literals and ``unix:``,
    ``ipv4:``, ``ipv6:`` and ``vsock:`` targets are never resolved.

    Parameters
    ----------
    spec : str or sequence of str
        See :func:`split_targets`.
    getaddrinfo : callable
        ``socket.getaddrinfo`` (a test passes its own).
    """

    spec: str | Sequence[str]
    getaddrinfo: Callable = socket.getaddrinfo
    entries: list[str] = field(init=False)
    resolved_at: float = field(init=False, default=float("-inf"))
    failures: int = field(init=False, default=0)  # names that did not resolve, counted per resolution
    has_names: bool = field(init=False, default=False)  # some entry is a host name: re-resolving may change the set

    def __post_init__(self) -> None:
        self.entries = split_targets(self.spec)
        # Parsing refuses a malformed entry now, not on the first dial.
        self.has_names = any(self._name(e) is not None for e in self.entries)

    def _name(self, entry: str) -> tuple[str, int] | None:
        if entry.startswith(_LITERAL_SCHEMES):
            return None
        host, port, _ = _host_port(entry)
        return None if _is_ip(host) else (host, port)

    def unresolved(self) -> list[Endpoint]:
        """Every entry as written (what the agent dials before its first resolution)."""
        return [Endpoint(e) for e in self.entries]

    def resolve(self) -> list[Endpoint]:
        """The replicas now. Blocks on the system resolver: call it off the event loop."""
        out: list[Endpoint] = []
        for entry in self.entries:
            name = self._name(entry)
            if name is None:
                out.append(Endpoint(entry))
                continue
            host, port = name
            try:
                infos = self.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                self.failures += 1
                out.append(Endpoint(entry))
                continue
            v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
            ips = list(dict.fromkeys(v4 or [info[4][0] for info in infos if info[0] == socket.AF_INET6]))
            if len(ips) <= 1:
                out.append(Endpoint(entry))
            else:
                out.extend(Endpoint(_join(ip, port), authority=host) for ip in ips)
        self.resolved_at = time.monotonic()
        return list(dict.fromkeys(out))


@dataclass(slots=True)
class _Health:
    failures: int = 0  # consecutive failures; 0 = eligible as a failover target
    retry_at: float = float("-inf")  # monotonic time before which a failed replica is not dialled
    serving_since: float | None = None  # first of an unbroken run of health probes that found it serving


class Placement:
    """One worker's view of the replicas: their rendezvous order and health.

    Rules:

    - **Failover**: after a failure the agent dials the first replica in
      rendezvous order that has not failed (at once, after a jitter of up to
      ``backoff_initial_s`` that spreads a dead replica's workers). When
      every replica has failed it dials the one whose retry time comes first;
      a replica's retry delay is drawn uniformly from ``[0, min(backoff_max_s,
      backoff_initial_s * 2**(failures - 1))]`` (exponential backoff, full
      jitter), its failure count starting over when a session on it lasted
      ``healthy_after_s``.
    - **Moving back**: a failed replica is not dialled again while another
      one works. Probes (the gRPC health check) of the replicas ranked above
      the one in use re-admit it once it has answered SERVING continuously
      for ``return_after_s``; the agent then moves to it. Waiting that long
      keeps a crash-looping replica from pulling its workers back and forth.

    Parameters
    ----------
    targets : Targets
        The replica set.
    worker_id : str
        The worker's id (the hash key).
    backoff_initial_s, backoff_max_s : float
        Retry delays of a failed replica (see above).
    return_after_s : float
        How long a replica ranked above the one in use must answer probes before the worker moves to it.
    healthy_after_s : float
        A session that lasted this long resets its replica's failure count.
    clock : callable
        Monotonic seconds (a test passes its own).
    rng : random.Random
        Jitter source.
    """

    def __init__(self, targets: Targets, worker_id: str, *, backoff_initial_s: float = 0.05,
                 backoff_max_s: float = 5.0, return_after_s: float = 30.0, healthy_after_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.targets = targets
        self.worker_id = worker_id
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.return_after_s = return_after_s
        self.healthy_after_s = healthy_after_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.order: list[Endpoint] = []
        self._health: dict[str, _Health] = {}
        self.update(targets.unresolved())

    def update(self, endpoints: Iterable[Endpoint]) -> bool:
        """Take a new replica set (a resolution); returns whether it changed.
        Health is kept for replicas still present and forgotten for the others."""
        by_address = {e.address: e for e in endpoints}
        if not by_address:
            return False
        order = [by_address[a] for a in rendezvous_order(by_address, self.worker_id)]
        if order == self.order:
            return False
        self.order = order
        self._health = {a: self._health.get(a, _Health()) for a in by_address}
        return True

    def health(self, endpoint: Endpoint) -> _Health:
        return self._health.setdefault(endpoint.address, _Health())

    def preferred(self) -> Endpoint:
        """The first replica in rendezvous order that has not failed (the first one when all have)."""
        return next((e for e in self.order if self._health[e.address].failures == 0), self.order[0])

    def next(self) -> tuple[Endpoint, float]:
        """The replica to dial now and how many seconds to wait first (see the class rules)."""
        for e in self.order:
            if self._health[e.address].failures == 0:
                return e, 0.0
        first = min(self.order, key=lambda e: self._health[e.address].retry_at)
        return first, max(0.0, self._health[first.address].retry_at - self.clock())

    def failed(self, endpoint: Endpoint, up_for_s: float = 0.0) -> None:
        """A session on ``endpoint`` failed (connect failed, the stream broke, or no answer in time)
        after being up for ``up_for_s``."""
        h = self.health(endpoint)
        h.failures = 1 if up_for_s >= self.healthy_after_s else h.failures + 1
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (h.failures - 1))
        h.retry_at = self.clock() + self.rng.uniform(0.0, cap)
        h.serving_since = None

    def lasted(self, endpoint: Endpoint, up_for_s: float) -> None:
        """A session on ``endpoint`` ended without a failure of the replica after ``up_for_s``."""
        if up_for_s >= self.healthy_after_s:
            self.health(endpoint).failures = 0

    def ahead_of(self, endpoint: Endpoint) -> list[Endpoint]:
        """The replicas ranked above ``endpoint`` (all of them when it left the set)."""
        for i, e in enumerate(self.order):
            if e.address == endpoint.address:
                return self.order[:i]
        return list(self.order)

    def probed(self, endpoint: Endpoint, serving: bool) -> None:
        """A health probe of ``endpoint`` found it serving or not."""
        h = self.health(endpoint)
        if not serving:
            h.serving_since = None
        elif h.serving_since is None:
            h.serving_since = self.clock()

    def return_target(self, current: Endpoint) -> Endpoint | None:
        """The best replica ranked above ``current`` that has answered probes
        for ``return_after_s`` (re-admitted: its failures are forgotten), else None."""
        now = self.clock()
        for e in self.ahead_of(current):
            h = self._health[e.address]
            if h.serving_since is not None and now - h.serving_since >= self.return_after_s:
                h.failures = 0
                h.retry_at = float("-inf")
                return e
        return None


# grpc.health.v1.Health/Check, encoded by hand so the SDK needs no grpcio-health-checking:
# HealthCheckRequest {string service = 1}, HealthCheckResponse {ServingStatus status = 1}, SERVING = 1.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def health_request(service: str) -> bytes:
    """A serialized ``HealthCheckRequest`` for ``service``.

    >>> health_request("s")
    b'\\n\\x01s'
    """
    name = service.encode("utf-8")
    if len(name) >= 128:
        raise ValueError("service name too long for a one-byte length")
    return b"\x0a" + bytes([len(name)]) + name


def health_serving(response: bytes) -> bool:
    """Whether a serialized ``HealthCheckResponse`` says SERVING (status 1).

    >>> health_serving(b"\\x08\\x01"), health_serving(b"\\x08\\x02"), health_serving(b"")
    (True, False, False)
    """
    return len(response) >= 2 and response[0] == 0x08 and response[1] == 0x01
