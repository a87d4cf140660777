"""iris.registry: backend discovery through real entry points, in-process registration, errors.

Nothing here mocks importlib.metadata. Third-party discovery is shown with the fixture
distribution in tests/fixtures/iris_echo_plugin, built and installed with pip into a temporary
``--target`` folder, and with a twin of it (another distribution claiming the same name): the
``plugin_sites`` fixture of tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import MappingProxyType

import attrs
import pytest
import torch

import iris
import iris.registry
from iris.errors import BackendNotFoundError, IrisError
from iris.registry import PluginRegistry, backends

pytestmark = pytest.mark.usefixtures("clean_iris_env")


def _triton_backend():
    from iris_triton import TritonBackend

    return TritonBackend


# -- subprocesses and real installs -------------------------------------------------------------


def run_python(code: str, *, cwd: Path, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict:
    """Run ``code`` in a fresh interpreter (no IRIS_* settings from this process) and return the
    JSON object it prints on its last line of stdout."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_") and k not in drop}
    child_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd, env=child_env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- discovery ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_interpreter(tmp_path_factory) -> dict:
    """What a fresh interpreter without TRITON_INTERPRET sees: the modules loaded by
    ``import iris`` plus ``available_backends()``, then ``create(device="cpu")``'s error.
    One child process serves several tests (each child that imports torch costs seconds)."""
    return run_python(
        """
        import json, sys
        import iris
        out = {"names": iris.available_backends()}
        out["imported"] = sorted(m for m in ("triton", "iris_triton", "iris_gluon") if m in sys.modules)
        try:
            iris.create(device="cpu", heap_size="4MiB")
        except iris.IrisError as exc:
            out["error_type"], out["error"] = type(exc).__name__, str(exc)
        print(json.dumps(out))
        """,
        cwd=tmp_path_factory.mktemp("bare"),
        drop=("TRITON_INTERPRET",),
    )


@pytest.mark.slow
def test_import_iris_reads_metadata_only(bare_interpreter):
    """`import iris` lists the installed backends without importing Triton or any backend."""
    assert "triton" in bare_interpreter["names"] and "gluon" in bare_interpreter["names"]
    assert bare_interpreter["imported"] == []


@pytest.mark.slow
def test_cpu_context_without_triton_interpret_is_a_clear_error(bare_interpreter):
    assert bare_interpreter.get("error_type") == "IrisError"
    assert "TRITON_INTERPRET=1" in bare_interpreter["error"]
    assert "iris.spawn" in bare_interpreter["error"]


@pytest.mark.slow
def test_triton_imported_before_triton_interpret_is_a_clear_error(tmp_path):
    # A launcher (iris.spawn asks the backend what its ranks need) has Triton imported in compiled
    # mode; setting the variable afterwards cannot change that, and a CPU context says so.
    result = run_python(
        """
        import json, os
        import iris
        from iris.tools.spawn import backend_environment
        environment = backend_environment("cpu")
        os.environ.update(environment)
        try:
            iris.create(device="cpu", heap_size="4MiB")
            out = {"environment": environment}
        except iris.IrisError as exc:
            out = {"environment": environment, "error": str(exc)}
        print(json.dumps(out))
        """,
        cwd=tmp_path,
        drop=("TRITON_INTERPRET",),
    )
    assert result["environment"] == {"TRITON_INTERPRET": "1"}
    assert "imported Triton before TRITON_INTERPRET=1 was set" in result.get("error", ""), result


def test_builtin_backends_come_from_their_distributions():
    entries = iris.registry.registry
    assert entries["triton"].distribution == "iris-triton"
    assert entries["triton"].target == "iris_triton:TritonBackend"
    assert entries["gluon"].distribution == "iris-gluon"
    assert entries["gluon"].target == "iris_gluon:GluonBackend"
    assert {"gluon", "triton"} <= set(iris.available_backends())
    assert iris.available_backends() == sorted(iris.available_backends())


