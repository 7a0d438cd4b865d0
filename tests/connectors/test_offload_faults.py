"""Acceptance 4 (issue 3): faults in a lower tier become misses and a log line; generation
completes with outputs identical to offload off. With kv_load_failure_policy="fail" the
affected request fails with a clear error and the others complete.

Faults, injected into the engine's own G3 (`llm.engine.connector.tier("G3").backend`):
- `get_into` raises (OSError, BackendError), or raises something no tier should (KeyError);
- `get_into` hangs past `g3_timeout_s` (0.2 s here);
- a full disk: a real 512 KiB tmpfs where the test may mount one, and ENOSPC from the
  write system call (monkeypatched) everywhere;
- a read-only directory: a real read-only tmpfs remount where possible, and EROFS from the
  file-creating system calls everywhere (we run as root, so chmod does not stop writes).

"cold" workloads have nothing in G1 (a fresh engine on a filled G3 directory), "warm" ones
have a 128-token prefix in G1, so a failed load leaves the request with G1 hits.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

import kvstore.disk_files as disk_module
from checkpoints import random_prompt
from connectors.backend import BackendError
from offload_helpers import (
    OB,
    check_integrity,
    deadline,
    flush_g1,
    hit_tokens,
    load_kinds,
    offload_llm,
    reads_through_get_into,
    reference,
    run,
    tokens,
    workload,
)

PROMPTS = workload()
PREFIX = random_prompt(2 * OB, 7301)  # a G1-resident prefix for the "warm" workloads
WARM = [PREFIX + p for p in PROMPTS]
NEW = random_prompt(400, 7302)  # never cached anywhere
DEADLINE_S = 20.0  # a safety net only: a healthy run takes well under a second
G3_TIMEOUT_S = 0.2
HANG_S = 0.35  # a hanging read: past the timeout
TIMEOUT = {"kv_transfer_config": {"kv_connector_extra_config": {"g3_timeout_s": G3_TIMEOUT_S}}}

LIVELOCK = (
    "BUG (livelock): a failed async load of a request with no G1 hits is retried forever. "
    "Scheduler.finish_load(ok=False) (engine/core/scheduler.py, finish_load) re-queues the request with "
    "num_computed_tokens unchanged (0 when G1 had nothing); schedule() then takes it for a fresh "
    "request (`fresh = req.num_computed_tokens == 0`, in schedule's admission loop), asks the "
    "connector again, G3's index still lists the block (a raising/hanging get drops nothing), so "
    "the same load is planned, fails again, and so on: generate() never returns and the log is "
    "flooded. Only entries the backend itself drops (corrupt ones) break the loop. Fix: remember "
    "that the load failed (a flag on the request) and skip the connector lookup on the retry.")


@pytest.fixture(scope="module")
def refs(model_dir):
    return {"cold": reference(model_dir, PROMPTS), "warm": reference(model_dir, WARM),
            "new": reference(model_dir, [NEW])[0]}


def fill(model_dir, disk: Path) -> None:
    """Engine A writes every block of the cold and warm workloads to G3, then exits."""
    llm = offload_llm(model_dir, kv_offload_disk=str(disk))
    try:
        run(llm, PROMPTS)
        run(llm, WARM)
    finally:
        llm.close()


def open_faulty(model_dir, disk: Path, workload_kind: str, **kw):
    """Engine B on a filled G3; for "warm", PREFIX is in G1 (and in no other request's way)."""
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **kw)
    if workload_kind == "warm":
        (warmup,) = run(llm, [PREFIX + [11]])
        assert warmup.cached_tokens_by_tier == {"G3": len(PREFIX)}
    return llm


