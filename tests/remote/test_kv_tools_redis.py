"""Issue 19: `kvtier kv` on a G4 Redis (a real redis-server). Entries are written by the real
RedisBackend, bad values planted by hand; afterwards a RedisBackend must still serve every
untouched entry byte-exact, and keys that are not kvtier's must be left as they were."""
from __future__ import annotations

import json

import pytest
import redis

from kvstore.entry import HEADER_SIZE
from kvtools.inspect_redis import RedisTool
from kvtools.inspect_report import RedisTarget
from kvstore.remote import RedisBackend, RemoteConfig
from server.cli import main
import kv_samples
from kv_samples import INFO_A, INFO_B, NS_A, NS_B, key



def value(i: int) -> bytes:
    return kv_samples.value(i, 2000)


def name(ns: bytes, k: bytes, prefix: str = "kvtier") -> str:
    return f"{prefix}:{ns.hex()}:{k.hex()}"


def tier(url: str, ns: bytes, info: dict | None = None, **kw) -> RedisBackend:
    return RedisBackend(RemoteConfig(url, ns, timeout_s=5.0, info=info, **kw))


def write(url: str, ns: bytes, info: dict, ids: range, **kw) -> dict[bytes, bytes]:
    b = tier(url, ns, info, **kw)
    data = {key(i): value(i) for i in ids}
    assert all(b.put(list(data), list(data.values())))
    b.close()
    return data


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["kv", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def planted(redis_proc):
    """Two namespaces, four bad values of the kinds the tier rejects, and keys that are not kvtier's."""
    url = redis_proc.url
    good = {NS_A: write(url, NS_A, INFO_A, range(6)), NS_B: write(url, NS_B, INFO_B, range(100, 103))}
    r = redis.Redis.from_url(url)
    flipped = bytearray(r.get(name(NS_A, key(0))))
    flipped[-3] ^= 0x10
    r.set(name(NS_A, key(0)), bytes(flipped))
    r.set(name(NS_A, key(1)), r.get(name(NS_A, key(1)))[:-50])  # truncated
    r.set(name(NS_A, key(50)), r.get(name(NS_A, key(2))))  # a header for another key
    r.set(name(NS_A, key(100)), r.get(name(NS_B, key(100))))  # another namespace's entry
    del good[NS_A][key(0)], good[NS_A][key(1)]
    bad = {name(NS_A, k) for k in (key(0), key(1), key(50), key(100))}
    foreign = {"kvtier:hello": b"world", f"kvtier:{NS_A.hex()}:notes": b"x", "other:thing": b"y"}
    for k, v in foreign.items():
        r.set(k, v)
    r.hset(name(NS_A, key(60)), "field", "a hash under an entry's name")
    yield url, good, bad, foreign, r
    r.close()


def assert_serves(url: str, good: dict[bytes, dict[bytes, bytes]]) -> None:
    for ns, data in good.items():
        b = tier(url, ns)
        assert b.get(list(data)) == list(data.values())
        assert b.stats.corrupt == 0
        b.close()


def test_inspect_lists_namespaces_with_their_model(planted, capsys):
    url, good, _, _, r = planted
    code, out, err = run_cli(capsys, "inspect", url, "--json")
    assert code == 0 and err == ""
    s = json.loads(out)
    by_ns = {n["namespace"]: n for n in s["namespaces"]}
    assert by_ns[NS_A.hex()]["model"] == "/models/alpha (torch.float32)"
    assert by_ns[NS_B.hex()]["model"] == "/models/beta (torch.bfloat16)"
    assert by_ns[NS_B.hex()]["entries"] == 3
    assert by_ns[NS_B.hex()]["bytes"] == sum(r.strlen(name(NS_B, k)) for k in good[NS_B])
    assert by_ns[NS_A.hex()]["entries"] == 8  # 6 written + 2 planted (inspect does not verify)
    assert s["entries"] == 11 and s["ages"]["<1m"] == 11
    assert s["foreign"] == 3  # kvtier:hello, the :notes key, the hash; other:thing is not under the prefix
    code, out, _ = run_cli(capsys, "inspect", url)
    assert f"namespace {NS_A.hex()}  model: /models/alpha (torch.float32)" in out
    assert "ages (since last access)" in out


def test_verify_remove_and_clear_touch_only_kvtier_keys(planted, capsys):
    url, good, bad, foreign, r = planted
    code, out, _ = run_cli(capsys, "verify", url, "--json")
    report = json.loads(out)
    assert code == 1 and {p["where"] for p in report["bad"]} == bad
    assert report["good"] == 4 + 3 and report["foreign"] == 3
    code, out, _ = run_cli(capsys, "verify", url, "--remove")
    assert code == 1 and out.count("[removed]") == 4
    assert not any(r.exists(k) for k in bad)
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == 0, out
    assert_serves(url, good)
    # clear one namespace: the other's entries, both records and every foreign key stay
    code, out, _ = run_cli(capsys, "clear", url, "--namespace", NS_B.hex())
    assert code == 0 and "removed 3 entries" in out
    assert not any(r.exists(name(NS_B, k)) for k in good[NS_B])
    assert_serves(url, {NS_A: good[NS_A]})
    assert all(r.get(k) == v for k, v in foreign.items()) and r.type(name(NS_A, key(60))) == b"hash"
    code, out, _ = run_cli(capsys, "inspect", url, "--json")
    by_ns = {n["namespace"]: n for n in json.loads(out)["namespaces"]}
    assert by_ns[NS_B.hex()]["entries"] == 0 and by_ns[NS_B.hex()]["model"] == "/models/beta (torch.bfloat16)"


def test_a_value_rewritten_since_verify_read_it_is_not_deleted(redis_proc):
    url = redis_proc.url
    write(url, NS_A, INFO_A, range(1))
    r = redis.Redis.from_url(url)
    good = r.get(name(NS_A, key(0)))
    broken = good[:HEADER_SIZE - 1] + bytes([good[HEADER_SIZE - 1] ^ 1]) + good[HEADER_SIZE:]
    tool = RedisTool(RedisTarget(url))
    # verify read `broken`; an engine has written the good value since: the compare-and-delete keeps it
    problem = tool._bad(name(NS_A, key(0)).encode(), broken[:HEADER_SIZE], "header checksum mismatch")
    assert not problem.removed and "left alone" in problem.reason and r.get(name(NS_A, key(0))) == good
    r.set(name(NS_A, key(0)), broken)
    assert tool._bad(name(NS_A, key(0)).encode(), broken[:HEADER_SIZE], "header checksum mismatch").removed
    assert not r.exists(name(NS_A, key(0)))
    tool.close()
    r.close()


def test_keyed_values_and_a_custom_prefix(redis_proc, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    url = redis_proc.url
    good = write(url, NS_A, INFO_A, range(3), secret=b"s3cret", prefix="team1")
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == 0 and "0 entries checked" in out  # another prefix: nothing of ours under "kvtier"
    code, out, _ = run_cli(capsys, "verify", url, "--prefix", "team1", "--remove")
    assert code == 3 and "3 keyed entries" in out and "BAD" not in out
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    code, out, _ = run_cli(capsys, "verify", url, "--prefix", "team1", "--kv-offload-secret-file", str(secret))
    assert code == 0 and "3 good, 0 bad" in out
    b = RedisBackend(RemoteConfig(url, NS_A, prefix="team1", timeout_s=5.0, secret=b"s3cret"))
    assert b.get(list(good)) == list(good.values())
    b.close()