_ECHO_RANK_SCRIPT = """
import json, os, sys
import torch
import iris, iris.registry

ctx = iris.create(backend="echo", device="cpu", heap_size="4MiB")
rank, world = ctx.rank, ctx.world_size
inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
summed, largest = inputs[rank].clone(), inputs[rank].clone()
ctx.ccl.all_reduce(summed)  # the automatic choice: the plugin's algorithm is the only one that applies
ctx.ccl.all_reduce(largest, "max", algorithm="echo_peer_views")
ctx.device_barrier()
try:
    ctx.ccl.all_reduce(torch.ones(4), algorithm="one_shot")
    refused = ""
except iris.IrisError as error:
    refused = str(error)
out = {
    "rank": rank, "world": world, "cls": type(ctx).__name__, "backend": ctx.backend,
    "names": iris.available_backends(), "algorithms": ctx.ccl.algorithms("all_reduce"),
    "distribution": iris.registry.registry["echo"].distribution, "module": sys.modules["iris_echo"].__file__,
    "mro": [c.__name__ for c in type(ctx).__mro__],
    "sum_ok": torch.allclose(summed, torch.stack(inputs).sum(0), atol=1e-5),
    "max_ok": torch.equal(largest, torch.stack(inputs).max(0).values),
    "refused": refused,
}
ctx.destroy()
os.write(1, (json.dumps(out) + "\\n").encode())
"""


@pytest.mark.slow
def test_a_minimal_third_party_backend_runs_collectives_on_two_ranks(plugin_sites, tmp_path):
    """The echo plugin (docs/plugins.md's minimal backend: its own DeviceOps, no Triton), installed
    for real, makes EchoContexts on 2 CPU ranks whose all_reduce (its own algorithm, chosen
    automatically) matches torch's on random data."""
    site = plugin_sites["echo"]
    script = tmp_path / "echo_ranks.py"
    script.write_text(_ECHO_RANK_SCRIPT)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_")}
    child_env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-m", "iris.tools.cli", "run", "--cpu", "-n", "2", str(script)],
                          cwd=tmp_path, env=child_env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"ranks failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    results = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout
    for result in results:
        assert result["world"] == 2 and result["cls"] == "EchoContext" and result["backend"] == "echo"
        assert "echo" in result["names"] and "triton" in result["names"]
        assert "TritonDeviceOps" not in result["mro"] and result["mro"][1:3] == ["EchoDeviceOps", "Context"]
        assert "echo_peer_views" in result["algorithms"]
        assert result["sum_ok"] is True and result["max_ok"] is True
        assert "algorithm 'one_shot' cannot run this call: it is implemented for gluon, triton kernels, and " \
               "this context's backend compiles no such kernels; choose one of ['echo_peer_views']" in result["refused"]
        assert result["distribution"] == "iris-echo-plugin"
        assert Path(result["module"]).is_relative_to(site)  # the installed copy, not the fixture source


