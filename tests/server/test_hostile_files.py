"""Issue 38, acceptance 2, through a real `kvtier serve`: a FIFO, a symlink, a directory and a
device node planted at live G3 entry paths. Each is a miss (the prompt is recomputed, its tokens
unchanged), logged once and removed; G3 keeps serving the other prompts' entries; SIGTERM ends
the server within its drain time. Before the fix, the FIFO's open() blocked a G3 read thread
forever and SIGTERM never finished."""
from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from checkpoints import random_prompt
from serving import start_server

G1_BLOCKS = 64  # 1,024 tokens: the flood pushes every earlier prompt out of G1
PROMPTS = [random_prompt(160, 7100 + i) for i in range(5)]  # 10 blocks each
FLOOD = random_prompt(1000, 7199)
DRAIN_S = 10


def _complete(c, prompt: list[int]) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _settled(disk: Path, timeout: float = 30) -> set[Path]:
    """The entry files once their number stops growing (G3 writes are asynchronous)."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < timeout:
        now = set(disk.rglob("*.kvb"))
        if len(now) == last:
            return now
        last = len(now)
        time.sleep(0.3)
    raise AssertionError("G3 writes did not settle")


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
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "0.1")
    try:
        with srv.client(timeout=60) as c:
            first, blocks = [], []
            seen: set[Path] = set()
            for p in PROMPTS:
                first.append(_complete(c, p)["choices"][0]["token_ids"])
                now = _settled(disk)
                blocks.append(min(now - seen, key=lambda f: f.stat().st_mtime_ns))  # its first block's entry
                seen = now
            _complete(c, FLOOD)
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
        for a in again[:4]:  # the hit ended at the stranger (a block or two of G1 may have survived)
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] < 144, a["usage"]
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
