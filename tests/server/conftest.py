"""Server test fixtures: real `kvtier serve` processes."""
from __future__ import annotations

import pytest
from serving import start_server


@pytest.fixture(scope="module")
def demo_server():
    """The README's command: `kvtier serve` on the embedded demo model."""
    srv = start_server("--max-model-len", "2048", "--kv-cache-memory", "0.5", compiled=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_server(ckpt_dir):
    """A random-weight Llama test checkpoint: fast, for protocol and error tests."""
    srv = start_server(str(ckpt_dir("llama")), "--served-model-name", "tiny", "--num-gpu-blocks", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def long_ckpt(tmp_path_factory):
    """The tiny Llama with a 64k-token context (serve with --num-gpu-blocks 4200): one request can
    generate for a minute (about 1k tokens/s on a CPU), for tests that act while a request is
    still running."""
    import checkpoints

    return checkpoints.build_checkpoint("llama", tmp_path_factory.mktemp("long") / "llama",
                                        max_position_embeddings=1 << 16)
