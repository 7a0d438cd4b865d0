"""Issue 11, finding 3 (and the config side of 4): the G3/G4 namespace covers every weight byte,
its digest cache is trusted only while the files are unchanged, an explicit `kv_namespace`
replaces the weights' identity (and only that), and the secret/namespace settings are
validated (ValueError; the CLI exits 2) and never shown.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

import engine.kv.fingerprint as fp
from engine.config import EngineConfig
from engine.model_config import load_model_config

OLD_NS = 10**10  # 10 s in the past


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """The per-user digest cache goes to a temp dir, never to ~/.cache; files count as settled
    at once (their ctime is always "just now" here: a copy cannot set it back), except where a
    test restores the racy window."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(fp, "RACY_NS", 0)


def _copy(src: Path, dst: Path, age_ns: int = OLD_NS) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(fp.CACHE_NAME))
    _age(dst, age_ns)
    return dst


def _age(model: Path, age_ns: int = OLD_NS) -> None:
    t = time.time_ns() - age_ns
    for f in model.glob("*.safetensors"):
        os.utime(f, ns=(t, t))


def _data_section(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def _flip(path: Path, at: int) -> None:
    """Flip one byte in place (same file, same size), then restore an old mtime, as a copy tool
    preserving timestamps would: size, inode and mtime are as before; only ctime moved."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _tensor_byte(path: Path, name: str, frac: float = 0.5) -> int:
    start, header = _data_section(path)
    lo, hi = header[name]["data_offsets"]
    return start + lo + int((hi - lo) * frac)


@pytest.fixture(scope="module")
def base(ckpt_dir, tmp_path_factory) -> Path:
    return _copy(ckpt_dir("qwen3"), tmp_path_factory.mktemp("kvid") / "base")


def _fingerprint(model: Path, dtype: str = "float32", name: str | None = None, block_size: int = 16) -> bytes:
    return fp.model_fingerprint(model, load_model_config(model, dtype), block_size, name)


# Where one flipped byte goes: the first and last data bytes, and bytes in layers 0 and 1 that the
# old fingerprint (header + three 64 KiB samples) never read.
FLIPS = {
    "first-data-byte": lambda p: _data_section(p)[0],
    "last-byte": lambda p: p.stat().st_size - 1,
    "layer0-q_proj": lambda p: _tensor_byte(p, "model.layers.0.self_attn.q_proj.weight"),
    "layer0-v_proj": lambda p: _tensor_byte(p, "model.layers.0.self_attn.v_proj.weight"),
    "layer1-down_proj": lambda p: _tensor_byte(p, "model.layers.1.mlp.down_proj.weight"),
}


@pytest.mark.parametrize("where", sorted(FLIPS))
def test_one_flipped_weight_byte_gives_another_namespace(base, tmp_path, where) -> None:
    other = _copy(base, tmp_path / "other")
    f = other / "model.safetensors"
    _flip(f, FLIPS[where](f))
    assert f.read_bytes() != (base / "model.safetensors").read_bytes()
    assert fp.weights_identity(other) != fp.weights_identity(base)
    assert _fingerprint(other) != _fingerprint(base)
    assert _fingerprint(_copy(base, tmp_path / "same")) == _fingerprint(base)  # a copy is the same model


def test_explicit_kv_namespace_wins_and_skips_hashing(base, tmp_path, monkeypatch) -> None:
    other = _copy(base, tmp_path / "other")
    _flip(other / "model.safetensors", FLIPS["layer0-q_proj"](other / "model.safetensors"))
    computed = _fingerprint(base)

    def no_hashing(*a, **k):
        raise AssertionError("kv_namespace given: the weights must not be hashed")

    monkeypatch.setattr(fp, "hash_file", no_hashing)
    named = _fingerprint(base, name="smol-finetune-v3")
    assert named != computed
    assert _fingerprint(other, name="smol-finetune-v3") == named  # the operator's name, not the bytes
    assert _fingerprint(base, name="smol-finetune-v4") != named
    # only the weights' identity is replaced: dtype and block size still separate namespaces
    assert _fingerprint(base, "bfloat16", name="smol-finetune-v3") != named
    assert _fingerprint(base, name="smol-finetune-v3", block_size=32) != named


def _count_hashes(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = fp.hash_file

    def counting(path, buf):
        calls.append(Path(path))
        return real(path, buf)

    monkeypatch.setattr(fp, "hash_file", counting)
    return calls


def test_digest_cache_is_used_and_invalidated(base, tmp_path, monkeypatch, caplog) -> None:
    model = _copy(base, tmp_path / "m")
    calls = _count_hashes(monkeypatch)
    caplog.set_level(logging.INFO, logger="engine.kv.fingerprint")
    first = fp.weights_identity(model)
    assert len(calls) == 1 and (model / fp.CACHE_NAME).is_file()
    assert "hashed 1 file(s)" in caplog.text and " s (" in caplog.text  # how long it took
    assert fp.weights_identity(model) == first and len(calls) == 1  # a restart does not rehash
    f = model / "model.safetensors"
    _flip(f, FLIPS["layer1-down_proj"](f))  # same size, same mtime, same inode: only the bytes differ...
    os.utime(f, ns=(time.time_ns() - OLD_NS + 1,) * 2)  # ...and a new mtime, as any write gives
    changed = fp.weights_identity(model)
    assert len(calls) == 2 and changed != first
    assert fp.weights_identity(model) == changed and len(calls) == 2


@pytest.mark.parametrize("field", ["size", "mtime_ns", "ctime_ns", "inode", "dev"])
def test_cache_entry_whose_stat_differs_is_never_trusted(base, tmp_path, monkeypatch, field) -> None:
    model = _copy(base, tmp_path / "m")
    first = fp.weights_identity(model)
    cache = model / fp.CACHE_NAME
    data = json.loads(cache.read_text())
    entry = data["files"]["model.safetensors"]
    entry[field] += 1
    entry["digest"] = "0" * 32  # a stale digest: must not be used
    cache.write_text(json.dumps(data))
    calls = _count_hashes(monkeypatch)
    assert fp.weights_identity(model) == first and len(calls) == 1


def test_file_rewritten_in_place_with_size_inode_and_mtime_restored_is_rehashed(base, tmp_path, monkeypatch) -> None:
    """Issue 38, finding 4: rewritten in place (same inode), size and mtime put back, as `cp -p`
    over the old file, `rsync -t --inplace` or a restored backup leave it. The digest cache was
    keyed by size, mtime and inode only, so the old model's G3 KV was served to the new weights."""
    model = _copy(base, tmp_path / "m")
    f = model / "model.safetensors"
    first = fp.weights_identity(model)
    before = f.stat()
    time.sleep(0.01)  # past the coarse clock's tick, so the kernel's ctime moves
    _flip(f, FLIPS["layer1-down_proj"](f))
    after = f.stat()
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)
    calls = _count_hashes(monkeypatch)
    assert fp.weights_identity(model) != first and len(calls) == 1


