"""Shared test set-up: Triton's interpreter on CPU-only machines, a session context, markers.
The multi-rank helpers come from iris's pytest plugin, ``iris.testing``."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
#: The echo plugin's source: a minimal third-party distribution (a backend and an all_reduce algorithm).
ECHO_PLUGIN = Path(__file__).parent / "fixtures" / "iris_echo_plugin"

# CPU ranks run Triton kernels in Triton's interpreter, which reads TRITON_INTERPRET when Triton
# is imported: set it before any test imports Triton (and before iris.create(device="cpu")).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The automatic choices the tests expect are the built-in ones: a tuning cache of this machine
# (docs/tuning.md) is not read. Tests of tuning name their own cache folders.
os.environ["IRIS_TUNING_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"iris-test-tuning-{os.getpid()}")


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
    import iris

    owns_process_group = not torch.distributed.is_initialized()
    context = iris.create(heap_size="64MiB", device="cuda" if HAS_CUDA else "cpu")
    yield context
    context.destroy()
    if owns_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # NCCL warns at exit about one left behind


#: Variables that shape a context; tests of configuration start without them.
IRIS_ENV = ("IRIS_BACKEND", "IRIS_HEAP_SIZE", "IRIS_DEBUG", "IRIS_TIMEOUT", "IRIS_LOG_LEVEL", "IRIS_DEVICE")


@pytest.fixture
def free_heap_after(ctx):
    """Return every block a test allocated to the session heap, so tests stay independent (the
    allocator has no public listing of live blocks, hence ``_allocated``). Modules that allocate
    on the session ``ctx`` use it for every test: ``pytestmark = pytest.mark.usefixtures(...)``."""
    before = set(ctx.heap.allocator._allocated)
    yield
    for offset in sorted(set(ctx.heap.allocator._allocated) - before):
        ctx.heap.free_offset(offset)


@pytest.fixture
def clean_iris_env(monkeypatch):
    """Remove every IRIS_* variable that shapes a context, for the duration of a test."""
    for name in IRIS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def global_backends():
    """The process-wide backend registry, put back as it was after the test (what the test
    registered is gone, what it replaced is back): :meth:`iris.registry.PluginRegistry.restored`."""
    from iris.registry import backends

    with backends.restored():
        yield backends


def _pip_install(source: Path, target: Path) -> subprocess.Popen:
    """Start a real build + install of the distribution in ``source`` into ``target``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(source)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.fixture(scope="session")
def plugin_sites(tmp_path_factory) -> dict[str, Path]:
    """Install the echo plugin, and a twin distribution claiming the same backend name, each
    into its own folder with pip. Returns ``{"echo": folder, "twin": folder}``.

    The sources are copied first: setuptools builds in the source tree (build/, *.egg-info),
    which must not litter tests/fixtures. The twin is the same package under the distribution
    name ``iris-echo-twin``, plus an entry point ``echo-broken`` whose module does not exist.
    """
    root = tmp_path_factory.mktemp("plugins")
    echo_src = shutil.copytree(ECHO_PLUGIN, root / "src-echo")
    twin_src = shutil.copytree(ECHO_PLUGIN, root / "src-twin")
    pyproject = (twin_src / "pyproject.toml").read_text()
    name_line, entry_line = 'name = "iris-echo-plugin"\n', 'echo = "iris_echo:EchoBackend"\n'
    assert name_line in pyproject and entry_line in pyproject, "fixture pyproject.toml changed shape"
    pyproject = pyproject.replace(name_line, 'name = "iris-echo-twin"\n').replace(
        entry_line, entry_line + 'echo-broken = "iris_echo_missing:EchoBackend"\n'
    )
    (twin_src / "pyproject.toml").write_text(pyproject)

    sites = {"echo": root / "site-echo", "twin": root / "site-twin"}
    installs = {"echo": _pip_install(echo_src, sites["echo"]), "twin": _pip_install(twin_src, sites["twin"])}
    for name, proc in installs.items():  # both builds run at once: they are independent
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"pip install of the {name} fixture failed:\n{output}"
    return sites
