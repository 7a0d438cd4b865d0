"""A worker rank's process (`python -m engine.parallel.worker FD`, started by `ranks.Ranks`): gets
its `WorkerSpec` on the socket FD, loads its shard, says `Ready`, joins the process group, then
runs each `Step` rank 0 sends until `Stop` or until rank 0 goes away."""
from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.parallel.ranks import (Failed, Ready, Step, Stop, WorkerSpec, encode_message,
                                   process_group, to_worker)
from engine.parallel.shm import AllReduce, ShmAllReduce
from engine.parallel.shard import TPShard

log = logging.getLogger("engine.parallel.worker")


def build(spec: WorkerSpec):
    from engine.core.setup import attention_backend, kv_layout
    from engine.model_config import load_model_config
    from engine.runner.loader import load_model
    from engine.runner.model_runner import ModelRunner

    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(spec.threads or len(spec.cpus))
    shard = TPShard(spec.rank, spec.size)
    model_dir = Path(spec.model)
    full = load_model_config(model_dir, spec.dtype, spec.device, spec.kv_cache_dtype)
    mc = shard.config(full)
    backend = attention_backend(spec.device)
    model = load_model(model_dir, mc, backend, spec.max_len, spec.device, shard=shard, full_config=full)
    runner = ModelRunner(model, mc, spec.num_blocks, spec.block_size, spec.device, group_decodes=backend.pads_decodes,
                         max_rows=spec.max_num_seqs, max_model_len=spec.max_len,
                         layout=kv_layout(mc, spec.one_group), computes_logits=False)
    return shard, model, runner


def serve(conn: Connection) -> None:
    from engine.core.isolation import FORWARD_ERRORS

    spec = to_worker.decode(conn.recv_bytes())
    if not isinstance(spec, WorkerSpec):
        raise SystemExit(f"tensor-parallel worker: expected its spec first, got {type(spec).__name__}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        shard, model, runner = build(spec)
    except (OSError, ValueError, RuntimeError, ImportError, KeyError) as e:  # told to rank 0, which raises it
        conn.send_bytes(encode_message(Failed(spec.rank, f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(encode_message(Ready(spec.rank)))
    pg = process_group(spec.store_path, spec.rank, spec.size, spec.timeout_s)
    shm = ShmAllReduce(spec.shm_name, spec.rank, spec.size, runner.cfg.dtype, spec.timeout_s)
    shard.attach(model, AllReduce(shm, pg))
    while True:
        try:
            msg = to_worker.decode(conn.recv_bytes())
        except EOFError:
            return  # rank 0 is gone
        if isinstance(msg, Stop):
            return
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


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