def test_replaced_file_with_the_same_size_and_mtime_is_rehashed(base, tmp_path, monkeypatch) -> None:
    """A new file (another inode) carrying the old timestamps, as `cp -p` or rsync leave it."""
    model = _copy(base, tmp_path / "m")
    first = fp.weights_identity(model)
    f = model / "model.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[FLIPS["layer0-v_proj"](f)] ^= 0x01
    new = model / "new.tmp"
    new.write_bytes(bytes(data))
    os.replace(new, f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_ino != st.st_ino
    calls = _count_hashes(monkeypatch)
    assert fp.weights_identity(model) != first and len(calls) == 1


def test_recently_modified_file_is_not_cached(base, tmp_path, monkeypatch) -> None:
    """With coarse timestamps a second write within the same tick keeps size, mtimes and inode.
    An mtime set into the past does not make a file settled: its ctime says it just changed."""
    model = _copy(base, tmp_path / "m")  # mtime 10 s old, ctime now
    monkeypatch.setattr(fp, "RACY_NS", 2_000_000_000)
    calls = _count_hashes(monkeypatch)
    fp.weights_identity(model)
    fp.weights_identity(model)
    assert len(calls) == 2


def test_unwritable_model_dir_falls_back_to_the_user_cache(base, tmp_path, monkeypatch) -> None:
    model = _copy(base, tmp_path / "m")
    (model / fp.CACHE_NAME).mkdir()  # unwritable as a file (and root ignores permissions)
    first = fp.weights_identity(model)
    user = fp.fallback_cache_path(model.absolute())
    assert user.is_file() and str(tmp_path / "user-cache") in str(user)
    calls = _count_hashes(monkeypatch)
    assert fp.weights_identity(model) == first and calls == []


def test_no_writable_cache_is_logged_not_fatal(base, tmp_path, monkeypatch, caplog) -> None:
    model = _copy(base, tmp_path / "m")
    (model / fp.CACHE_NAME).mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="engine.kv.fingerprint"):
        first = fp.weights_identity(model)
    assert "cannot cache the weights digest" in caplog.text
    assert fp.weights_identity(model) == first


