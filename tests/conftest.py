"""Shared test set-up: Triton's interpreter on CPU-only machines, a session context, markers,
and the helpers of multi-rank tests."""

import os
import pickle
import traceback
import zlib
from contextlib import contextmanager

import torch

# CPU ranks run Triton kernels in Triton's interpreter, which reads TRITON_INTERPRET when Triton
# is imported: set it before any test imports Triton (and before iris.create(device="cpu")).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import iris  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``@pytest.mark.gpu`` are skipped when no CUDA GPU is visible."""
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none is visible)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ctx():
    """A single-rank, in-process context with a 64 MiB heap, on the GPU when one is visible,
    else on the CPU. Shared by the whole session: tests free what they allocate in bulk."""
    owns_process_group = not torch.distributed.is_initialized()
    context = iris.create(heap_size="64MiB", device="cuda" if HAS_CUDA else "cpu")
    yield context
    context.destroy()
    if owns_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # NCCL warns at exit about one left behind


def interpreter_runs_kernel_loops() -> bool:
    """Whether Triton's interpreter can run loops with runtime bounds here: Triton 3.6's fails
    under numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars")."""
    import numpy
    import triton
    from packaging.version import Version

    return Version(triton.__version__) >= Version("3.9") or Version(numpy.__version__) < Version("2.4")


def skip_unless_interpreter_runs_kernel_loops() -> None:
    """Skip (by capability) a test that interprets kernels with runtime-bounded loops."""
    if not interpreter_runs_kernel_loops():
        pytest.skip("this Triton's interpreter cannot run runtime-bounded loops with this numpy; pin numpy<2.4")


#: Variables that shape a context; tests of configuration start without them.
IRIS_ENV = ("IRIS_BACKEND", "IRIS_HEAP_SIZE", "IRIS_DEBUG", "IRIS_TIMEOUT", "IRIS_LOG_LEVEL", "IRIS_DEVICE")


@pytest.fixture
def clean_iris_env(monkeypatch):
    """Remove every IRIS_* variable that shapes a context, for the duration of a test."""
    for name in IRIS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def global_backends():
    """The process-wide backend registry, restored after the test. There is no public way to
    unregister a backend (on purpose), so the registry's private tables are put back."""
    from iris.registry import backends

    entries, loaded = dict(backends._entries), dict(backends._loaded)
    yield backends
    with backends._lock:
        backends._entries.clear()
        backends._entries.update(entries)
        backends._loaded.clear()
        backends._loaded.update(loaded)


# -- multi-rank tests -------------------------------------------------------------------------------------------


def rank_device(nprocs: int) -> str:
    """GPU ranks when there is one GPU per rank, else CPU ranks (Triton's interpreter)."""
    if torch.cuda.device_count() >= nprocs:
        return "cuda"
    skip_unless_interpreter_runs_kernel_loops()
    return "cpu"


def backend_rank_device(backend: str, nprocs: int) -> str:
    """The device of ``nprocs`` ranks here, skipping (by capability) when ``backend``'s kernels
    do not run on it (Gluon needs GPUs)."""
    device = rank_device(nprocs)
    runs_on = iris.registry.get_backend(backend).device_types
    if device not in runs_on:
        pytest.skip(f"backend {backend!r} runs on {', '.join(sorted(runs_on))} only; {nprocs} ranks here are "
                    f"{device} ranks")
    return device


def seeded_generator(*seed) -> torch.Generator:
    """A CPU generator seeded from ``seed`` the same way in every process (``hash`` of a str is not)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


class RankReport(dict):
    """What one rank saw: check name -> True / False / error text. A section that raises records
    its traceback under ``<section>/completed`` instead of ending the worker, so the other
    sections still report."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def check(self, name: str, ok) -> None:
        self[name] = bool(ok)

    @contextmanager
    def section(self, name: str):
        try:
            yield
            self[f"{name}/completed"] = True
        except Exception:
            self[f"{name}/completed"] = f"rank {self.rank}: {traceback.format_exc()[-3000:]}"

    def packed(self) -> bytes:
        """The report, compressed: iris.spawn reads the ranks' results only after every rank has
        exited, through one pipe, so a rank whose pickled result passes the pipe's 64 KiB blocks
        in put() forever."""
        return zlib.compress(pickle.dumps(dict(self)))


def spawn_reports(worker, nprocs: int, *args, device: str) -> list[dict]:
    """Every rank's unpacked :class:`RankReport` from ``worker(rank, *args)`` on ``nprocs`` ranks,
    with a two-minute timeout (a rank that hangs fails in two minutes, not five) and no debug mode."""
    mp = pytest.MonkeyPatch()
    mp.setenv("IRIS_TIMEOUT", "120")
    mp.delenv("IRIS_DEBUG", raising=False)
    try:
        return [pickle.loads(zlib.decompress(p)) for p in iris.spawn(worker, nprocs, *args, device=device)]
    finally:
        mp.undo()


def assert_rank_checks(reports: list[dict], prefix: str, minimum: int) -> None:
    """Every rank's sections completed, at least ``minimum`` checks are named ``prefix*``, and
    all of them passed."""
    errors = {f"r{r}/{k}": v for r, rep in enumerate(reports) for k, v in rep.items()
              if k.endswith("/completed") and v is not True}
    assert not errors, "\n".join(f"{k}: {v}" for k, v in errors.items())
    checks = {f"r{r}/{k}": v for r, rep in enumerate(reports) for k, v in rep.items() if k.startswith(prefix)}
    assert len(checks) >= minimum, f"only {len(checks)} checks named {prefix}*"
    failed = sorted(k for k, v in checks.items() if v is not True)
    assert not failed, f"{len(failed)} of {len(checks)} failed: {failed[:30]}"