@pytest.mark.slow
def test_autoload_opt_out_leaves_only_in_process_registrations(tmp_path):
    result = run_python(
        """
        import json
        import attrs, iris, iris.registry
        from iris_triton import TritonBackend  # importable; just not discovered
        out = {"before": iris.available_backends()}
        try:
            iris.create(backend="gluon", device="cpu")
        except iris.BackendNotFoundError as exc:
            out["gluon_error"] = str(exc)
        iris.register_backend("mine", attrs.evolve(TritonBackend, name="mine"))
        out["after"] = iris.available_backends()
        out["mine_available"] = iris.is_backend_available("mine")
        out["heap_providers"] = iris.registry.heap_providers.names()
        print(json.dumps(out))
        """,
        cwd=tmp_path,
        env={"IRIS_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert result["before"] == []
    assert "pip install iris-gluon" in result["gluon_error"]
    assert result["after"] == ["mine"]
    assert result["mine_available"] is True
    assert result["heap_providers"] == ["cuda-ipc", "cuda-vmm", "shm"]  # built-ins are in-process registrations


# -- errors -------------------------------------------------------------------------------------


def test_unknown_backend_lists_installed_ones():
    with pytest.raises(BackendNotFoundError) as excinfo:
        iris.create(backend="nope", device="cpu", heap_size="4MiB")
    message = str(excinfo.value)
    assert "'nope'" in message
    assert "'gluon'" in message and "'triton'" in message
    assert isinstance(excinfo.value, IrisError) and isinstance(excinfo.value, LookupError)


def test_known_but_missing_backend_names_its_distribution():
    registry = PluginRegistry("backend", None, error=BackendNotFoundError, known={"gluon": "iris-gluon"})
    with pytest.raises(BackendNotFoundError, match=r"'gluon'.*'iris-gluon'.*pip install iris-gluon"):
        registry.get("gluon")
    assert registry.is_available("gluon") is False


def test_broken_plugin_is_reported_with_cause_and_others_keep_working(global_backends):
    iris.register_backend("broken", "no_such_module:X")
    assert "broken" in iris.available_backends()
    for _ in range(2):  # a failed import is not cached as a success
        with pytest.raises(BackendNotFoundError) as excinfo:
            iris.create(backend="broken", device="cpu", heap_size="4MiB")
        message = str(excinfo.value)
        assert "'broken'" in message
        assert "in-process registration" in message  # the source
        assert "no_such_module:X" in message
        assert "ModuleNotFoundError" in message
        assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)
        assert excinfo.value.__cause__.name == "no_such_module"
    assert iris.is_backend_available("broken") is False
    assert iris.is_backend_available("triton") is True
    assert iris.registry.get_backend("triton") is _triton_backend()


def test_broken_plugin_from_a_distribution_names_the_distribution(plugin_sites, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_sites["twin"]))
    registry = PluginRegistry("backend", "iris.backends", error=BackendNotFoundError)
    with pytest.raises(BackendNotFoundError) as excinfo:
        registry.get("echo-broken")
    message = str(excinfo.value)
    assert "distribution 'iris-echo-twin'" in message
    assert "iris_echo_missing:EchoBackend" in message
    assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)
    assert registry.get("triton") is _triton_backend()


def test_two_distributions_claiming_one_name_is_an_error_naming_both(plugin_sites, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_sites["echo"]))
    monkeypatch.syspath_prepend(str(plugin_sites["twin"]))
    registry = PluginRegistry("backend", "iris.backends", error=BackendNotFoundError)
    assert "echo" in registry.names()
    entry = registry.entries["echo"]
    assert {entry.distribution, *entry.conflicting_distributions} == {"iris-echo-plugin", "iris-echo-twin"}

    with pytest.raises(BackendNotFoundError) as excinfo:
        registry.get("echo")
    message = str(excinfo.value)
    assert "'iris-echo-plugin'" in message and "'iris-echo-twin'" in message
    assert "clobber=True" in message
    assert registry.is_available("echo") is False
    assert registry.get("triton") is _triton_backend()  # other names are unaffected

    # The way out the message names: an explicit in-process choice, which needs clobber=True.
    chosen = attrs.evolve(_triton_backend(), name="echo")
    with pytest.raises(ValueError, match="already registered.*iris-echo-"):
        registry.register("echo", chosen)
    registry.register("echo", chosen, clobber=True)
    assert registry.get("echo") is chosen


def test_builtin_claimed_by_a_distribution_names_both_sources(plugin_sites, monkeypatch):
    """A built-in (in-process) plugin and an installed distribution claiming its name."""
    monkeypatch.syspath_prepend(str(plugin_sites["echo"]))
    builtin = attrs.evolve(_triton_backend(), name="echo")
    registry = PluginRegistry("backend", "iris.backends", error=BackendNotFoundError, builtins={"echo": builtin})
    with pytest.raises(BackendNotFoundError) as excinfo:
        registry.get("echo")
    message = str(excinfo.value)
    assert "in-process registration" in message and "distribution 'iris-echo-plugin'" in message
    assert "None" not in message


def test_builtin_also_declared_by_a_distribution_is_one_plugin():
    """A distribution declaring the very plugin that is built in is not a conflict."""
    registry = PluginRegistry(
        "backend", "iris.backends", error=BackendNotFoundError, builtins={"triton": "iris_triton:TritonBackend"}
    )
    assert registry.entries["triton"].conflicting_distributions == ()
    assert registry.get("triton") is _triton_backend()