def warned(caplog, text: str) -> bool:
    """A WARNING (or worse) log record contains `text`."""
    return any(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def expect_recomputed(outs, workload_kind: str) -> None:
    want = {"G1": len(PREFIX)} if workload_kind == "warm" else {}
    assert load_kinds(outs) == [want] * len(outs)


# ------------------------------------------------------------------------- raising get
# A faulty backend here fails the first read of each block and serves it if asked again, so
# that an engine that retries a failed load (instead of recomputing) ends up served from G3
# and fails the checks quickly instead of hanging the run. A correct engine reads each block
# at most once: the load fails, the request recomputes, and G3 is not asked again. (A load
# keeps several reads in flight, so one failed load may have read a few blocks.)


def first_reads_fail(real_get_into, fault):
    """A get_into whose first read of any key calls `fault(keys, outs)`; later reads are real."""
    seen: list = []

    def get_into(keys, outs):
        first = not any(k in seen for k in keys)
        seen.extend(keys)
        return fault(keys, outs) if first else real_get_into(keys, outs)

    return get_into, seen


def assert_read_once(seen, prompts) -> None:
    assert len(seen) >= len(prompts), f"{len(seen)} G3 reads for {len(prompts)} loads"
    assert len(set(seen)) == len(seen), "a G3 block was read twice (a failed load retried?)"


@pytest.mark.parametrize("workload_kind", [
    "warm", "cold"])
@pytest.mark.parametrize("exc", [OSError(errno.EIO, "injected I/O error"), BackendError("injected: backend down")],
                         ids=["OSError", "BackendError"])
def test_raising_get_is_a_miss(model_dir, refs, tmp_path, caplog, exc, workload_kind):
    fill(model_dir, tmp_path / "g3")
    llm = open_faulty(model_dir, tmp_path / "g3", workload_kind)
    g3 = llm.engine.connector.tier("G3").backend
    def fault(keys, outs):
        raise exc

    g3.get_into, seen = first_reads_fail(g3.get_into, fault)
    reads_through_get_into(g3)
    caplog.set_level(logging.WARNING)
    try:
        prompts = WARM if workload_kind == "warm" else PROMPTS
        before = llm.get_stats().tiers
        with deadline(DEADLINE_S):
            outs = run(llm, prompts)
        assert tokens(outs) == refs[workload_kind]
        assert_read_once(seen, prompts)
        expect_recomputed(outs, workload_kind)
        after = llm.get_stats().tiers
        assert after["load_failures"] - before["load_failures"] == len(prompts)
        assert after["G3"]["hit_tokens"] == before["G3"]["hit_tokens"]
        assert warned(caplog, str(exc))
        check_integrity(llm)
    finally:
        llm.close()


def test_unexpected_exception_from_get_is_a_miss(model_dir, refs, tmp_path, caplog):
    fill(model_dir, tmp_path / "g3")
    llm = open_faulty(model_dir, tmp_path / "g3", "warm")

    def buggy_get_into(keys, outs):
        raise KeyError("injected: a plugin bug")

    llm.engine.connector.tier("G3").backend.get_into = buggy_get_into
    reads_through_get_into(llm.engine.connector.tier("G3").backend)
    try:
        with deadline(DEADLINE_S):
            outs = run(llm, WARM)
        assert tokens(outs) == refs["warm"]
        expect_recomputed(outs, "warm")
        assert llm.get_stats().tiers["load_failures"] == len(WARM)
    finally:
        llm.close()


# ------------------------------------------------------------------------- hanging get
@pytest.mark.parametrize("workload_kind", [
    "warm", "cold"])
def test_hanging_get_times_out_into_a_miss(model_dir, refs, tmp_path, caplog, workload_kind):
    """The first reads hang for HANG_S, past the 0.2 s timeout; later ones work (as above)."""
    fill(model_dir, tmp_path / "g3")
    llm = open_faulty(model_dir, tmp_path / "g3", workload_kind, **TIMEOUT)
    assert llm.engine.connector.tier("G3").read_timeout_s == G3_TIMEOUT_S
    g3 = llm.engine.connector.tier("G3").backend
    prompts = WARM if workload_kind == "warm" else PROMPTS

    def fault(keys, outs):
        time.sleep(HANG_S)
        return [False] * len(keys)

    g3.get_into, seen = first_reads_fail(g3.get_into, fault)
    reads_through_get_into(g3)
    caplog.set_level(logging.WARNING)
    try:
        before = llm.get_stats().tiers
        with deadline(DEADLINE_S):
            outs = run(llm, prompts)
        assert tokens(outs) == refs[workload_kind]
        assert llm.engine.connector.transfer._reads.shutdown(HANG_S * 10)  # noqa: SLF001 - the hung reads end too
        assert_read_once(seen, prompts)
        expect_recomputed(outs, workload_kind)
        after = llm.get_stats().tiers
        assert after["load_failures"] - before["load_failures"] == len(prompts)
        assert after["G3"]["hit_tokens"] == before["G3"]["hit_tokens"]
        assert warned(caplog, "timed out")
        check_integrity(llm)
    finally:
        llm.close()


# ------------------------------------------------------------------------- full disk
def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def full_disk(request, tmp_path, monkeypatch):
    """A G3 directory whose writes fail with ENOSPC: a real 512 KiB tmpfs (8 blocks of
    64 KiB at most), or ENOSPC from the write system call."""
    root = tmp_path / "g3"
    if request.param == "tmpfs":
        if not _mount_tmpfs(root, "512k"):
            pytest.skip("cannot mount a tmpfs here (needs root); the 'syscall' case covers ENOSPC")
        yield root
        _umount(root)
    else:
        def no_space(fd, view):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(disk_module, "write_all", no_space)
        yield root


@pytest.mark.parametrize("full_disk", ["tmpfs", "syscall"], indirect=True)
def test_full_disk_stops_writes_and_keeps_serving(model_dir, refs, full_disk, caplog):
    caplog.set_level(logging.WARNING)
    llm = offload_llm(model_dir, kv_offload_disk=str(full_disk))
    try:
        first = run(llm, PROMPTS)
        assert tokens(first) == refs["cold"]
        llm.engine.connector.flush()
        g3 = llm.engine.connector.tier("G3").backend
        assert g3.stats.write_errors > 0 and not g3.writable
        assert warned(caplog, os.strerror(errno.ENOSPC))
        stored = len(g3)
        assert stored < sum(hit_tokens(len(p)) for p in PROMPTS) // OB  # the disk really filled up
        flush_g1(llm)
        second = run(llm, PROMPTS)
        assert tokens(second) == refs["cold"]
        served = sum(k.get("G3", 0) for k in load_kinds(second))
        assert served <= stored * OB  # what did land is served; nothing else
        assert llm.get_stats().tiers["load_failures"] == 0
        check_integrity(llm)
    finally:
        llm.close()


# ------------------------------------------------------------------------- read-only directory
@pytest.fixture
def read_only(request, tmp_path, monkeypatch):
    """(root, make_read_only): a tmpfs remounted read-only, or EROFS from every system call
    that would create something under root (as on a read-only mount)."""
    root = tmp_path / "g3"
    if request.param == "tmpfs":
        if not _mount_tmpfs(root, "16m"):
            pytest.skip("cannot mount a tmpfs here (needs root); the 'syscall' case covers EROFS")
        yield root, lambda: subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        _umount(root)
    else:
        real_open, real_mkdir = os.open, os.mkdir

        def under_root(path) -> bool:
            return str(path).startswith(str(root))

        def ro_open(path, flags, *args, **kw):
            if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR) and under_root(path):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kw)

        def ro_mkdir(path, *args, **kw):
            if under_root(path):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_mkdir(path, *args, **kw)

        def make_read_only():
            monkeypatch.setattr(os, "open", ro_open)
            monkeypatch.setattr(os, "mkdir", ro_mkdir)

        yield root, make_read_only


