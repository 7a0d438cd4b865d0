"""The KV-event replay endpoint (vLLM's `replay_endpoint`): a subscriber that saw a sequence gap,
or joined late, asks for the batches it missed.

Protocol, vLLM 0.32's (and what vllm-router's kv_index sends): the client's DEALER sends
`[b"", start_seq (8 bytes, big-endian)]`; the ROUTER answers each buffered batch whose sequence
number is >= start_seq as `[b"", topic, seq, payload]`, then `[b"", b"", END_SEQ, b""]` with
END_SEQ = -1 (8 bytes, signed). The last `buffer_steps` batches are kept. A thread of its own
answers, so a replica with no requests (no engine steps) still answers.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 100  # how often the thread looks at its stop flag


class ReplayServer:
    """Owns the ROUTER socket, the buffer of recent batches and the thread that answers."""

    def __init__(self, ctx, endpoint: str, topic: bytes, buffer_steps: int) -> None:
        import zmq

        if buffer_steps < 1:
            raise ValueError(f"kv_events_config.buffer_steps must be >= 1; got {buffer_steps}")
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"cannot bind kv events replay endpoint {endpoint!r}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtier-kv-replay", daemon=True)
        self._thread.start()

    def record(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._buffer.append((seq, payload))

    def _serve(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events replay: malformed request of %d frames, ignored", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in batches:
                    self._sock.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
                self._sock.send_multipart([client, b"", b"", END_SEQ, b""])
            except zmq.ZMQError as e:  # the client went away mid-answer: its problem, not the engine's
                log.warning("KV events replay to a subscriber failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
