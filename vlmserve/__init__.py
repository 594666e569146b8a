"""vlmserve: a serving engine for vision-language models.

Set here, before anything imports torch: torch's OpenMP runtime (libgomp) reads its wait
policy once, when it is loaded, so the choice is the process's, made from its command:

- The commands that run the engine (`vlmserve serve`, `caption`, `generate`, `demo`) own
  the cores they run on, and a decode step is a hundred short parallel regions with a
  little Python between them. Their OpenMP threads spin for GOMP_SPINCOUNT = 10M
  iterations (about 0.2 s on a 3 GHz core; Intel OpenMP's default KMP_BLOCKTIME, which
  vLLM's CPU build runs with, is 0.2 s) before they sleep: a thread that sleeps between
  the regions is woken for every one, which made served decode steps and offline runs
  measurably slower (docs/hardware.md's "OpenMP waiting" has the figures).
- Anything else (the library, the tests) waits passively: on a CPU shared with other
  processes (a busy CI machine, a notebook beside a server) spinning threads take the
  cores the working threads need, and every parallel region waits for a descheduled
  peer: there passive waiting gave several times the decode throughput, for a fraction
  of the CPU time. `ENGINE_OPENMP` is the engine commands'
  setting, for a program that owns its cores to put in its environment before it
  starts Python.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (OMP_WAIT_POLICY=PASSIVE for a server
on a shared machine); none of this has any effect where torch is already loaded.
"""

import os
import sys

import kernels  # noqa: F401 - VLMSERVE_ISA's caps on torch's libraries, before torch loads

ENGINE_COMMANDS = frozenset({"serve", "caption", "generate", "demo"})
# The preprocessing pool's workers (one image each, beside the engine) still wait
# passively: encoders/preprocess.py starts them so while VLMSERVE_SPIN_ENGINE_ONLY is set.
ENGINE_OPENMP = {"GOMP_SPINCOUNT": "10000000", "VLMSERVE_SPIN_ENGINE_ONLY": "1"}
# What this import put in os.environ (its children inherit it): a benchmark that starts
# servers strips these, so each server picks its own policy as its users' would.
OPENMP_DEFAULTS: dict[str, str] = {}


def _is_engine_command(argv: list[str]) -> bool:
    """`vlmserve serve ...` or `python -m vlmserve.cli serve ...` (argv[0] is "-m" while
    the package is imported on the way to the module), or another engine command."""
    if len(argv) < 2 or argv[1] not in ENGINE_COMMANDS:
        return False
    return argv[0] == "-m" or os.path.basename(argv[0]) == "vlmserve"


if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    OPENMP_DEFAULTS = (
        ENGINE_OPENMP if _is_engine_command(sys.argv) else {"OMP_WAIT_POLICY": "PASSIVE"}
    )
    os.environ.update(OPENMP_DEFAULTS)