def test_one_distribution_seen_twice_is_not_a_conflict(plugin_sites, monkeypatch, tmp_path):
    """The same distribution on two sys.path entries (as with some editable installs) is one."""
    copy = shutil.copytree(plugin_sites["echo"], tmp_path / "site-copy")
    monkeypatch.syspath_prepend(str(plugin_sites["echo"]))
    monkeypatch.syspath_prepend(str(copy))
    registry = PluginRegistry("backend", "iris.backends", error=BackendNotFoundError)
    entry = registry.entries["echo"]
    assert entry.distribution == "iris-echo-plugin"
    assert entry.conflicting_distributions == ()


def test_non_backend_registration_is_rejected_by_create(global_backends):
    iris.register_backend("not-a-backend", object())
    with pytest.raises(BackendNotFoundError, match="not an iris.Backend"):
        iris.create(backend="not-a-backend", device="cpu", heap_size="4MiB")


# -- in-process registration --------------------------------------------------------------------


def test_registering_the_same_object_twice_is_a_noop():
    registry = PluginRegistry("backend", None, error=BackendNotFoundError)
    plugin = attrs.evolve(_triton_backend(), name="x")
    registry.register("x", plugin)
    registry.register("x", plugin)
    assert registry.names() == ["x"]
    assert registry.get("x") is plugin

    registry.register("lazy", "iris_triton:TritonBackend")
    registry.register("lazy", "iris_triton:TritonBackend")  # the same import path
    loaded = registry.get("lazy")
    assert loaded is _triton_backend()
    registry.register("lazy", loaded)  # the object that path loaded
    assert registry.get("lazy") is loaded
    assert registry.entries["lazy"].target == "iris_triton:TritonBackend"


def test_an_import_path_and_the_object_it_names_are_one_plugin_before_loading():
    """Whether re-registering is a no-op must not depend on whether the plugin was loaded yet."""
    registry = PluginRegistry("backend", None, error=BackendNotFoundError)
    registry.register("lazy", "iris_triton:TritonBackend")
    registry.register("lazy", _triton_backend())  # not loaded yet: still the same plugin
    assert registry.entries["lazy"].target == "iris_triton:TritonBackend"
    registry.register("eager", _triton_backend())
    registry.register("eager", "iris_triton:TritonBackend")
    assert registry.entries["eager"].target is _triton_backend()
    with pytest.raises(ValueError, match="already registered"):
        registry.register("lazy", None)  # not the same plugin just because nothing is loaded
    with pytest.raises(ValueError, match="already registered"):
        registry.register("eager", "iris_triton:TritonDeviceOps")


def test_reregistering_an_installed_backend_identically_is_a_noop(global_backends):
    iris.register_backend("triton", "iris_triton:TritonBackend")
    iris.register_backend("triton", _triton_backend())
    assert iris.registry.registry["triton"].distribution == "iris-triton"
    assert iris.registry.get_backend("triton") is _triton_backend()


def test_conflicting_registration_errors_unless_clobber(global_backends):
    first = attrs.evolve(_triton_backend(), name="echo-inproc")
    second = attrs.evolve(_triton_backend(), name="echo-inproc", unsupported_device_hint="other")
    iris.register_backend("echo-inproc", first)
    iris.register_backend("echo-inproc", first)  # the same object again: a no-op
    with pytest.raises(ValueError) as excinfo:
        iris.register_backend("echo-inproc", second)
    assert "'echo-inproc'" in str(excinfo.value) and "clobber=True" in str(excinfo.value)
    assert iris.registry.get_backend("echo-inproc") is first

    iris.register_backend("echo-inproc", second, clobber=True)
    assert iris.registry.get_backend("echo-inproc") is second

    # an installed backend is protected the same way, and the message names its distribution
    with pytest.raises(ValueError, match=r"'triton'.*distribution 'iris-triton'.*clobber=True"):
        iris.register_backend("triton", first)
    assert iris.registry.get_backend("triton") is _triton_backend()


