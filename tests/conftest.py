"""Shared pytest fixtures: small random-weight checkpoints (see tests/checkpoints.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

# `checkpoints` (tests/checkpoints.py) and the project packages (engine, ...) importable
# however pytest is started (`pytest` does not put the repository root on sys.path).
_TESTS_DIR = Path(__file__).resolve().parent
for _p in (_TESTS_DIR, _TESTS_DIR.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import checkpoints  # noqa: E402

# The longest test files start first under xdist (tests/file_order.py).
pytest_plugins = ["file_order"]

# Triton reads TRITON_INTERPRET when a kernel is *defined*, i.e. when engine.kernels is first
# imported, and any test module may import it (tests/engine uses engine.kernels.reference): set it
# here, before any test module is collected, or the kernel tests skip as "not interpreting".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines in tests run eagerly unless a test asks for a level: compiling costs seconds per engine
# (hundreds of them), and the parity suite and tests/engine/test_compiled.py run the compiled model.
# Inherited by the servers and CLIs the tests start.
os.environ.setdefault("KVTIER_OPTIMIZATION_LEVEL", "0")

# G1's default size on CPU, for the engines and servers that do not choose one: 0.5 GiB instead of
# 2 (a tiny checkpoint gets 65,536 blocks instead of 262,144; the demo model keeps its 8k context).
# Zeroing 2 GiB and building its block table took ~2.5 s of each of the suite's server starts.
os.environ.setdefault("KVTIER_CPU_KVCACHE_SPACE", "0.5")

# The test models are tiny (hidden 64): one intra-op thread is as fast as two, and on a
# busy 2-core machine two OpenMP threads wait on each other (a 30-token forward went from
# 1 ms to 270 ms).  KVTIER_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("KVTIER_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Factory: ``ckpt_dir(kind)`` -> directory of that kind's checkpoint (seed 0, float32).

    Each kind is built once per session, on first use (about half a second each).
    """
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = checkpoints.build_checkpoint(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def hf_model(ckpt_dir):
    """Factory: ``hf_model(kind)`` -> the transformers model (the oracle), loaded once."""
    loaded: dict = {}

    def get(kind: str):
        if kind not in loaded:
            loaded[kind] = checkpoints.load_hf(ckpt_dir(kind))
        return loaded[kind]

    return get


@pytest.fixture(scope="session")
def tokenizer(ckpt_dir):
    """The tokenizer all the checkpoints share, loaded back from a checkpoint directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt_dir("qwen3"))


for _kind in checkpoints.KINDS:
    def _make(kind):
        @pytest.fixture(scope="session", name=f"{kind}_ckpt")
        def _fixture(ckpt_dir):
            return ckpt_dir(kind)
        return _fixture
    globals()[f"{_kind}_ckpt"] = _make(_kind)
del _kind


# A hung engine (a scheduler that never finishes a request) must fail the test rather than
# block the run forever.  Only for the engine test modules listed here; covers fixture
# setup (module-scoped engines) as well as the test call.
_GUARDED_MODULES = {"test_parity", "test_settings", "test_prefix_cache", "test_sampling", "test_errors"}
_TEST_TIMEOUT_S = 300


@contextlib.contextmanager
def _deadline(item):
    mod = getattr(getattr(item, "module", None), "__name__", "").rsplit(".", 1)[-1]
    if mod not in _GUARDED_MODULES or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _alarm(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran longer than {_TEST_TIMEOUT_S} s (engine hang?)")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(_TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _deadline(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _deadline(item):
        yield
