"""G4: a shared remote tier on Redis or Valkey, as a `StorageBackend` over redis-py.

Many engines on many machines point at one Redis (or a Redis Cluster) and reuse each other's
prefixes. The server does the evicting (`maxmemory-policy allkeys-lru` is the recommended
setting); entries may also carry a TTL.

Keys are `{prefix}:{namespace hex}:{block key hex}`, the namespace being the model fingerprint,
so another model or dtype never reads these entries; `{prefix}:{namespace hex}:namespace`, written
on connecting, says which model it is (`kvstore.namespace_info`, for `kvtier kv`). Values are the
same self-checking entry as G3's files (magic, version, namespace, key, payload length and checksum, header checksum;
see `kvstore.entry`), so a value written under the wrong key, truncated, or written by another
model is a miss: counted in `stats.corrupt`, deleted, logged, never served. With a KV secret
(`RemoteConfig.secret`) values carry keyed MACs, and any value that fails them, unkeyed ones
included, is such a miss: a client that can write to the Redis cannot plant KV.

Every call is one pipelined round trip per batch (per node in a cluster), never one per block.

Faults become misses. Every command has a socket timeout. After a connection error or a
timeout, a circuit breaker opens: calls return misses at once, without touching the network,
for a cool-down that doubles on each failed retry (capped); then one call probes the server.
So a dead remote costs one timeout per cool-down, not one per request, and the log says so
once when it goes down and once when it comes back. A rejected password disables the tier for
the life of the process, with one warning.
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from kvstore import resp
from kvstore.backend import BackendError, BackendStats, Buffer, StorageBackend, check_blocks, check_keys, check_outs
from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec, check_secret
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.namespace_info import check_info, encode_record, redis_record_key
from kvstore.resp import Got, Reply

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
ENV_USER, ENV_PASSWORD = "KVTIER_REDIS_USERNAME", "KVTIER_REDIS_PASSWORD"


def redact(url: str) -> str:
    """The URL with any password replaced by '***' (for logs and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> None:
    """ValueError unless `url` has a G4 scheme (the password is never echoed)."""
    if urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"remote URL scheme must be one of {', '.join(s + '://' for s in SCHEMES)}; "
                         f"got {redact(url)!r}")


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # redis://[user:pass@]host:port[/db], rediss://..., redis+cluster://host:port,host:port
    namespace: bytes  # the 16-byte model fingerprint digest
    prefix: str = "kvtier"
    ttl_s: float | None = None  # per-entry expiry; None: until the server evicts it
    timeout_s: float = 0.5  # socket timeout of every command
    cooldown_s: float = 2.0  # first circuit-breaker pause; doubles per failed probe
    max_cooldown_s: float = 60.0
    # KV secret: values carry keyed MACs and unkeyed ones are rejected (see kvstore.entry)
    secret: bytes | None = field(default=None, repr=False)
    # What the namespace is: written to {prefix}:{namespace hex}:namespace for the `kvtier kv`
    # tools (kvstore.namespace_info); informational, never read back by the tier.
    info: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_url(self.url)
        check_secret(self.secret)
        check_info(self.info)
        if type(self.namespace) is not bytes or len(self.namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes")
        if not self.prefix or any(c in self.prefix for c in " \n\r"):
            raise ValueError(f"prefix must be a non-empty string without whitespace; got {self.prefix!r}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0; got {self.ttl_s}")
        if self.timeout_s <= 0 or self.cooldown_s <= 0 or self.max_cooldown_s < self.cooldown_s:
            raise ValueError("timeout_s and cooldown_s must be > 0, and max_cooldown_s >= cooldown_s")

    @property
    def cluster(self) -> bool:
        return urlsplit(self.url).scheme.endswith("+cluster")


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are misses until the cool-down ends
    HALF_OPEN = "half_open"  # one probe call is in flight


@dataclass
class CircuitBreaker:
    cooldown_s: float
    max_cooldown_s: float
    what: str  # for the log lines
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    opens: int = 0  # times it went from closed to open
    _pause: float = 0.0
    _until: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN and self.clock() >= self._until:
                self.state = BreakerState.HALF_OPEN  # this caller probes; the others still miss
                return True
            return False

    def next_probe_in(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when closed or due now)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return 0.0
            return max(0.0, self._until - self.clock())

    def success(self) -> None:
        with self._lock:
            if self.state is not BreakerState.CLOSED:
                log.warning("%s is reachable again; G4 resumes", self.what)
            self.state, self._pause = BreakerState.CLOSED, 0.0

    def failure(self, err: BaseException) -> None:
        with self._lock:
            if self.state is BreakerState.CLOSED:
                self.opens += 1
                self._pause = self.cooldown_s
                log.warning("%s failed (%s: %s); G4 lookups and writes are misses, retrying in %.1fs",
                            self.what, type(err).__name__, err, self._pause)
            else:  # a failed probe: wait longer, quietly
                self._pause = min(self._pause * 2, self.max_cooldown_s)
                log.debug("%s still failing (%s); next probe in %.1fs", self.what, err, self._pause)
            self.state, self._until = BreakerState.OPEN, self.clock() + self._pause


# What one recv takes off a connection's socket. redis-py's 64 KiB default cut every 720 KiB block
# into a dozen recv + parser-feed rounds in Python under the GIL: at 8k tokens (demo model, AMD
# EPYC, 2 cores, loopback Redis) a G4 load took 0.38 s that way and 0.32 s with 1 MiB reads.
SOCKET_READ_BYTES = 2**20


def connect(url: str, timeout_s: float) -> Any:
    """A redis-py client for a G4 URL (cluster or not), credentials from the URL or the environment,
    `timeout_s` on every socket operation and no retries (the caller decides what a failure means)."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    parts = urlsplit(url)
    username = unquote(parts.username) if parts.username else os.environ.get(ENV_USER) or None
    password = unquote(parts.password) if parts.password else os.environ.get(ENV_PASSWORD) or None
    common = dict(username=username, password=password, socket_timeout=timeout_s,
                  socket_connect_timeout=timeout_s, retry_on_timeout=False, socket_read_size=SOCKET_READ_BYTES)
    tls = parts.scheme.startswith("rediss")
    if parts.scheme.endswith("+cluster"):
        hosts = parts.netloc.rsplit("@", 1)[-1].split(",")
        nodes = []
        for h in hosts:
            host, _, port = h.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"cluster node {h!r} in {redact(url)!r} is not host:port")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        # No retries inside redis-py: the breaker is the retry policy.
        return RedisCluster(startup_nodes=nodes, ssl=tls, cluster_error_retry_attempts=0, **common)
    plain = urlunsplit(parts._replace(scheme="rediss" if tls else "redis", netloc=parts.netloc.rsplit("@", 1)[-1]))
    return redis.Redis.from_url(plain, **common)


class RedisBackend(StorageBackend):
    """Blocks in Redis/Valkey (see the module docstring). `client` is for tests; `in_place=False`
    sends and reads through redis-py's pipelines only (what it falls back to; for comparisons)."""

    name = "redis"  # its name in a tier stack (connectors.stack) and in /v1/kv/stats
    shared = True  # anyone who can write to the server can write entries

    def __init__(self, cfg: RemoteConfig, client: Any = None, *, in_place: bool = True) -> None:
        import redis
        import redis.exceptions

        self.cfg = cfg
        self.url = redact(cfg.url)
        self.stats = BackendStats()
        self.disabled: str | None = None  # why the tier is off for good (a rejected password)
        self.breaker = CircuitBreaker(cfg.cooldown_s, cfg.max_cooldown_s, f"G4 remote {self.url}")
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._redis_error = redis.RedisError
        self._auth_errors = (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)
        self._closed = False
        self._ns = cfg.namespace.hex()
        self._codec = EntryCodec(cfg.secret)
        self._direct_io = in_place  # get_into and put use kvstore.resp until a reply says not to
        try:
            self.client = client if client is not None else connect(cfg.url, cfg.timeout_s)
        except self._auth_errors as e:
            self._disable(e)
            self.client = None
        except self._errors as e:  # a cluster client contacts its nodes at construction
            self.breaker.failure(e)
            self.client = None
        if self.client is not None:
            self._probe()

    # -- the contract ------------------------------------------------------------------------
    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        res = self._pipeline(lambda p: [p.exists(self._name(k)) for k in keys])
        return [bool(r) and not isinstance(r, Exception) for r in res] if res else [False] * len(keys)

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        check_keys(keys)
        return [None if v is None else bytes(v) for v in self._fetch(keys)]

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[bool]:
        """Values are received straight into `outs` (kvstore.resp), not copied out of replies."""
        views, keys = check_outs(keys, outs), list(keys)
        if not keys:
            return []
        heads = memoryview(bytearray(HEADER_SIZE * len(keys)))
        heads_at = [heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE] for i in range(len(keys))]
        replies = self._call(lambda: self._direct_get(keys, heads_at, views)) if self._direct_io else None
        if replies is None and self._direct_io:  # off, or a failure the breaker now knows of
            self.stats.misses += len(keys)
            return [False] * len(keys)
        if replies is None:
            return self._copy_into(keys, views)
        # Error replies (a cluster's MOVED) are asked again the way redis-py asks, and counted there.
        again = [i for i, r in enumerate(replies) if r.got is Got.ERROR]
        answered = [i for i, r in enumerate(replies) if r.got is not Got.ERROR]
        results: list[memoryview | CorruptEntry | None] = []
        for i in answered:
            k, r = keys[i], replies[i]
            if r.got is Got.FILLED:
                results.append(self._checked(lambda: self._open(k, heads_at[i], views[i])))
            elif r.got is Got.OTHER:  # a header is enough to tell another size from damage
                results.append(self._checked(lambda: self._open(k, r.value, None, r.length - HEADER_SIZE)))
            else:
                results.append(None)
        filled = [False] * len(keys)
        for i, v in zip(answered, self._settle([keys[i] for i in answered], results)):
            filled[i] = v is not None and v.nbytes == views[i].nbytes
        if again:
            for i, ok in zip(again, self._copy_into([keys[i] for i in again], [views[i] for i in again])):
                filled[i] = ok
        return filled

    def get_views(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        """Each checked payload as a view of the reply's bytes: no copy."""
        check_keys(keys)
        return self._fetch(list(keys))

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        """Values are sent from `blocks` as they are, after their headers (kvstore.resp)."""
        check_keys(keys)
        views, keys = check_blocks(keys, blocks), list(keys)
        if not keys:
            return []
        heads = [self._codec.seal(self.cfg.namespace, k, v) for k, v in zip(keys, views)]
        px = None if self.cfg.ttl_s is None else max(int(self.cfg.ttl_s * 1000), 1)
        replies = self._call(lambda: self._direct_set(keys, heads, views, px)) if self._direct_io else None
        if replies is None and self._direct_io:  # off, or a failure the breaker now knows of
            return [False] * len(keys)
        if replies is None:
            return self._pipeline_set(keys, heads, views, px)
        ok = [r.got is Got.OK for r in replies]
        self.stats.bytes_written += sum(len(h) + v.nbytes for h, v, good in zip(heads, views, ok) if good)
        again = [i for i, r in enumerate(replies) if r.got is Got.ERROR]  # a cluster's MOVED; or refused again below
        if again:
            for i, good in zip(again, self._pipeline_set([keys[i] for i in again], [heads[i] for i in again],
                                                         [views[i] for i in again], px)):
                ok[i] = good
        return ok

    def _pipeline_set(self, keys: list[BlockKey], heads: list[bytes], views: list[memoryview], px: int | None) -> list[bool]:
        """put the way redis-py sends: each value joined to its header first."""
        values = [h + bytes(v) for h, v in zip(heads, views)]
        res = self._pipeline(lambda p: [p.set(self._name(k), v, px=px) for k, v in zip(keys, values)])
        if res is None:
            return [False] * len(keys)
        ok = [r is True for r in res]
        failed = [r for r in res if isinstance(r, Exception)]
        if failed:  # e.g. OOM: maxmemory reached with a noeviction policy
            self.stats.write_errors += len(failed)
            log.warning("G4 refused %d of %d writes: %s", len(failed), len(keys), failed[0])
        self.stats.bytes_written += sum(len(v) for v, good in zip(values, ok) if good)
        return ok

    def delete(self, keys: Sequence[BlockKey]) -> None:
        check_keys(keys)
        if keys:
            self._pipeline(lambda p: [p.delete(self._name(k)) for k in keys])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.client is not None:
                self.client.close()

    @property
    def in_place(self) -> bool:
        """Whether values are sent and received in place (kvstore.resp), not through redis-py's pipelines."""
        return self._direct_io

    def describe(self) -> dict[str, Any]:
        """Stats for /v1/kv/stats: no password, ever."""
        return {"url": self.url, "breaker": self.breaker.state.value, "outages": self.breaker.opens,
                "disabled": self.disabled, "in_place": self.in_place, **vars(self.stats)}

    # -- internals ----------------------------------------------------------------------------
    def _name(self, key: BlockKey) -> str:
        return f"{self.cfg.prefix}:{self._ns}:{key.hex()}"

    def _disable(self, err: BaseException) -> None:
        self.disabled = f"{type(err).__name__}: {err}"
        log.warning("G4 remote %s rejected our credentials (%s); running with G4 disabled", self.url, self.disabled)

    def _probe(self) -> None:
        try:
            self.client.ping()
            log.info("G4 remote %s connected (key prefix %s:%s%s)", self.url, self.cfg.prefix, self._ns[:8],
                     "; values MAC'd with the KV secret" if self._codec.keyed else "")
            self._write_record()
        except self._auth_errors as e:
            self._disable(e)
        except self._redis_error as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e) or "invalid password" in str(e).lower():
                self._disable(e)
            else:
                self.breaker.failure(e)

    def _write_record(self) -> None:
        """The namespace record (kvstore.namespace_info); best effort: a refusal (a read-only
        replica, maxmemory with noeviction) or a dropped connection costs the record, nothing else."""
        if self.cfg.info is None:
            return
        try:
            self.client.set(redis_record_key(self.cfg.prefix, self.cfg.namespace),
                            encode_record(self.cfg.namespace, self.cfg.info))
        except self._redis_error as e:
            log.debug("G4 cannot write the namespace record: %s", e)

    def _pipeline(self, build: Callable[[Any], Any]) -> list[Any] | None:
        """One round trip; None when the tier is off, the breaker is open, or the call failed."""
        return self._call(lambda: self._execute(build))

    def _call(self, call: Callable[[], Any]) -> Any:
        """call() on a reachable server; None when the tier is off, the breaker is open, or it failed."""
        if self._closed:
            raise BackendError("G4 backend is closed")
        if self.disabled or not self.breaker.allow():
            return None
        if self.client is None:  # the cluster was unreachable at start-up: try again now
            self.client = self._guarded(lambda: connect(self.cfg.url, self.cfg.timeout_s))
            if self.client is None:
                return None
        return self._guarded(call)

    def _execute(self, build: Callable[[Any], Any]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        build(pipe)
        res = pipe.execute(raise_on_error=False)
        conn_errors = [r for r in res if isinstance(r, self._errors)]
        if conn_errors:
            raise conn_errors[0]
        self.breaker.success()
        return res

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """call(), or None after turning its failure into the breaker's or the tier's state."""
        try:
            return call()
        except self._auth_errors as e:
            self._disable(e)
        except self._errors as e:
            self.breaker.failure(e)
        except self._redis_error as e:  # a server-side refusal: the server is reachable
            log.warning("G4 call failed: %s: %s", type(e).__name__, e)
            self.breaker.success()
        return None

    def _copy_into(self, keys: list[BlockKey], views: list[memoryview]) -> list[bool]:
        """get_into the way redis-py reads: each value copied out of its reply."""
        filled = []
        for v, out in zip(self._fetch(keys), views):
            ok = v is not None and v.nbytes == out.nbytes
            if ok:
                out[:] = v
            filled.append(ok)
        return filled

    def _direct_get(self, keys: list[BlockKey], heads: list[memoryview], bodies: list[memoryview]) -> list[Reply] | None:
        """GETs whose values land in heads[i] + bodies[i] (kvstore.resp), one round trip per node."""
        return self._per_node(keys, lambda pool, names, idx: resp.get_into(
            pool, names, [heads[i] for i in idx], [bodies[i] for i in idx]))

    def _direct_set(self, keys: list[BlockKey], heads: list[bytes], bodies: list[memoryview], px: int | None) -> list[Reply] | None:
        """SETs sent from heads[i] and bodies[i] as they are (kvstore.resp), one round trip per node."""
        return self._per_node(keys, lambda pool, names, idx: resp.set_many(
            pool, names, [heads[i] for i in idx], [bodies[i] for i in idx], px))

    def _per_node(self, keys: list[BlockKey], call: Callable[[Any, list[str], list[int]], list[Reply]]) -> list[Reply] | None:
        """call(pool, names, indices) for each node's share of `keys`, their replies in keys' order;
        None (and redis-py's own reads and writes from now on) if a connection speaks something else."""
        names = [self._name(k) for k in keys]
        groups: dict[int, tuple[Any, list[int]]] = {}  # per connection pool: the keys' indices
        for i, name in enumerate(names):
            pool = (self.client.get_redis_connection(self.client.get_node_from_key(name)).connection_pool
                    if self.cfg.cluster else self.client.connection_pool)
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        replies: list[Reply] = [Reply(Got.NULL)] * len(keys)
        try:
            for pool, idx in groups.values():
                for i, r in zip(idx, call(pool, [names[i] for i in idx], idx)):
                    replies[i] = r
        except resp.ProtocolError as e:
            self._direct_io = False
            log.warning("G4 remote %s sent a reply a GET or SET cannot have (%s); going through redis-py from now on",
                        self.url, e)
            return None
        self.breaker.success()
        return replies

    def _fetch(self, keys: list[BlockKey]) -> list[memoryview | None]:
        res = self._pipeline(lambda p: [p.get(self._name(k)) for k in keys])
        if res is None:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        return self._settle(keys, [None if raw is None or isinstance(raw, Exception) else
                                   self._checked(lambda: self._open(k, raw, memoryview(raw)[HEADER_SIZE:]))
                                   for k, raw in zip(keys, res)])

    @staticmethod
    def _checked(open_: Callable[[], memoryview | None]) -> memoryview | CorruptEntry | None:
        try:
            return open_()
        except CorruptEntry as e:
            return e

    def _settle(self, keys: list[BlockKey], results: list[memoryview | CorruptEntry | None]) -> list[memoryview | None]:
        """Counts a read's hits, misses and damaged entries, and deletes the damaged ones (one log
        line per batch, not per block); the payloads, None for anything not served."""
        bad = [(k, e) for k, e in zip(keys, results) if isinstance(e, CorruptEntry)]
        for v in results:
            if isinstance(v, memoryview):
                self.stats.hits += 1
                self.stats.bytes_read += HEADER_SIZE + v.nbytes
            else:
                self.stats.misses += 1
        if bad:
            self.stats.corrupt += len(bad)
            log.warning("G4: %d bad entr%s rejected and deleted (first: %s: %s)", len(bad),
                        "y" if len(bad) == 1 else "ies", bad[0][0].hex(), bad[0][1])
            self.delete([k for k, _ in bad])
        return [v if isinstance(v, memoryview) else None for v in results]

    def _open(self, key: BlockKey, header: Buffer, payload: memoryview | None, length: int | None = None) -> memoryview | None:
        """The checked payload of the value under `key`, given its header bytes and its payload;
        with no payload (a value of another size than wanted, `length` payload bytes), None if it
        is an intact entry and CorruptEntry if it is not."""
        head = self._codec.open_header(header)
        if head.namespace != self.cfg.namespace:
            raise CorruptEntry("written by another model (namespace differs)")
        if head.key != key:
            raise CorruptEntry(f"holds key {head.key.hex()}, not the one it is stored under")
        n = payload.nbytes if payload is not None else length
        if n != head.payload_len:
            raise CorruptEntry(f"truncated: {n} of {head.payload_len} payload bytes")
        if payload is None:
            return None
        self._codec.check_payload(head, payload)
        return payload
