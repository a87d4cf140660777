"""Device queries under upstream iris's names (``iris.hip``), answered for NVIDIA GPUs and CPU ranks.

Programs written for upstream iris ask ``iris.hip`` about the device: how many compute units it
has (to size persistent grids), how fast the clock behind ``iris.device_utils.read_realtime``
ticks (to turn timestamps into microseconds), how many XCDs a chip has (to lay tiles out). This
module gives the same answers for the devices iris runs on:

* on a machine with CUDA GPUs, the GPU's own values, through torch (a "compute unit" is a
  streaming multiprocessor; an NVIDIA GPU is one die, so one "XCC");
* on a machine without a GPU, the host counts as the one device, ``0``, whose compute units are
  the CPU cores this process may run on; kernels run in Triton's interpreter there.

Upstream's HIP/ROCr-only calls (DMA-BUF export and import, virtual-memory reservation and
mapping, fine-grained allocation: :data:`AMD_ONLY`) exist under their names, so that a program
that imports them still imports; calling one raises :class:`NotImplementedError` naming the call
and what iris does instead on NVIDIA GPUs.

Importing it needs no GPU, no process group and no Triton.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "AMD_ONLY",
    "count_devices",
    "get_address_range",
    "get_arch_string",
    "get_cu_count",
    "get_device_id",
    "get_num_xcc",
    "get_rocm_version",
    "get_wall_clock_rate",
    "set_device",
]

#: Ticks per millisecond of ``iris.device_utils.read_realtime``: it counts nanoseconds, on a GPU
#: (``%globaltimer``) and in the interpreter (the host's monotonic clock) alike.
WALL_CLOCK_RATE_KHZ = 1_000_000

#: What :func:`get_arch_string` returns on a machine without a GPU.
CPU_ARCH = "cpu"


def _has_gpu() -> bool:
    return torch.cuda.is_available()


def _device(device_id: int | None) -> int:
    """``device_id`` checked against the devices there are (the current one when None)."""
    if device_id is None:
        return get_device_id()
    if isinstance(device_id, bool) or not isinstance(device_id, int):
        raise TypeError(f"device_id must be an int or None, got {device_id!r}")
    count = count_devices()
    if not 0 <= device_id < count:
        where = f"{count} CUDA GPU(s)" if _has_gpu() else "no GPU: the host is the one device, 0"
        raise ValueError(f"device_id={device_id} is not a device of this machine ({where})")
    return device_id


def count_devices() -> int:
    """Number of devices: the CUDA GPUs visible to this process, or 1 (the host) without a GPU.

    Without a GPU the answer is 1 rather than 0 so that the usual ``rank % count_devices()``
    keeps working for CPU ranks, which all run on the host.
    """
    return torch.cuda.device_count() if _has_gpu() else 1


def set_device(device_id: int) -> None:
    """Make ``device_id`` the current device of this process (``torch.cuda.set_device``).
    Without a GPU only ``0``, the host, exists, and setting it changes nothing."""
    device_id = _device(device_id)
    if _has_gpu():
        torch.cuda.set_device(device_id)


def get_device_id() -> int:
    """The current device of this process (``torch.cuda.current_device()``); 0 without a GPU."""
    return torch.cuda.current_device() if _has_gpu() else 0


def get_cu_count(device_id: int | None = None) -> int:
    """Compute units of a device (the current one when ``device_id`` is None): the GPU's
    streaming multiprocessors, or without a GPU the CPU cores this process may run on."""
    device_id = _device(device_id)
    if _has_gpu():
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks on this platform
        return os.cpu_count() or 1


def get_num_xcc(device_id: int | None = None) -> int:
    """Compute dies (AMD's XCCs) of a device: 1, since an NVIDIA GPU, like the host, is one."""
    _device(device_id)
    return 1


def get_wall_clock_rate(device_id: int) -> int:
    """Rate in kHz of the clock that ``iris.device_utils.read_realtime`` reads: 1,000,000 (one tick
    a nanosecond) on every device, so ``ticks / (rate * 1e-3)`` is microseconds, as upstream
    programs compute it.

    ``device_id`` may be any device or rank number (upstream programs pass their rank; CPU ranks
    all read the host's clock), so it is only checked to be a non-negative int.
    """
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be a non-negative int, got {device_id!r}")
    return WALL_CLOCK_RATE_KHZ


def get_arch_string(device_id: int | None = None) -> str:
    """The device's architecture as its compiler names it: ``"sm_90"`` for an H100 or H200
    (``sm_{major}{minor}`` of its compute capability), or ``"cpu"`` without a GPU."""
    device_id = _device(device_id)
    if not _has_gpu():
        return CPU_ARCH
    major, minor = torch.cuda.get_device_capability(device_id)
    return f"sm_{major}{minor}"


def get_rocm_version() -> tuple[int, int]:
    """``(-1, -1)``: what upstream returns when it finds no ROCm installation, as here."""
    return (-1, -1)


def get_address_range(ptr) -> tuple[int, int]:
    """``(base, size)`` of the CUDA allocation that holds the device address ``ptr`` (an int or
    a ctypes pointer), as the driver reports it (``cuMemGetAddressRange``); on a machine without a
    GPU there is no device allocation to ask about (RuntimeError)."""
    if not torch.cuda.is_available():
        raise RuntimeError("iris.hip.get_address_range: no CUDA GPU is visible; address ranges are those of device "
                           "allocations (CPU ranks' memory has none)")
    from cuda.bindings import driver

    torch.cuda.init()  # the primary context the driver call needs
    address = ptr if isinstance(ptr, int) else ptr.value
    err, base, size = driver.cuMemGetAddressRange(address)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"iris.hip.get_address_range({address:#x}): cuMemGetAddressRange failed ({err.name}); "
                           f"pass an address inside a CUDA allocation (tensor.data_ptr() of a CUDA tensor)")
    return int(base), int(size)


#: Upstream's calls that only HIP/ROCr provide, by what they are for.
AMD_ONLY = {
    **dict.fromkeys(("export_dmabuf_handle", "import_dmabuf_handle", "destroy_external_memory"),
                    "DMA-BUF sharing of device memory"),
    **dict.fromkeys(("get_allocation_granularity", "mem_create", "mem_export_to_shareable_handle",
                     "mem_import_from_shareable_handle", "mem_address_reserve", "mem_map", "mem_unmap",
                     "mem_address_free", "mem_release", "mem_set_access"),
                    "HIP virtual-memory management"),
    "malloc_fine_grained": "fine-grained (hipExtMallocWithFlags) allocation",
}


def _amd_only(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"iris.hip.{name} is {AMD_ONLY[name]}, which only HIP/ROCr provides (AMD GPUs); iris on NVIDIA GPUs "
            f"and CPU ranks has no such call: its symmetric heap is mapped into every peer when the context is "
            f"created (CUDA IPC), and ctx.as_symmetric(tensor) puts an existing tensor on the heap "
            f"(docs/migrating.md)")

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Upstream's HIP/ROCr-only ``{name}`` ({AMD_ONLY[name]}): raises NotImplementedError here."
    return call


def __getattr__(name: str):
    """Upstream's AMD-only calls (:data:`AMD_ONLY`), which raise when called."""
    if name in AMD_ONLY:
        return _amd_only(name)
    raise AttributeError(f"module 'iris.hip' has no attribute {name!r}")
