"""Pipelined GETs whose values land in the caller's memory, and SETs sent from it: the RESP replies
are parsed here and each bulk value is received with `recv_into` straight into the buffers the
caller gave (or sent from them, header and payload as they are), on a connection redis-py opened
(so TLS, AUTH, SELECT and redis-py's URL options stay redis-py's).

Why not redis-py's own reads: with hiredis it receives a reply into a buffer of its own, copies it
into the hiredis reader, and hands back a new bytes object, which G4 then copied into G2 or G1:
three copies of every 720 KiB value besides the kernel's. 256 such values from a loopback Redis
(AMD EPYC, 2 cores) took 0.21 s that way and 0.10-0.14 s this way, checksums included; SETs of
them, 0.35-0.43 s through a redis-py pipeline (each value first joined to its header) and about
0.06 s this way.

Only what a GET or a SET can answer is understood: a bulk string, a null (RESP2's `$-1`, RESP3's
`_`), `+OK`, or an error. Anything else (a RESP3 push, a reply from a command somebody else left unread) is a
`ProtocolError`; the caller drops the connection, since its stream is no longer in step.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

LINE_LIMIT = 64  # a GET reply's first line is "$<length>\r\n" or an error message (cut here)
BUFFER_BYTES = 64 * 2**10  # read ahead for reply lines; a value's bulk goes straight to its target


class ProtocolError(Exception):
    """The connection sent something a GET cannot answer: its stream is out of step."""


class Got(enum.Enum):
    OK = "ok"  # a SET took its value
    FILLED = "filled"  # the value had the targets' length and is in them
    NULL = "null"  # no such key
    OTHER = "other"  # a value of another length: its first len(head) bytes in `Reply.value`
    ERROR = "error"  # an error reply (e.g. MOVED in a cluster): its text in `Reply.value`


@dataclass(frozen=True)
class Reply:
    got: Got
    value: bytes = b""
    length: int = 0  # OTHER: the value's whole length


class BulkReader:
    """RESP replies off one socket (a plain or TLS socket: anything with `recv_into`)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray(BUFFER_BYTES)
        self._lo = self._hi = 0  # the unread bytes are _buf[_lo:_hi]

    def reply(self, head: memoryview, body: memoryview) -> Reply:
        """The next reply: a value of len(head) + len(body) bytes is received into head then body."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return Reply(Got.ERROR, rest)
        if kind == b"_" or line == b"$-1":
            return Reply(Got.NULL)
        if kind != b"$" or not rest.isdigit():
            raise ProtocolError(f"not a GET reply: {line[:LINE_LIMIT]!r}")
        n = int(rest)
        if n == head.nbytes + body.nbytes:
            self._into(head)
            self._into(body)
            self._crlf()
            return Reply(Got.FILLED)
        # Someone else's value (or a damaged one): its header is enough to judge it, and the rest is
        # dropped as it comes, so a huge foreign value costs no memory.
        value = bytearray(min(n, head.nbytes))
        self._into(memoryview(value))
        self._skip(n - len(value))
        self._crlf()
        return Reply(Got.OTHER, bytes(value), n)

    def status(self) -> Reply:
        """The next reply, a SET's: OK or an error."""
        line = self._line()
        if line == b"+OK":
            return Reply(Got.OK)
        if line[:1] == b"-":
            return Reply(Got.ERROR, line[1:])
        raise ProtocolError(f"not a SET reply: {line[:LINE_LIMIT]!r}")

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):  # keep the unread tail, at the front
            self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, self._hi - self._lo
        n = self._sock.recv_into(memoryview(self._buf)[self._hi:])
        if not n:
            raise ConnectionError("the server closed the connection")
        self._hi += n

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._buf[self._lo:end])
                self._lo = end + 2
                return line
            if self._hi - self._lo >= BUFFER_BYTES // 2:  # no GET reply line is this long
                raise ProtocolError("a reply line longer than a GET reply's")
            self._fill()

    def _into(self, out: memoryview) -> None:
        took = min(out.nbytes, self._hi - self._lo)
        out[:took] = self._buf[self._lo:self._lo + took]
        self._lo += took
        rest = out[took:]
        while rest.nbytes:  # the bulk of a value: no stop in our buffer
            n = self._sock.recv_into(rest)
            if not n:
                raise ConnectionError("the server closed the connection mid-value")
            rest = rest[n:]

    def _skip(self, n: int) -> None:
        while n:
            if self._lo == self._hi:
                self._fill()
            took = min(n, self._hi - self._lo)
            self._lo += took
            n -= took

    def _crlf(self) -> None:
        while self._hi - self._lo < 2:
            self._fill()
        if self._buf[self._lo:self._lo + 2] != b"\r\n":
            raise ProtocolError("a bulk value not followed by CRLF")
        self._lo += 2


def get_into(pool: Any, names: Sequence[str], heads: Sequence[memoryview], bodies: Sequence[memoryview]) -> list[Reply]:
    """GET `names` in one pipelined round trip on a connection from redis-py's `pool`; a value of
    the right length lands in heads[i] then bodies[i]. Socket errors and timeouts raise (redis-py's
    or OSError), as does ProtocolError; the connection is dropped then, and given back otherwise."""
    packed = lambda conn: conn.pack_commands([("GET", name) for name in names])  # noqa: E731
    return _round_trip(pool, packed, lambda reader: [reader.reply(h, b) for h, b in zip(heads, bodies)])


def set_many(pool: Any, names: Sequence[str], heads: Sequence[bytes], bodies: Sequence[memoryview],
             px: int | None = None) -> list[Reply]:
    """SET names[i] to heads[i] + bodies[i] (expiring after `px` ms when given) in one pipelined
    round trip, each body sent from where it is; OK or ERROR per name. Raises as `get_into` does."""
    expiry = b"" if px is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
    chunks: list[bytes | memoryview] = []
    small = bytearray()  # command framing and headers between two bodies: one send, not five
    for name, head, body in zip(names, heads, bodies):
        key = name.encode()
        small += b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if px is None else 5, len(key), key,
                                                                    len(head) + body.nbytes)
        small += head
        chunks += [bytes(small), body]
        small = bytearray(b"\r\n" + expiry)
    chunks.append(bytes(small))
    return _round_trip(pool, lambda conn: chunks, lambda reader: [reader.status() for _ in names])


def _round_trip(pool: Any, packed: Callable[[Any], Any], read: Callable[[BulkReader], list[Reply]]) -> list[Reply]:
    conn = pool.get_connection()
    try:
        conn.send_packed_command(packed(conn), check_health=False)
        return read(BulkReader(conn._sock))  # redis-py's socket: its parser has nothing buffered (pool checks)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