def test_clobber_replaces_a_loaded_plugin():
    registry = PluginRegistry("backend", None, error=BackendNotFoundError)
    registry.register("t", "iris_triton:TritonBackend")
    assert registry.get("t") is _triton_backend()
    replacement = attrs.evolve(_triton_backend(), name="t")
    registry.register("t", replacement, clobber=True)
    assert registry.get("t") is replacement  # the cached load is dropped


@pytest.mark.parametrize("name", ["", None, 3])
def test_register_rejects_bad_names(name):
    registry = PluginRegistry("backend", None, error=BackendNotFoundError)
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register(name, object())


def test_registry_view_is_read_only_and_live(global_backends):
    view = iris.registry.registry
    assert isinstance(view, MappingProxyType)
    with pytest.raises(TypeError):
        view["mine"] = "pkg:Obj"  # type: ignore[index]
    with pytest.raises(TypeError):
        del view["triton"]  # type: ignore[attr-defined]
    assert "echo-inproc" not in view
    iris.register_backend("echo-inproc", "iris_triton:TritonBackend")
    assert view["echo-inproc"].target == "iris_triton:TritonBackend"
    assert view["echo-inproc"].distribution is None
    assert isinstance(backends.known, MappingProxyType)


# -- snapshot and restore -----------------------------------------------------------------------


def test_restore_removes_later_registrations_and_brings_back_what_was_there():
    original = attrs.evolve(_triton_backend(), name="kept")
    registry = PluginRegistry("backend", None, error=BackendNotFoundError, builtins={"kept": original})
    registry.register("lazy", "iris_triton:TritonBackend")
    assert registry.get("kept") is original
    view = registry.entries
    snapshot = registry.snapshot()
    assert snapshot.registry is registry
    assert set(snapshot.entries) == {"kept", "lazy"} and set(snapshot.loaded) == {"kept"}

    registry.register("added", object())
    replacement = attrs.evolve(_triton_backend(), name="kept", unsupported_device_hint="other")
    registry.register("kept", replacement, clobber=True)
    assert registry.get("kept") is replacement and registry.get("lazy") is _triton_backend()
    assert snapshot.entries["kept"].target is original  # the snapshot does not follow the registry
    assert "added" not in snapshot.entries and set(snapshot.loaded) == {"kept"}

    registry.restore(snapshot)
    assert registry.names() == ["kept", "lazy"]
    assert registry.get("kept") is original  # the replaced plugin is back, loaded as before
    with pytest.raises(BackendNotFoundError, match="unknown backend 'added'"):
        registry.get("added")
    assert registry.entries is view and "added" not in view  # the live view shows the restored table
    assert registry.snapshot() == snapshot
    assert registry.get("lazy") is _triton_backend()  # loaded after the snapshot: loads again


def test_a_snapshot_is_read_only_and_restores_only_its_registry():
    registry, other = PluginRegistry("backend", None), PluginRegistry("heap provider", None)
    registry.register("a", "pkg:A")
    snapshot = registry.snapshot()
    with pytest.raises(TypeError):
        snapshot.entries["b"] = snapshot.entries["a"]  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snapshot.entries = {}  # type: ignore[misc]
    with pytest.raises(ValueError, match="another registry .*'backend'.*'heap provider'"):
        other.restore(snapshot)
    with pytest.raises(TypeError, match="RegistrySnapshot"):
        registry.restore({"a": "pkg:A"})  # type: ignore[arg-type]
    assert other.names() == [] and registry.names() == ["a"]


def test_restored_puts_the_registry_back_even_when_the_block_raises():
    registry = PluginRegistry("backend", None, error=BackendNotFoundError)
    registry.register("before", "pkg:Before")
    with pytest.raises(RuntimeError, match="inside"), registry.restored() as same:
        assert same is registry
        registry.register("during", "pkg:During")
        registry.register("before", "pkg:Other", clobber=True)
        raise RuntimeError("inside")
    assert registry.names() == ["before"]
    assert registry.entries["before"].target == "pkg:Before"


