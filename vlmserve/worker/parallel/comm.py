"""The collectives of one tensor-parallel group, on process groups of its own.

Two groups over one TCP rendezvous store: `device` (NCCL between GPUs, gloo on CPU) for
the decoder's all-reduces, and `control` (gloo, host memory) for what rank 0 sends the
others: each step's inputs, the vision tower's tiles. The groups are built directly
(`ProcessGroupGloo(store, rank, size)`), not through `init_process_group`, so a process
holds no global distributed state: a test can start, close and start engines again, and
a TP engine can live beside anything else using torch.distributed.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# A peer that stops answering (crashed, or the engine is gone) fails a collective after
# this long instead of hanging forever; an idle engine sends nothing, so the workers'
# wait for the next command has no timeout (see worker.py for how they notice the end).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
_HOST = "127.0.0.1"


def master_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore(
        _HOST, 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )


def worker_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(_HOST, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


class TPGroup:
    """Rank `rank` of `size`: all-reduce for the forward, objects from rank 0."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.control = dist.ProcessGroupGloo(
            dist.PrefixStore("control/", store), rank, size, COLLECTIVE_TIMEOUT
        )
        if device.type == "cuda":  # pragma: no cover - needs two GPUs
            self.device_group = dist.ProcessGroupNCCL(
                dist.PrefixStore("device/", store), rank, size
            )
        else:
            self.device_group = dist.ProcessGroupGloo(
                dist.PrefixStore("device/", store), rank, size, COLLECTIVE_TIMEOUT
            )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (the row-parallel layers' partial sums)."""
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit everywhere)."""
        t = torch.tensor([value], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled; tensors inside must be on the host)."""
        if self.rank == 0:
            data = _to_bytes(obj)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self.control.broadcast([size], dist.BroadcastOptions()).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast([data], dist.BroadcastOptions()).wait()
        return obj if self.rank == 0 else _from_bytes(data)

    def send_object(self, obj: object, dst: int) -> None:
        data = _to_bytes(obj)
        self.control.send([torch.tensor([data.numel()], dtype=torch.long)], dst, 0).wait()
        self.control.send([data], dst, 1).wait()

    def recv_object(self, src: int) -> object:
        size = torch.zeros(1, dtype=torch.long)
        self.control.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.recv([data], src, 1).wait()
        return _from_bytes(data)


def _to_bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> object:
    return pickle.loads(data.numpy().tobytes())
