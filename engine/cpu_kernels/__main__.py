"""`python -m engine.cpu_kernels`: build the CPU kernels now (what `make setup` runs)."""
import logging

from engine.cpu_kernels.build import BuildError, build

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(build())
except BuildError as e:
    print(f"WARNING: CPU kernels not built; the torch attention path will be used: {e}")
