"""Ending a kvtier process quickly once its work is done and flushed."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Ends the process as `sys.exit(code)` would, minus the interpreter's teardown.

    Non-daemon threads are joined and every atexit handler runs (logging's flush,
    multiprocessing's children, weakref finalizers such as temporary directories); only the
    module teardown is skipped. With torch, transformers and sympy loaded that teardown runs
    full garbage collections over hundreds of thousands of objects: 1.5-2.5 s a process on a
    2-core machine, paid twice (API process and engine core) by every `kvtier serve` stop.
    Callers have already closed what they own (the core flushes its G3 writes first).
    """
    # What the interpreter's own exit runs first (multiprocessing's children call it too): wakes
    # idle executor workers and joins every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # None, closed, or a gone pipe
            stream.flush()
    os._exit(code)