@pytest.mark.parametrize("read_only", ["tmpfs", "syscall"], indirect=True)
def test_read_only_directory_serves_and_refuses_writes(model_dir, refs, read_only, caplog):
    root, make_read_only = read_only
    fill(model_dir, root)
    make_read_only()
    caplog.set_level(logging.WARNING)
    llm = offload_llm(model_dir, kv_offload_disk=str(root))
    try:
        outs = run(llm, PROMPTS + [NEW])
        assert tokens(outs) == refs["cold"] + [refs["new"]]
        assert load_kinds(outs) == [{"G3": hit_tokens(len(p))} for p in PROMPTS] + [{}]  # reads work
        llm.engine.connector.flush()
        g3 = llm.engine.connector.tier("G3").backend
        assert g3.stats.write_errors > 0 and not g3.writable  # NEW's blocks could not be written
        assert warned(caplog, str(root))  # G3's warning names its directory
        assert llm.get_stats().tiers["load_failures"] == 0
        check_integrity(llm)
    finally:
        llm.close()


# ------------------------------------------------------------------------- policy "fail"
@pytest.mark.parametrize("how", ["kwarg", "transfer_config"])
def test_fail_policy_fails_only_the_affected_request(model_dir, refs, tmp_path, how):
    fill(model_dir, tmp_path / "g3")
    kw = ({"kv_load_failure_policy": "fail"} if how == "kwarg"
          else {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_load_failure_policy": "fail"}})
    llm = open_faulty(model_dir, tmp_path / "g3", "warm", **kw)
    g3 = llm.engine.connector.tier("G3").backend
    real_get_into = g3.get_into

    def raising_get_into(keys, outs):
        raise OSError(errno.EIO, "injected I/O error")

    g3.get_into = raising_get_into
    reads_through_get_into(g3)
    try:
        # [G3 hit -> load fails, no offload hit at all, G1 hit only]
        with deadline(DEADLINE_S):
            outs = run(llm, [PROMPTS[0], NEW, PREFIX + [13]])
        failed, fresh, g1_only = outs
        assert failed.outputs[0].finish_reason == "error"
        assert failed.error and "offload" in failed.error and "fail" in failed.error
        assert failed.outputs[0].token_ids == []
        assert fresh.outputs[0].finish_reason == "length" and fresh.error is None
        assert fresh.outputs[0].token_ids == refs["new"]
        assert g1_only.outputs[0].finish_reason == "length" and g1_only.error is None
        assert g1_only.cached_tokens_by_tier == {"G1": len(PREFIX)}
        assert llm.get_stats().tiers["load_failures"] == 1
        check_integrity(llm)
        # the engine is still healthy: with the backend repaired, the prompt is served from G3
        g3.get_into = real_get_into
        again = run(llm, [PROMPTS[0]])
        assert tokens(again) == refs["cold"][:1]
        assert load_kinds(again) == [{"G3": hit_tokens(len(PROMPTS[0]))}]
        check_integrity(llm)
    finally:
        llm.close()
