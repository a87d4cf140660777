"""``cuda-ipc`` heap provider: one device allocation per GPU rank, shared through CUDA IPC.

The heap is allocated directly with ``cudaMalloc`` (not through torch's caching allocator, whose
blocks need not start an allocation and, with expandable segments, are not IPC-exportable). Each
rank exports a 64-byte IPC handle; handles are exchanged over torch.distributed and every peer's
is opened once, at creation. The allocation is freed, and peers' handles closed, when the last
tensor viewing them is gone.
"""

from __future__ import annotations

import ctypes

import torch

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.heap.cuda_bindings import checked, module
from iris.heap.mapping import HeapMapping, HeapProvider

__all__ = ["provider"]

IPC_HANDLE_BYTES = 64


def _runtime():
    return module("runtime", "cuda-ipc")


def _check(result, what: str):
    runtime = _runtime()
    return checked(result, what, runtime.cudaError_t.cudaSuccess, runtime.cudaGetErrorString)


class _DeviceMemory:
    """Owns one device range: frees (own) or closes (peer) it when collected.

    Exposes ``__cuda_array_interface__`` so torch can view it; the tensor keeps this object
    alive, so the memory outlives every tensor that views it.
    """

    def __init__(self, pointer: int, size: int, device: torch.device, imported: bool):
        self.pointer = pointer
        self.size = size
        self.device = device
        self.imported = imported
        # Kept: at interpreter exit, when the last tensor goes, the module can no longer be imported.
        self._runtime = _runtime()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.pointer, False), "version": 3}

    def as_tensor(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self.device)

    def __del__(self):
        runtime = self._runtime
        if self.imported:
            runtime.cudaIpcCloseMemHandle(self.pointer)
        else:
            runtime.cudaFree(self.pointer)


def _export(pointer: int) -> bytes:
    handle = _check(_runtime().cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _import(raw: bytes) -> int:
    runtime = _runtime()
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return _check(
        runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle",
    )


def create(size: int, comm: Communicator, device: torch.device) -> HeapMapping:
    runtime = _runtime()
    _check(runtime.cudaSetDevice(device.index), f"cudaSetDevice({device.index})")
    free, total = torch.cuda.mem_get_info(device)
    if size > free:
        raise IrisError(
            f"GPU {device} has {format_bytes(free)} free of {format_bytes(total)}, too little for "
            f"a heap of {format_bytes(size)}; pass a smaller heap_size=... (or IRIS_HEAP_SIZE)"
        )
    pointer = int(_check(runtime.cudaMalloc(size), f"cudaMalloc({size})"))
    own = _DeviceMemory(pointer, size, device, imported=False)
    # Zeroed like a fresh shared-memory segment, so both providers start from the same state.
    _check(runtime.cudaMemset(pointer, 0, size), "cudaMemset")
    _check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    handles = comm.all_gather_object(_export(pointer))
    memories = [
        own if rank == comm.rank else _DeviceMemory(int(_import(raw)), size, device, imported=True)
        for rank, raw in enumerate(handles)
    ]
    return HeapMapping(size=size, peers=tuple(m.as_tensor() for m in memories))


provider = HeapProvider(name="cuda-ipc", device_type="cuda", create=create)
