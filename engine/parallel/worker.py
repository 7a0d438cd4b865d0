"""A worker rank's process (`python -m engine.parallel.worker FD`, started by `ranks.Ranks`): gets
its `WorkerSpec` on the socket FD, loads its shard, says `Ready`, joins the process group, builds
the rest with the other ranks (an fp8 cache's scales are calibrated together), then runs each
`Step` rank 0 sends until `Stop` or until rank 0 goes away.

With offload tiers it also runs rank 0's load and store plans (`Transfers`) over tiers of its own
(connectors/sharded.py): a reporter thread sends `TransfersDone` as its transfer engine finishes them."""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from connectors.offload_transfer import TransferEngine
from engine.parallel.ranks import (Failed, LoadLoRA, Ready, Step, Stop, WorkerSpec, all_max, encode_message,
                                   process_group, to_worker)
from engine.parallel.shm import AllReduce, ShmAllReduce
from engine.parallel.shard import TPShard
from engine.parallel.transfers import FlushTransfers, Flushed, Transfers, done_of, load_of, store_of

START_ERRORS = (OSError, ValueError, RuntimeError, ImportError, KeyError)  # a start-up's, reported to rank 0
REPORT_WAIT_S = 0.2  # the reporter's longest sleep between checks for finished transfers

log = logging.getLogger("engine.parallel.worker")


def build(spec: WorkerSpec):
    """What a worker loads before it says Ready: its shard of the model, and the tokenizer an fp8
    cache's calibration reads (`start`)."""
    from engine.core.setup import attention_backend
    from engine.model_config import FP8_DTYPES, KV_DTYPES, load_model_config
    from engine.runner import stack_chunks
    from engine.runner.loader import load_model, load_tokenizer

    stack_chunks.install()
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(spec.threads or len(spec.cpus))
    shard = TPShard(spec.rank, spec.size)
    model_dir = Path(spec.model)
    full = load_model_config(model_dir, spec.dtype, spec.device, spec.kv_cache_dtype)
    mc = shard.config(full)
    model = load_model(model_dir, mc, attention_backend(spec.device), spec.max_len, spec.device, shard=shard,
                       full_config=full)
    calibrates = mc.kv_dtype in FP8_DTYPES or KV_DTYPES.get(spec.kv_offload_dtype) in FP8_DTYPES
    tokenizer = load_tokenizer(model_dir) if calibrates else None
    slots = None
    if spec.lora is not None:  # wrapped before the all-reduce hooks go on (engine/lora/slots.py)
        from engine.lora.slots import LoRASlots

        slots = LoRASlots(model, mc.num_layers, spec.lora.max_loras, spec.lora.max_rank, frozenset(spec.lora.targets),
                          mc.dtype, spec.device, shard, full)
    return shard, mc, model, tokenizer, slots


def start(spec: WorkerSpec, mc, model, tokenizer, pg, lora=None):
    """What a worker builds once the process group is joined: an fp8 cache's scales, which every rank
    calibrates together (rank 0's engine/core/build.py at the same point), then the runner and the
    offload tiers, whose namespace names the scales."""
    from engine.core.setup import attention_backend, kv_layout
    from engine.runner import kv_quant
    from engine.runner.loader import weight_files
    from engine.runner.model_runner import ModelRunner

    from engine.core.connector_setup import OffloadQuant

    model_dir = Path(spec.model)
    reduce_max = functools.partial(all_max, pg)
    quant = OffloadQuant.make(spec.kv_offload_dtype, mc, model, model_dir, tokenizer, spec.block_size, spec.device,
                              spec.max_len, reduce_max)  # before G1's scales, as on rank 0
    mc = kv_quant.prepare(model, mc, model_dir, weight_files(model_dir), tokenizer, spec.block_size, spec.device,
                          spec.max_len, reduce_max=reduce_max)
    backend = attention_backend(spec.device)
    runner = ModelRunner(model, mc, spec.num_blocks, spec.block_size, spec.device,
                         group_decodes=backend.pads_decodes, max_rows=spec.max_num_seqs,
                         max_model_len=spec.max_len, layout=kv_layout(mc, spec.one_group), computes_logits=False,
                         lora=lora, one_token_prefills=backend.one_token_prefills)
    return runner, _offload(spec, mc, model_dir, runner, quant)


def _offload(spec: WorkerSpec, mc, model_dir: Path, runner, quant) -> TransferEngine | None:
    """This rank's offload tiers and the transfer engine over them, when the engine offloads."""
    if spec.offload is None:
        return None
    from connectors.tiered import TieredOffloadConnector
    from engine.core.connector_setup import make_connector
    from kvstore.g1 import BlockPool
    from policies import make_policy

    # The connector's scheduler side is rank 0's; this pool only satisfies its constructor.
    pool = BlockPool(spec.num_blocks, make_policy("lru", spec.num_blocks), True, None)
    connector = make_connector(spec.offload, mc, model_dir, None, pool, None, runner, spec.rank, spec.size,
                               offload=quant)
    if not isinstance(connector, TieredOffloadConnector):
        raise ValueError(f"the offload settings rank 0 sent build {type(connector).__name__}, not the tiered offload "
                         "connector")
    return connector.as_peer()


