"""The other tensor-parallel ranks: worker processes that run their shard of each step.

Rank 0 is the engine's own process: it schedules, runs its shard, samples. Every step it sends
each worker the step's typed `RunPlan` and block tables (msgpack over a pipe, never pickle), then
all ranks run the forward, meeting at each all-reduce (a gloo process group of their own, not
torch.distributed's global one, so several engines can live in one process). A worker waits for
the next step on its pipe, not in a collective, so an idle engine hits no collective timeout.

Failure: a worker that exits is seen before the next step (`RankFailed`, naming it); one that
hangs (SIGSTOP) leaves rank 0 in an all-reduce until `distributed_timeout_seconds`, then `RankFailed`.
`RankFailed` is not a request's error, so failure isolation does not retry it: the engine stops.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Union

import msgspec
import torch
import torch.distributed as dist

from connectors.offload_plans import LoadDone, LoadJob, StoreDone, StoreJob
from engine.config import EngineConfig
from engine.core.connector_setup import OffloadSettings
from engine.core.step_io import RunPlan
from engine.parallel.shm import AllReduce, ShmAllReduce
from engine.parallel.transfers import FlushTransfers, Flushed, Transfers, TransfersDone, reports_of, to_wire
from kvstore.threads import drain

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker loading its shard (and the longest a flush of its transfers waits)
STOP_TIMEOUT_S = 5.0  # a worker exiting when told to
OFFLOAD_STOP_TIMEOUT_S = 30.0  # ... when it first finishes its tier writes
REPO = Path(__file__).resolve().parents[2]  # where `engine` is imported from, for the workers' PYTHONPATH


class RankFailed(Exception):
    """A tensor-parallel rank died, hung or failed to start; the engine cannot go on."""


class LoRASpec(msgspec.Struct):
    """enable_lora's limits, for a worker's LoRA slots (engine/lora/slots.py)."""
    max_loras: int
    max_rank: int
    targets: list[str]


class WorkerSpec(msgspec.Struct, tag="spec"):
    """What a worker needs to build its rank: the first message it gets."""
    rank: int
    size: int
    model: str
    dtype: str
    device: str
    kv_cache_dtype: str
    block_size: int
    max_num_seqs: int
    num_blocks: int
    max_len: int
    one_group: str | None  # why G1 keeps every layer in one KV group, if it must (engine/core/setup.kv_layout)
    store_path: str  # the process group's rendezvous file
    shm_name: str  # the shared-memory all-reduce's segment (engine/parallel/shm.py)
    cpus: tuple[int, ...]  # the CPUs it runs on (empty: all)
    threads: int | None  # its forward threads (None: one per CPU of `cpus`)
    timeout_s: float  # the longest an all-reduce waits for the other ranks
    offload: OffloadSettings | None = None  # the offload tiers: each rank builds its own (connectors/sharded.py)
    kv_offload_dtype: str = "auto"  # their entries' dtype (--kv-offload-dtype)
    lora: LoRASpec | None = None  # enable_lora: the LoRA slots each rank holds its shard of


class LoadLoRA(msgspec.Struct, tag="load_lora"):
    """An adapter rank 0 has loaded into `slot` (its files read and checked there): each worker reads
    its shard of the same files, and refuses to go on if their digest differs (changed in between)."""
    slot: int
    name: str
    path: str
    digest: bytes


class Step(msgspec.Struct, tag="step"):
    plan: RunPlan
    tables: list[tuple[list[int], ...]]  # per request, per KV group
    released: list[str]  # finished requests whose input-batch rows are dropped
    filled: dict[str, int] = {}  # async scheduling: the tokens of the step's placeholders, sampled since


class Stop(msgspec.Struct, tag="stop"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    rank: int


class Failed(msgspec.Struct, tag="failed"):
    rank: int
    error: str


encode_message = msgspec.msgpack.Encoder().encode
to_worker = msgspec.msgpack.Decoder(Union[WorkerSpec, Step, Stop, Transfers, FlushTransfers, LoadLoRA])  # what a worker reads
to_rank0 = msgspec.msgpack.Decoder(Union[Ready, Failed, TransfersDone, Flushed])  # what rank 0 reads


def cpu_sets(size: int) -> list[tuple[int, ...]]:
    """Disjoint CPUs for each rank, from this process's usable ones (the affinity mask): contiguous
    chunks, so a rank's OpenMP team never shares a core with another rank's. Fewer CPUs than ranks:
    every rank gets all of them (logged)."""
    from engine.runner.cpu_threads import usable_cpus

    usable = usable_cpus()
    cpus = usable.cpus[:usable.count] if usable.cpus else tuple(range(usable.count))
    if len(cpus) < size:
        log.warning("%d ranks or engine cores on %d usable CPUs: they share them", size, len(cpus))
        return [tuple(cpus)] * size
    per = len(cpus) // size
    return [tuple(cpus[r * per:(r + 1) * per]) for r in range(size)]


def process_group(store_path: str, rank: int, size: int, timeout_s: float) -> Any:
    store = dist.FileStore(store_path, size)
    return dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))


def all_max(pg: Any, t: torch.Tensor) -> None:
    """The elementwise max of `t` over the ranks, in place (start-up only: through gloo)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([t], opts).wait()


