"""Issue 38, acceptance 2, through a real `kvtier serve`: a FIFO, a symlink, a directory and a
device node planted at live G3 entry paths. Each is a miss (the prompt is recomputed, its tokens
unchanged), logged once and removed; G3 keeps serving the other prompts' entries; SIGTERM ends
the server within its drain time. Before the fix, the FIFO's open() blocked a G3 read thread
forever and SIGTERM never finished."""
from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

from checkpoints import random_prompt
from kvstore.disk_layout import entry_path
from kvstore.keys import extend_keys
from serving import start_server

G1_BLOCKS = 64  # 1,024 tokens: the flood pushes every earlier prompt out of G1
PROMPTS = [random_prompt(160, 7100 + i) for i in range(5)]  # 10 blocks each
FLOODS = [random_prompt(1000, 7199), random_prompt(1000, 7198)]  # two: no block of PROMPTS stays in G1
DRAIN_S = 10


def _complete(c, prompt: list[int]) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _settled(disk: Path, timeout: float = 30) -> set[Path]:
    """The entry files once their number stops growing (G3 writes are asynchronous)."""
    counts, since = [], time.monotonic()
    while time.monotonic() - since < timeout:
        now = set(disk.rglob("*.kvb"))
        counts.append(len(now))
        if len(counts) >= 3 and counts[-3] == counts[-1]:
            return now
        time.sleep(0.3)
    raise AssertionError("G3 writes did not settle")


def _first_block_entry(disk: Path, prompt: list[int]) -> Path:
    """The G3 file of the prompt's first block (offload block = G1 block: keys as G1 chains them)."""
    keys: list = []
    extend_keys(keys, prompt, 16, None)
    (ns,) = [d for d in disk.iterdir() if d.is_dir()]
    return Path(entry_path(str(ns), keys[0]))


def _plant(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        os.symlink("/etc/passwd", path)
    elif kind == "directory":
        path.mkdir()
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:  # no CAP_MKNOD: a second FIFO stands in
            os.mkfifo(path, 0o600)


def test_strangers_at_live_g3_entries_are_misses_and_sigterm_still_ends(ckpt_dir, tmp_path):
    disk = tmp_path / "g3"
    # One entry per G3 file (g3_io_mib below one block): the strangers replace single entries' files
    # (tests/kvstore/test_disk_files.py covers a stranger at a file of several).
    one_per_file = json.dumps({"kv_connector_extra_config": {"g3_io_mib": 1e-4}})
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "0.1",
                       "--kv-transfer-config", one_per_file)
    try:
        with srv.client(timeout=60) as c:
            first = [_complete(c, p)["choices"][0]["token_ids"] for p in PROMPTS]
            entries = _settled(disk)
            blocks = [_first_block_entry(disk, p) for p in PROMPTS]
            assert set(blocks) <= entries
            for flood in FLOODS:
                _complete(c, flood)
            kinds = ["fifo", "symlink", "directory", "device"]
            for path, kind in zip(blocks, kinds):
                _plant(path, kind)
            before = c.get("/v1/kv/stats").json()["tiers"]["G3"]
            t0 = time.monotonic()
            again = [_complete(c, p) for p in PROMPTS]
            took = time.monotonic() - t0
            after = c.get("/v1/kv/stats").json()["tiers"]["G3"]
        assert took < 10, f"second pass took {took:.1f}s: a read blocked"
        assert [a["choices"][0]["token_ids"] for a in again] == first  # recomputed where planted
        for a in again[:4]:  # the stranger was their first block: no hit
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, a["usage"]
        assert again[4]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144  # G3 still serves the others
        assert after["hit_tokens"] - before["hit_tokens"] >= 144
        assert after["corrupt"] - before["corrupt"] == 4
        for path in blocks[:4]:
            # removed; the recomputed block may have been written there again, as a regular file
            assert not os.path.lexists(path) or stat.S_ISREG(os.lstat(path).st_mode), f"{path} was not removed"
            lines = [ln for ln in srv.lines if str(path) in ln]
            assert len(lines) == 1 and "not a regular file" in lines[0], lines
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(DRAIN_S + 20) == 0, srv.log()[-3000:]
        assert time.monotonic() - t0 < DRAIN_S + 20
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