class Reporter:
    """Sends rank 0 this rank's finished transfers (a thread), and the answer to a flush."""

    def __init__(self, rank: int, conn: Connection, transfer: TransferEngine) -> None:
        self.rank, self.conn, self.transfer = rank, conn, transfer
        self._lock = threading.Lock()  # drain-and-send is one step: reports never pass a Flushed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-transfer-reports", daemon=True)
        self._thread.start()

    def _send_done(self) -> None:
        with self._lock:
            done = self.transfer.reports.drain()
            if done:
                self.conn.send_bytes(encode_message(done_of(self.rank, done)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.transfer.reports.wait(REPORT_WAIT_S)
            try:
                self._send_done()
            except OSError:
                return  # rank 0 is gone; the main loop sees it too

    def flushed(self) -> None:
        """Every transfer sent so far has finished: report them, then say so."""
        self.transfer.flush()
        self._send_done()
        with self._lock:
            self.conn.send_bytes(encode_message(Flushed(self.rank)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.transfer.close()


def serve(conn: Connection) -> None:
    spec = to_worker.decode(conn.recv_bytes())
    if not isinstance(spec, WorkerSpec):
        raise SystemExit(f"tensor-parallel worker: expected its spec first, got {type(spec).__name__}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        shard, mc, model, tokenizer, slots = build(spec)
    except START_ERRORS as e:  # told to rank 0, which raises it
        conn.send_bytes(encode_message(Failed(spec.rank, f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(encode_message(Ready(spec.rank)))
    pg = process_group(spec.store_path, spec.rank, spec.size, spec.timeout_s)
    shm = ShmAllReduce(spec.shm_name, spec.rank, spec.size, mc.dtype, spec.timeout_s)
    shard.attach(model, AllReduce(shm, pg))
    try:
        runner, transfer = start(spec, mc, model, tokenizer, pg, slots)
    except START_ERRORS as e:  # rank 0 reads it before its first step (Ranks.check_alive)
        conn.send_bytes(encode_message(Failed(spec.rank, f"{type(e).__name__}: {e}")))
        return
    reporter = Reporter(spec.rank, conn, transfer) if transfer is not None else None
    try:
        _loop(conn, runner, transfer, reporter, spec)
    finally:
        if reporter is not None:
            reporter.close()  # finishes the tier writes: a G3 entry outlives the engine


def _loop(conn: Connection, runner, transfer: TransferEngine | None, reporter: Reporter | None,
          spec: WorkerSpec) -> None:
    from engine.core.isolation import FORWARD_ERRORS

    while True:
        try:
            msg = to_worker.decode(conn.recv_bytes())
        except EOFError:
            return  # rank 0 is gone
        if isinstance(msg, Stop):
            return
        if isinstance(msg, LoadLoRA):
            _load_lora(runner.lora, spec, msg)
            continue
        if isinstance(msg, Transfers | FlushTransfers):
            if transfer is None or reporter is None:
                raise SystemExit("tensor-parallel worker: got offload transfers but was started without offload")
            if isinstance(msg, FlushTransfers):
                reporter.flushed()
                continue
            for w in msg.loads:
                transfer.start_load(load_of(w))
            for st in msg.stores:
                transfer.start_store(store_of(st))
            continue
        if not isinstance(msg, Step):
            raise SystemExit(f"tensor-parallel worker: unexpected {type(msg).__name__}")
        for rid in msg.released:
            runner.release(rid)
        try:
            inputs = runner.prepare(msg.plan, msg.tables)
            inputs.fill_placeholders(msg.filled)
            runner.run(inputs)
        except FORWARD_ERRORS as e:  # rank 0 meets it too and isolates the request; its reruns come as steps
            log.warning("step failed on this rank: %s: %s", type(e).__name__, e)
        for rid in msg.released:  # async scheduling: rank 0 may have planned this step before they ended
            runner.release(rid)


def _load_lora(slots, spec: WorkerSpec, msg: LoadLoRA) -> None:
    """This rank's shard of the adapter rank 0 loaded. Its files must be the ones rank 0 read:
    ranks computing with different weights would answer wrongly, so a changed digest (or files
    this rank cannot read) stops the worker, and rank 0 fails the engine naming this rank."""
    from engine.lora.adapter import read_info

    if slots is None or spec.lora is None:
        raise SystemExit("tensor-parallel worker: got a LoRA adapter but was started without enable_lora")
    try:
        info = read_info(msg.name, msg.path, spec.lora.max_rank, frozenset(spec.lora.targets))
        if info.digest != msg.digest:
            raise ValueError("its files changed since rank 0 read them")
        slots.load(msg.slot, info)
    except (OSError, ValueError) as e:
        raise SystemExit(f"tensor-parallel rank {spec.rank}: LoRA adapter {msg.name!r} from {msg.path}: {e}") from None
    log.info("LoRA adapter %r in slot %d", msg.name, msg.slot)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
