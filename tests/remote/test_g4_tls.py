"""G4 over TLS (`rediss://`): a real redis-server with a TLS port and a throwaway CA. The CA
goes in the URL (`?ssl_ca_certs=PATH`, redis-py's URL option); a server whose certificate the
client cannot verify is an outage (misses), not a silent plaintext fallback."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from kvstore.remote import RedisBackend, RemoteConfig
from redis_procs import SERVER, RedisProc, free_port

NS = bytes(range(16))
pytestmark = pytest.mark.skipif(SERVER is None or shutil.which("openssl") is None,
                                reason="needs redis-server and openssl")


def make_ca(d, name: str) -> tuple[str, str, str]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.crt",
        "-days", "2", "-subj", f"/CN={name}-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.crt", "-CAkey", f"{name}-ca.key", "-CAcreateserial",
        "-out", f"{name}.crt", "-days", "2", "-extfile", "san.cnf")
    return str(d / f"{name}-ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key")


def test_rediss_round_trip_and_unverifiable_server_is_a_miss(tmp_path):
    ca, cert, key = make_ca(tmp_path, "server")
    other_ca, _, _ = make_ca(tmp_path, "other")
    port = free_port()
    r = RedisProc(tmp_path / "redis", port, ("--port", "0", "--tls-port", str(port), "--tls-cert-file", cert,
                                             "--tls-key-file", key, "--tls-ca-cert-file", ca,
                                             "--tls-auth-clients", "no"))
    # RedisProc passes --port first; the later "--port 0" wins: TLS only.
    try:
        r.start()
    except RuntimeError:
        pytest.skip("this redis-server was built without TLS")
    try:
        good = RedisBackend(RemoteConfig(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", NS, timeout_s=2.0))
        assert good.put([bytes(16)], [b"over tls"]) == [True]
        assert good.get([bytes(16)]) == [b"over tls"]
        untrusted = RedisBackend(RemoteConfig(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}", NS,
                                              timeout_s=2.0))
        assert untrusted.get([bytes(16)]) == [None]
        assert untrusted.describe()["breaker"] == "open"
        plaintext = RedisBackend(RemoteConfig(f"redis://127.0.0.1:{port}", NS, timeout_s=1.0))
        assert plaintext.get([bytes(16)]) == [None]
        for b in (good, untrusted, plaintext):
            b.close()
    finally:
        r.stop()
