"""Issue 19: `kvtier kv` on a G3 directory. Oracles: entries written by the real DiskBackend,
bad files planted by hand (each kind the tier rejects), and a DiskBackend reopened afterwards
that must still serve every untouched entry byte-exact. Run in-process through `server.cli.main`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.disk import DiskBackend
from kvstore.entry import EntryCodec
from kvtools.inspect_disk import clear_dir, inspect_dir, verify_dir
from kvstore.namespace_info import RECORD_NAME
from server.cli import main
from kv_samples import INFO_A, INFO_B, NS_A, NS_B, key, value



def path_of(root: Path, ns: bytes, k: bytes) -> Path:
    return root / ns.hex() / k.hex()[:2] / f"{k.hex()}.kvb"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def open_tier(root: Path, ns: bytes, info: dict | None = None, **kw) -> DiskBackend:
    """One entry per file unless `file_bytes` says otherwise: these tests plant damage per entry
    (test_files_of_several_entries_are_walked_entry_by_entry covers files of several)."""
    kw.setdefault("file_bytes", 1)
    return DiskBackend(root, 64 << 20, ns, info=info, **kw)


@dataclass
class Planted:
    root: Path
    good: dict[bytes, dict[bytes, bytes]]  # namespace -> key -> value, what must survive byte-exact
    bad: set[str]  # paths verify must report
    kept: list[Path]  # files that must never be touched


def write_tier(root: Path, ns: bytes, info: dict, ids: range, **kw) -> dict[bytes, bytes]:
    tier = open_tier(root, ns, info, **kw)
    data = {key(i): value(i) for i in ids}
    assert all(tier.put(list(data), list(data.values())))
    tier.close()
    return data


def plant(root: Path) -> Planted:
    """Two namespaces of good entries, then one bad file of each kind and files to leave alone."""
    a = write_tier(root, NS_A, INFO_A, range(8))
    b = write_tier(root, NS_B, INFO_B, range(100, 103))
    bad: set[str] = set()
    # a flipped payload byte
    flipped = path_of(root, NS_A, key(0))
    raw = bytearray(flipped.read_bytes())
    raw[-7] ^= 0x40
    flipped.write_bytes(bytes(raw))
    # a truncated file (a torn write)
    torn = path_of(root, NS_A, key(1))
    torn.write_bytes(torn.read_bytes()[:-100])
    # a header for a different key: key(2)'s file under key(50)'s name
    alias = path_of(root, NS_A, key(50))
    alias.parent.mkdir(exist_ok=True)
    shutil.copyfile(path_of(root, NS_A, key(2)), alias)
    # an entry of namespace B inside namespace A's directory
    stray = path_of(root, NS_A, key(100))
    stray.parent.mkdir(exist_ok=True)
    shutil.copyfile(path_of(root, NS_B, key(100)), stray)
    # a temp file left by a writer that is gone
    stale = path_of(root, NS_A, key(3)).parent / f".{key(3).hex()}.{dead_pid()}.0badf00d.tmp"
    stale.write_bytes(b"half a write")
    bad |= {str(p) for p in (flipped, torn, alias, stray, stale)}
    for k in (key(0), key(1)):
        del a[k]
    # never kvtier's, or a live writer's: left alone whatever the command
    shard = path_of(root, NS_A, key(4)).parent
    live = shard / f".{key(4).hex()}.{os.getppid()}.1234abcd.tmp"  # our parent: a live process
    mine = shard / f".{key(5).hex()}.{os.getpid()}.5678abcd.tmp"  # a writer in this very process
    notes = shard / "notes.txt"
    foreign_dir = root / "not-a-namespace" / key(6).hex()[:2]
    foreign_dir.mkdir(parents=True)
    foreign_entry = foreign_dir / f"{key(6).hex()}.kvb"  # looks like an entry, but not under a namespace
    foreign_entry.write_bytes(b"not checked, not removed")
    top = root / "README"
    kept = [live, mine, notes, foreign_entry, top]
    for p in kept:
        p.write_bytes(b"leave me")
    return Planted(root, {NS_A: a, NS_B: b}, bad, kept)


def assert_serves(root: Path, good: dict[bytes, dict[bytes, bytes]]) -> None:
    """A DiskBackend reopened on `root` serves exactly `good`, byte-exact, and agrees with the files.
    (The temp file planted under this process's pid goes first: a tier's start-up scan removes
    its own process's temp files as leftovers, and counts them corrupt.)"""
    for mine in root.rglob(f".*.{os.getpid()}.*.tmp"):
        mine.unlink()
    for ns, data in good.items():
        tier = open_tier(root, ns)
        assert tier.stats.corrupt == 0  # nothing bad left for its start-up scan
        assert len(tier) == len(data)
        assert tier.get(list(data)) == list(data.values())
        tier.check_integrity()
        tier.close()


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["kv", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def planted(tmp_path: Path) -> Planted:
    return plant(tmp_path / "g3")


def test_verify_reports_exactly_the_planted_files(planted, capsys):
    code, out, err = run_cli(capsys, "verify", str(planted.root), "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1 and err == ""
    assert {p["where"] for p in report["bad"]} == planted.bad
    assert not any(p["removed"] for p in report["bad"])
    reasons = {Path(p["where"]).name: p["reason"] for p in report["bad"]}
    assert reasons[f"{key(0).hex()}.kvb"] == "payload checksum mismatch"
    assert "torn" in reasons[f"{key(1).hex()}.kvb"]
    assert f"holds key {key(2).hex()}" in reasons[f"{key(50).hex()}.kvb"]
    assert f"written for namespace {NS_B.hex()}" in reasons[f"{key(100).hex()}.kvb"]
    assert report["in_flight"] == 2 and report["foreign"] == 3  # notes.txt, not-a-namespace, README
    assert report["good"] == 6 + 3 and report["checked"] == 6 + 3 + 4
    assert all(p.exists() for p in planted.kept)
    # the text form names each bad file with why
    code, out, _ = run_cli(capsys, "verify", str(planted.root))
    assert code == 1
    assert {line.split(": ")[0].removeprefix("BAD ") for line in out.splitlines() if line.startswith("BAD ")} == planted.bad


def test_remove_deletes_exactly_the_bad_files_and_then_verify_is_clean(planted, capsys):
    before = {p for p in planted.root.rglob("*") if p.is_file()}
    code, out, _ = run_cli(capsys, "verify", str(planted.root), "--remove", "--json")
    assert code == 1 and all(p["removed"] for p in json.loads(out)["bad"])
    after = {p for p in planted.root.rglob("*") if p.is_file()}
    assert {str(p) for p in before - after} == planted.bad
    assert all(p.read_bytes() == b"leave me" for p in planted.kept)
    code, out, _ = run_cli(capsys, "verify", str(planted.root))
    assert code == 0, out
    assert_serves(planted.root, planted.good)


def test_clean_directory_verifies_with_exit_0(tmp_path, capsys):
    good = {NS_A: write_tier(tmp_path, NS_A, INFO_A, range(5))}
    code, out, _ = run_cli(capsys, "verify", str(tmp_path))
    assert code == 0 and "5 entries checked: 5 good, 0 bad" in out
    assert_serves(tmp_path, good)


def test_inspect_lists_namespaces_with_their_model_bytes_and_ages(planted, capsys):
    old = path_of(planted.root, NS_B, key(101))
    older = path_of(planted.root, NS_B, key(102))
    now = time.time()
    os.utime(old, (now - 7200, now - 7200))  # 2 hours: "<1d"
    os.utime(older, (now - 3 * 86400, now - 3 * 86400))  # 3 days: ">=1d"
    (planted.root / NS_A.hex() / RECORD_NAME).write_bytes(b"{not json")  # garbled: "unknown"
    code, out, _ = run_cli(capsys, "inspect", str(planted.root), "--json")
    assert code == 0
    s = json.loads(out)
    by_ns = {n["namespace"]: n for n in s["namespaces"]}
    assert set(by_ns) == {NS_A.hex(), NS_B.hex()}
    assert by_ns[NS_B.hex()]["model"] == "/models/beta (torch.bfloat16)"
    assert by_ns[NS_B.hex()]["record"]["model"] == "/models/beta"
    assert by_ns[NS_A.hex()]["model"] == "unknown" and by_ns[NS_A.hex()]["record"] is None
    b_files = [path_of(planted.root, NS_B, key(i)) for i in range(100, 103)]
    assert by_ns[NS_B.hex()]["entries"] == 3 and by_ns[NS_B.hex()]["bytes"] == sum(p.stat().st_size for p in b_files)
    assert by_ns[NS_B.hex()]["ages"] == {"<1m": 1, "<1h": 0, "<1d": 1, ">=1d": 1}
    assert by_ns[NS_A.hex()]["entries"] == 8 + 2  # inspect stats names, it does not verify: planted ones count
    assert s["entries"] == 13 and s["temp_files"] == {"in_flight": 2, "stale": 1} and s["foreign"] == 3
    # text form
    code, out, _ = run_cli(capsys, "inspect", str(planted.root))
    assert f"namespace {NS_B.hex()}  model: /models/beta (torch.bfloat16)" in out
    assert f"namespace {NS_A.hex()}  model: unknown" in out
    assert "temp files: 2 being written, 1 left by interrupted writes" in out


def test_clear_one_namespace_removes_only_its_entries(planted, capsys):
    code, out, _ = run_cli(capsys, "clear", str(planted.root), "--namespace", NS_B.hex())
    assert code == 0 and "removed 3 entries" in out
    assert not list((planted.root / NS_B.hex()).rglob("*.kvb"))
    assert (planted.root / NS_B.hex() / RECORD_NAME).exists()  # the record stays
    assert len(list((planted.root / NS_A.hex()).rglob("*.kvb"))) == 10  # A untouched, bad files included
    assert all(p.exists() for p in planted.kept)
    # clearing everything leaves the live writers' temp files and every stranger
    code, out, _ = run_cli(capsys, "clear", str(planted.root), "--json")
    report = json.loads(out)
    assert code == 0 and report["removed"] == 10 and report["in_flight"] == 2 and report["foreign"] == 3
    assert [p for p in planted.root.rglob("*.kvb")] == [planted.kept[3]]  # only the one outside a namespace
    assert all(p.exists() for p in planted.kept)
    assert_serves(planted.root, {NS_A: {}, NS_B: {}})


def test_keyed_entries_without_the_secret_are_unverified_not_corrupt(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\n")
    secret.chmod(0o600)
    root = tmp_path / "g3"
    good = {NS_A: write_tier(root, NS_A, INFO_A, range(4), secret=b"s3cret")}
    code, out, _ = run_cli(capsys, "verify", str(root), "--remove")
    assert code == 3, out
    assert "4 keyed entries (MAC'd with a KV secret) were not verified" in out and "BAD" not in out
    assert len(list(root.rglob("*.kvb"))) == 4  # nothing removed
    code, out, _ = run_cli(capsys, "verify", str(root), "--kv-offload-secret-file", str(secret))
    assert code == 0 and "4 good, 0 bad" in out
    monkeypatch.setenv("KVTIER_KV_SECRET", "another secret")  # the environment, as the tiers take it
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 1 and out.count("header MAC mismatch") == 4
    # with a secret, an unkeyed entry is bad: the tier would reject it
    monkeypatch.setenv("KVTIER_KV_SECRET", "s3cret")
    write_tier(root, NS_B, INFO_B, range(100, 101))
    code, out, _ = run_cli(capsys, "verify", str(root), "--json")
    report = json.loads(out)
    assert code == 1 and [p["where"] for p in report["bad"]] == [str(path_of(root, NS_B, key(100)))]
    assert "unkeyed entry" in report["bad"][0]["reason"]
    monkeypatch.delenv("KVTIER_KV_SECRET")
    good_a = open_tier(root, NS_A, secret=b"s3cret")
    assert good_a.get(list(good[NS_A])) == list(good[NS_A].values())


def test_verify_and_clear_beside_a_live_tier_in_this_process(tmp_path):
    """The tier keeps serving while the tools work on its directory: a removed file is a miss it
    drops from its index on the next read, after which check_integrity passes; it never serves
    the bad bytes, and it can still write (no directory was removed under it)."""
    tier = open_tier(tmp_path, NS_A, INFO_A)
    data = {key(i): value(i) for i in range(6)}
    assert all(tier.put(list(data), list(data.values())))
    bad_path = path_of(tmp_path, NS_A, key(0))
    raw = bytearray(bad_path.read_bytes())
    raw[-1] ^= 1
    bad_path.write_bytes(bytes(raw))
    report = verify_dir(tmp_path, EntryCodec(), remove=True)
    assert [p.where for p in report.bad] == [str(bad_path)] and report.bad[0].removed
    with pytest.raises(RuntimeError, match="missing"):
        tier.check_integrity()  # documented: until it reads the key, the index still has it
    got = tier.get(list(data))
    assert got[0] is None and got[1:] == list(data.values())[1:]
    tier.check_integrity()
    assert tier.stats.corrupt == 0  # it vanished: a miss, not a corrupt read
    cleared = clear_dir(tmp_path, NS_A)
    assert cleared.removed == 5
    assert tier.get(list(data)) == [None] * 6
    tier.check_integrity()
    assert len(tier) == 0 and tier.used_bytes == 0
    assert tier.put([key(9)], [value(9)]) == [True] and tier.writable
    tier.check_integrity()
    assert inspect_dir(tmp_path).entries == 1


def test_symlinked_namespace_dir_is_not_followed(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    write_tier(elsewhere, NS_A, INFO_A, range(2))
    root = tmp_path / "g3"
    root.mkdir()
    (root / NS_A.hex()).symlink_to(elsewhere / NS_A.hex())
    code, out, _ = run_cli(capsys, "clear", str(root), "--json")
    assert code == 0 and json.loads(out)["removed"] == 0 and json.loads(out)["foreign"] == 1
    assert len(list((elsewhere / NS_A.hex()).rglob("*.kvb"))) == 2


def test_files_of_several_entries_are_walked_entry_by_entry(tmp_path):
    """A G3 file holding a run of entries: inspect and verify count its entries; damage in its
    third entry makes the file bad, named with the entry, and --remove takes the whole file."""
    tier = open_tier(tmp_path, NS_A, INFO_A, file_bytes=1 << 20)
    data = {key(i): value(i) for i in range(5)}
    assert all(tier.put(list(data), list(data.values())))
    path = path_of(tmp_path, NS_A, key(0))
    assert [p for p in tmp_path.rglob("*.kvb")] == [path]
    assert inspect_dir(tmp_path).entries == 5
    report = verify_dir(tmp_path, EntryCodec())
    assert (report.checked, report.good, report.bad) == (5, 5, ())
    raw = bytearray(path.read_bytes())
    third = 2 * (len(raw) // 5)
    raw[third + len(raw) // 10] ^= 1  # inside the third entry's payload
    path.write_bytes(bytes(raw))
    report = verify_dir(tmp_path, EntryCodec(), remove=True)
    assert report.good == 0 and [p.where for p in report.bad] == [str(path)] and "entry 3" in report.bad[0].reason
    assert not path.exists()
