"""vlmserve: a serving engine for vision-language models.

Set here, before anything imports torch: torch's OpenMP runtime (libgomp) reads its wait
policy once, when it is loaded. By default a thread that reaches the end of a parallel
region spins for about 300k iterations before it sleeps; on a CPU shared with other
processes (a server beside its clients, a busy CI machine) the spinning threads take the
cores the working threads need, and every parallel region waits for a descheduled peer.
Passive waiting gave 2-6x the decode throughput on a 2-core machine under a load of 5-11
(and a fifth of the CPU time); see the issue notes for the A/B. A user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; it has no effect where torch is already loaded.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
