"""How the tests' `kvtier serve` processes run the model."""
from __future__ import annotations

# Flags that choose how the model runs: with none of them, a test server runs eagerly.
LEVEL_FLAGS = ("-O", "--optimization-level", "--enforce-eager")


def eager_unless_chosen(args: list[str]) -> list[str]:
    """`args` with `-O 0` added unless they choose a level themselves: compiling takes ~5 s of each
    server's start (dynamo's import and the compile), and the protocol, error, lifecycle and fleet
    tests do not depend on it. The compiled path is tested in-process (tests/engine) and through
    the server by test_serve_models and the demo server (`start_server(..., compiled=True)`)."""
    chosen = any(a in LEVEL_FLAGS or a.startswith(("-O", "--optimization-level=")) for a in args)
    return args if chosen else [*args, "-O", "0"]