class Ranks:
    """Rank 0's side: the workers, their sockets and the process group."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_len: int, one_group: str | None,
                 dtype: torch.dtype) -> None:
        """Starts ranks 1..N-1 loading their shards (rank 0 loads its own meanwhile; `connect`).
        Workers are plain subprocesses (`python -m engine.parallel.worker`), not multiprocessing
        children: `kvtier serve`'s engine core is a daemonic process, which may not have those."""
        size = config.tensor_parallel_size
        self.size = size
        self._dir = tempfile.mkdtemp(prefix="kvtier-tp-")
        self._store = str(Path(self._dir) / "store")
        self.cpus = cpu_sets(size) if config.device == "cpu" else [()] * size
        self.timeout_s = config.distributed_timeout_seconds
        shm = ShmAllReduce(None, 0, size, dtype, self.timeout_s)
        self._reduce = AllReduce(shm, None)
        settings = OffloadSettings.of(config)
        offload = settings if settings.tiered else None  # hidden-state export is rank 0's alone
        self._stop_timeout_s = OFFLOAD_STOP_TIMEOUT_S if offload is not None else STOP_TIMEOUT_S
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        self._released: list[str] = []
        self._send_lock = threading.Lock()  # steps (engine thread) and transfers (bookkeeping thread)
        self._reports: queue.SimpleQueue[tuple[int, LoadDone | StoreDone]] = queue.SimpleQueue()
        self._wake: Callable[[], None] = lambda: None
        self._flushed = threading.Condition()
        self._flush_count = 0  # Flushed replies received
        self._failed: Failed | None = None  # a worker's start-up error after it said Ready (it then exits)
        self._readers: list[threading.Thread] = []  # one per worker, from `connect`
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
                theirs.close()
                conn = Connection(ours.detach())
                self._conns.append(conn)
                self._procs.append(proc)
                conn.send_bytes(encode_message(WorkerSpec(
                    rank, size, config.model, config.dtype, config.device, config.kv_cache_dtype, config.block_size,
                    config.max_num_seqs, num_blocks, max_len, one_group, self._store, shm.name,
                    self.cpus[rank], config.cpu_threads, self.timeout_s, offload, config.kv_offload_dtype,
                    LoRASpec(config.max_loras, config.max_lora_rank, sorted(config.lora_targets))
                    if config.enable_lora else None)))
        except OSError as e:
            self.close()
            raise RankFailed(f"starting the tensor-parallel workers failed: {e}") from None
        self.reduce_seconds = 0.0  # rank 0's time in all-reduces (benchmarks/parallel.py)
        log.info("tensor parallelism: %d ranks (workers %s)%s", size, ", ".join(str(p.pid) for p in self._procs),
                 "; CPUs " + " | ".join(",".join(map(str, c)) for c in self.cpus) if any(self.cpus) else "")

    @property
    def pids(self) -> tuple[int, ...]:
        """The workers' process ids, rank 1 first."""
        return tuple(p.pid for p in self._procs)

    def connect(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Waits until every worker has loaded its shard, then joins the process group."""
        deadline = time.monotonic() + timeout_s
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(0.1):
                if proc.poll() is not None:
                    raise RankFailed(f"tensor-parallel rank {rank} exited during start-up (code {proc.returncode})")
                if time.monotonic() > deadline:
                    raise RankFailed(f"tensor-parallel rank {rank} did not load its shard within {timeout_s:.0f} s")
            msg = to_rank0.decode(conn.recv_bytes())
            if isinstance(msg, Failed):
                raise RankFailed(f"tensor-parallel rank {msg.rank} failed to start: {msg.error}")
        self._reduce.pg = process_group(self._store, 0, self.size, self.timeout_s)
        for rank, conn in enumerate(self._conns, start=1):  # from now on the workers speak only to report
            reader = threading.Thread(target=self._read, args=(rank, conn), name=f"kvtier-rank{rank}-reports",
                                      daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, rank: int, conn: Connection) -> None:
        """A worker's reports (its transfers, its flushes), until it goes away."""
        while True:
            try:
                msg = to_rank0.decode(conn.recv_bytes())
            except (EOFError, OSError):
                return  # it exited or we closed: check_alive reports a death
            if isinstance(msg, TransfersDone):
                for report in reports_of(msg):
                    self._reports.put((rank, report))
                self._wake()
            elif isinstance(msg, Failed):
                self._failed = msg
            elif isinstance(msg, Flushed):
                with self._flushed:
                    self._flush_count += 1
                    self._flushed.notify_all()

    # ---- connectors.sharded.TransferPeers --------------------------------------------------
    def send_transfers(self, loads: list[LoadJob], stores: list[StoreJob]) -> None:
        self._send_all(encode_message(to_wire(loads, stores)))

    def drain_transfers(self) -> list[tuple[int, LoadDone | StoreDone]]:
        return drain(self._reports)

    def flush_transfers(self) -> None:
        with self._flushed:
            want = self._flush_count + len(self._conns)
        self._send_all(encode_message(FlushTransfers()))
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._flushed:
            while self._flush_count < want:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RankFailed(f"the tensor-parallel ranks did not finish their transfers within {START_TIMEOUT_S:.0f} s")
                self._flushed.wait(0.1)

    def set_waker(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def _send_all(self, data: bytes) -> None:
        with self._send_lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    conn.send_bytes(data)
                except OSError as e:
                    raise RankFailed(f"tensor-parallel rank {rank} is gone: {e}") from None

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` over the ranks, in place."""
        start = time.perf_counter()
        try:
            self._reduce(t)
            self.reduce_seconds += time.perf_counter() - start  # waits for the slowest rank included
        except RuntimeError as e:  # gloo's timeout, or a peer that closed its connection
            self.check_alive()
            raise RankFailed(f"an all-reduce across the {self.size} tensor-parallel ranks failed (a rank hangs "
                             f"or died): {str(e).splitlines()[0][:200]}") from None

    def all_max(self, t: torch.Tensor) -> None:
        """The elementwise max of `t` over the ranks, in place (engine/runner/kv_quant.py's scales)."""
        try:
            all_max(self._reduce.pg, t)
        except RuntimeError as e:
            self.check_alive()
            raise RankFailed(f"a max across the {self.size} tensor-parallel ranks failed: "
                             f"{str(e).splitlines()[0][:200]}") from None

    def step(self, plan: RunPlan, tables: list, filled: dict[str, int]) -> None:
        """Sends a step to the workers, before rank 0 runs its shard of it."""
        self.check_alive()
        released, self._released = self._released, []  # releases come from the bookkeeping thread too
        self._send_all(encode_message(Step(plan, [t if isinstance(t, tuple) else (t,) for t in tables], released, filled)))

    def load_lora(self, slot: int, name: str, path: str, digest: bytes) -> None:
        """An adapter rank 0 loaded into `slot`: the workers load their shards of it before the next step."""
        self.check_alive()
        self._send_all(encode_message(LoadLoRA(slot, name, path, digest)))

    def release(self, request_id: str) -> None:
        """A finished request's rows: the workers drop theirs with the next step."""
        self._released.append(request_id)

    def check_alive(self) -> None:
        """RankFailed naming the first worker that exited (cheap: the engine calls it while idle too)."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                if rank <= len(self._readers):
                    self._readers[rank - 1].join(1.0)  # it ends at the pipe's EOF, after any Failed it read
                if self._failed is not None:
                    raise RankFailed(f"tensor-parallel rank {self._failed.rank} failed to start: {self._failed.error}")
                raise RankFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")

    def close(self) -> None:
        """Stops the workers; with offload, each finishes its transfers and tier writes first."""
        for conn in self._conns:
            try:
                with self._send_lock:
                    conn.send_bytes(encode_message(Stop()))
            except OSError:
                pass  # already gone
        for proc in self._procs:
            try:
                proc.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._reduce.shm.close()
        shutil.rmtree(self._dir, ignore_errors=True)
