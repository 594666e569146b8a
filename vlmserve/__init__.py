"""vlmserve: a serving engine for vision-language models.

Set here, before anything imports torch: torch's OpenMP runtime (libgomp) reads its wait
policy once, when it is loaded, so the choice is the process's, made from its command:

- `vlmserve serve` owns the cores it serves on, and its decode steps are a hundred short
  parallel regions with a little Python between them. Its OpenMP threads spin for
  GOMP_SPINCOUNT = 10M iterations (about 0.2 s on a 3 GHz core; Intel OpenMP's default
  KMP_BLOCKTIME, which vLLM's CPU build runs with, is 0.2 s) before they sleep: a thread
  that sleeps between the regions is woken for every one, and on the 2-core VM here a
  served decode step at 1 sequence took 29-62 ms with passive waiting and 19-29 ms
  spinning (medians of fresh processes, interleaved; see the issue notes).
- Anything else (the library, the tests, offline jobs sharing a machine) waits passively:
  on a CPU shared with other processes (a server beside its clients, a busy CI machine)
  spinning threads take the cores the working threads need, and every parallel region
  waits for a descheduled peer. Passive waiting gave 2-6x the decode throughput on a
  2-core machine under a load of 5-11 (and a fifth of the CPU time).

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (OMP_WAIT_POLICY=PASSIVE for a server
on a shared machine); none of this has any effect where torch is already loaded.
"""

import os
import sys

SERVE_SPINCOUNT = "10000000"
# What this import put in os.environ (its children inherit it): a benchmark that starts
# servers strips these, so each server picks its own policy as its users' would.
OPENMP_DEFAULTS: dict[str, str] = {}


def _is_serve_command(argv: list[str]) -> bool:
    """`vlmserve serve ...` or `python -m vlmserve.cli serve ...` (argv[0] is "-m" while
    the package is imported on the way to the module)."""
    return argv[1:2] == ["serve"] and (argv[0] == "-m" or os.path.basename(argv[0]) == "vlmserve")


if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    if _is_serve_command(sys.argv):
        # The preprocessing pool's workers (one image each, beside the engine) still wait
        # passively: encoders/preprocess.py starts them so while VLMSERVE_SPIN_SERVER_ONLY
        # is set.
        OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": SERVE_SPINCOUNT, "VLMSERVE_SPIN_SERVER_ONLY": "1"}
    else:
        OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
    os.environ.update(OPENMP_DEFAULTS)