def test_damaged_cache_file_is_ignored(base, tmp_path, monkeypatch) -> None:
    model = _copy(base, tmp_path / "m")
    first = fp.weights_identity(model)
    (model / fp.CACHE_NAME).write_text("{not json")
    calls = _count_hashes(monkeypatch)
    assert fp.weights_identity(model) == first and len(calls) == 1


# ---- settings ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", "   ", "a\nb", "tab\there", "\x1b[31mred", "x" * 257, 7])
def test_kv_namespace_is_validated(bad) -> None:
    with pytest.raises(ValueError, match="kv_namespace"):
        EngineConfig(model="m", kv_namespace=bad)


def test_kv_namespace_accepts_printable_names() -> None:
    assert EngineConfig(model="m", kv_namespace="org/model:v2 (fine-tune)").kv_namespace == "org/model:v2 (fine-tune)"
    assert EngineConfig(model="m", kv_namespace="x" * 256)


def test_secret_reaches_the_config_but_not_its_repr(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    p = tmp_path / "secret"
    p.write_bytes(b"hunter2-hunter2\n")
    p.chmod(0o600)
    cfg = EngineConfig(model="m", kv_offload_secret_file=str(p))
    assert cfg.kv_offload_secret == b"hunter2-hunter2"
    assert "hunter2" not in repr(cfg)
    assert EngineConfig(model="m").kv_offload_secret is None
    monkeypatch.setenv("KVTIER_KV_SECRET", "from-env")
    assert EngineConfig(model="m").kv_offload_secret == b"from-env"
    monkeypatch.setenv("KVTIER_KV_SECRET", "")
    with pytest.raises(ValueError, match="KVTIER_KV_SECRET"):
        EngineConfig(model="m")


@pytest.mark.parametrize("flags", [["--kv-offload-secret-file", "/nonexistent/kv.secret"], ["--kv-namespace", ""],
                                   ["--kv-offload-secret-file", "EMPTY"]])
def test_cli_refuses_a_bad_secret_or_namespace_with_exit_2(ckpt_dir, tmp_path, capsys, flags) -> None:
    from server.cli import main

    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    flags = [str(empty) if f == "EMPTY" else f for f in flags]
    rc = main(["generate", str(ckpt_dir("qwen3")), "--prompt", "hello", "--kv-offload-disk", str(tmp_path / "g3"),
               *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "Traceback" not in err


def test_help_explains_both_flags(capsys) -> None:
    import argparse

    from server.args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    text = " ".join(p.format_help().split())
    assert "--kv-namespace" in text and "dtype, block size and layout still go into the namespace" in text
    assert "--kv-offload-secret-file" in text and "KVTIER_KV_SECRET" in text


def test_another_sliding_window_is_another_namespace(ckpt_dir, tmp_path) -> None:
    """A layer's KV depends on the windows below it: the same weights with another window (or
    none) must not read each other's G3/G4 entries, even under one kv_namespace."""
    swa = _copy(ckpt_dir("mistral_swa"), tmp_path / "swa")
    wider = _copy(swa, tmp_path / "wider")
    cfg = json.loads((wider / "config.json").read_text())
    cfg["sliding_window"] += 16
    (wider / "config.json").write_text(json.dumps(cfg))
    assert _fingerprint(wider) != _fingerprint(swa)
    assert _fingerprint(wider, name="ns") != _fingerprint(swa, name="ns")
