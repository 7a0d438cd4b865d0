"""kvstore.resp's reply reader against byte streams written by hand: a value lands whole in its
head and body however the stream is cut into receives, every other reply is told apart, and the
stream stays in step after each (the next reply is read right); broken streams raise."""
from __future__ import annotations

import random
import socket
import threading

import pytest

from kvstore.resp import BulkReader, Got, ProtocolError


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


def feed(stream: bytes, seed: int) -> tuple[socket.socket, threading.Thread]:
    """The read end of a socket pair whose other end sends `stream` in random small pieces."""
    rd, wr = socket.socketpair()
    rng = random.Random(seed)

    def send() -> None:
        i = 0
        while i < len(stream):
            n = rng.choice([1, 2, 7, 100, 4096, 70000])
            wr.sendall(stream[i:i + n])
            i += n
        wr.close()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return rd, t


def targets(head: int, body: int) -> tuple[memoryview, memoryview]:
    return memoryview(bytearray(head)), memoryview(bytearray(body))


@pytest.mark.parametrize("seed", range(4))
def test_replies_are_told_apart_and_values_land_in_place(seed):
    rng = random.Random(seed)
    big = rng.randbytes(300_000)  # larger than the read-ahead buffer: the bulk goes to the target
    small = rng.randbytes(40)
    other = rng.randbytes(1000)
    stream = (bulk(big) + b"$-1\r\n" + bulk(other) + b"_\r\n" + b"-MOVED 3999 127.0.0.1:6381\r\n"
              + bulk(small) + bulk(b"") + bulk(big[:5]))
    rd, t = feed(stream, seed)
    r = BulkReader(rd)
    h, b = targets(16, len(big) - 16)
    assert r.reply(h, b).got is Got.FILLED and bytes(h) + bytes(b) == big
    assert r.reply(*targets(16, 10)).got is Got.NULL
    got = r.reply(*targets(16, 10))  # another length: only the first len(head) bytes are kept
    assert (got.got, got.value, got.length) == (Got.OTHER, other[:16], 1000)
    assert r.reply(*targets(16, 10)).got is Got.NULL  # RESP3's null
    got = r.reply(*targets(16, 10))
    assert (got.got, got.value) == (Got.ERROR, b"MOVED 3999 127.0.0.1:6381")
    h, b = targets(16, 24)
    assert r.reply(h, b).got is Got.FILLED and bytes(h) + bytes(b) == small
    h, b = targets(0, 0)
    assert r.reply(h, b).got is Got.FILLED  # an empty value into empty targets
    got = r.reply(*targets(16, 10))  # shorter than the head
    assert (got.got, got.value, got.length) == (Got.OTHER, big[:5], 5)
    t.join()
    rd.close()


@pytest.mark.parametrize("stream, error", [
    (b"+OK\r\n", ProtocolError),  # not something a GET answers
    (b">3\r\n", ProtocolError),  # a RESP3 push
    (b"$12x\r\n", ProtocolError),
    (b"$3\r\nabcXY", ProtocolError),  # no CRLF after the value
    (b"$" + b"9" * 40000, ProtocolError),  # a line that never ends
    (b"$10\r\nabc", ConnectionError),  # closed mid-value
    (b"", ConnectionError),
])
def test_broken_streams_raise(stream, error):
    rd, t = feed(stream, 0)
    with pytest.raises(error):
        BulkReader(rd).reply(*targets(4, 6))
    t.join()
    rd.close()