def test_the_global_backends_restored_after_a_registration():
    names = iris.available_backends()
    with backends.restored():
        iris.register_backend("echo-inproc", "iris_triton:TritonBackend")
        assert iris.registry.get_backend("echo-inproc") is _triton_backend()
    assert iris.available_backends() == names and "echo-inproc" not in iris.registry.registry


@pytest.mark.parametrize("name", ["nope", "", None])
def test_is_backend_available_returns_false_instead_of_raising(name):
    assert iris.is_backend_available(name) is False


def test_is_backend_available_true_for_installed_backend():
    assert iris.is_backend_available("triton") is True


# -- docs/plugins.md's algorithm, run as the docs show it ----------------------------------------------------


DOCS = Path(__file__).parent.parent / "docs"


def _plugins_doc_algorithm() -> str:
    """The Python block of docs/plugins.md that defines ``PEER_VIEWS_ALL_REDUCE``."""
    text = (DOCS / "plugins.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    found = [block for block in blocks if "PEER_VIEWS_ALL_REDUCE = Algorithm(" in block]
    assert len(found) == 1, "docs/plugins.md no longer has one block defining PEER_VIEWS_ALL_REDUCE"
    return found[0]


#: The reductions the docs' algorithm declares, each with torch's reduction over the ranks
#: (dimension 0), and the calls of each (the second reuses the workspace).
DOC_REDUCTIONS = {"sum": lambda s: s.sum(0), "prod": lambda s: s.prod(0), "max": lambda s: s.amax(0),
                  "min": lambda s: s.amin(0)}
DOC_REPEATS = 2


def _plugins_doc_worker(rank: int, source: str) -> bytes:
    """Registers the docs' algorithm on this rank (every rank alike, before create() compares
    them), then runs it by name for every reduction it declares, twice each (the workspace is
    reused), on random data, against torch's reduction of every rank's data."""
    from iris.collectives import register_algorithm
    from iris.testing import RankReport, seeded_generator

    namespace: dict = {}
    exec(compile(source, "docs/plugins.md", "exec"), namespace)  # the docs' own example
    register_algorithm(namespace["PEER_VIEWS_ALL_REDUCE"])
    report = RankReport(rank)
    ctx = iris.create(heap_size="8MiB")
    with report.section("docs_algorithm"):
        world = ctx.world_size
        report.check("docs_algorithm/listed", "peer_views" in ctx.ccl.algorithms("all_reduce"))
        for op, reference in DOC_REDUCTIONS.items():
            for repeat in range(DOC_REPEATS):
                parts = [torch.randn(37, 3, generator=seeded_generator("docs", op, repeat, q)) for q in range(world)]
                tensor = parts[rank].clone() if repeat == 0 else ctx.zeros(37, 3).copy_(parts[rank])
                result = ctx.ccl.all_reduce(tensor, op, algorithm="peer_views")
                report.check(f"docs_algorithm/{op}/{repeat}", result is tensor and torch.allclose(
                    tensor, reference(torch.stack(parts)), rtol=1e-5, atol=1e-5))
        try:
            ctx.ccl.all_reduce(torch.ones(4), "avg", algorithm="peer_views")
            report.check("docs_algorithm/avg_refused", False)
        except IrisError as error:
            report.check("docs_algorithm/avg_refused", "peer_views" in str(error) and "avg" in str(error))
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def test_the_algorithm_of_docs_plugins_runs_on_two_ranks():
    """docs/plugins.md's algorithm, executed from the docs' text on 2 CPU ranks: what it reduces
    matches torch (so the example cannot go stale), in place in the caller's tensor."""
    from iris.testing import assert_rank_checks, interpreted_device, spawn_reports

    reports = spawn_reports(_plugins_doc_worker, 2, _plugins_doc_algorithm(), device=interpreted_device(),
                            timeout=120)
    assert_rank_checks(reports, "docs_algorithm/", {f"docs_algorithm/{op}/{repeat}" for op in DOC_REDUCTIONS
                                                    for repeat in range(DOC_REPEATS)} | {
        "docs_algorithm/listed", "docs_algorithm/avg_refused", "docs_algorithm/completed"})
