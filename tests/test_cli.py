"""The ``iris`` command, as a user runs it: a subprocess of the installed console script, or for
the help and error messages of many commands the script's ``main`` in this process."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from iris.testing import interpreted_device
from trace_checks import check_chrome_trace

HAS_GPUS = torch.cuda.device_count() >= 2


def iris(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the console script installed beside this Python (else the one on PATH), in this
    process's environment or ``env``."""
    beside = Path(sys.executable).parent / "iris"
    executable = str(beside) if beside.is_file() else shutil.which("iris")
    assert executable, "the iris console script is not installed (pip install -e .)"
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def iris_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``iris ARGS`` as the console script runs it (its ``main``), in this process: ``(exit status,
    stdout, stderr)``: the messages of many commands without the seconds each start of the script
    costs (it imports torch). The tests that run the script itself check its start and exit."""
    from iris.tools.cli import main

    try:
        status = main(list(args))
    except SystemExit as leaving:  # argparse's --help and its own usage errors
        status = leaving.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_console_script_has_help():
    proc = iris("--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: iris" in proc.stdout


@pytest.mark.parametrize("command", [["info"], ["demo"], ["bench"], ["run"], ["tune"]])
def test_every_command_has_help(command, capsys):
    status, out, err = iris_in_process(capsys, *command, "--help")
    assert status == 0, err
    assert "usage: iris" in out


def test_version_names_the_three_distributions():
    from importlib.metadata import version

    proc = iris("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"iris {version('iris')} (iris-triton {version('iris-triton')}, "
                           f"iris-gluon {version('iris-gluon')})\n"), proc.stdout


def test_info_names_backends_with_their_distributions_and_the_devices():
    proc = iris("info")
    assert proc.returncode == 0, proc.stderr
    assert "triton     iris_triton:TritonBackend        from iris-triton" in proc.stdout
    assert "heap providers: " in proc.stdout and "shm" in proc.stdout
    assert ("peer access" in proc.stdout) if torch.cuda.is_available() else ("no GPU visible" in proc.stdout)


def _info_with(*sites: Path) -> dict[str, str]:
    """``iris info``'s algorithm lines, by collective, with the plugin distributions installed in
    ``sites`` importable (first on the path) and plugin autoloading on."""
    env = {k: v for k, v in os.environ.items() if k != "IRIS_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), env.get("PYTHONPATH", "")])
    proc = iris("info", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("collective algorithms (where each comes from):\n", 1)[1].splitlines()
    return dict(line.strip().split(": ", 1) for line in lines if line.startswith("  ") and ": " in line)


def test_info_lists_every_collectives_algorithms_and_where_each_comes_from(plugin_sites):
    from importlib.metadata import version

    from iris.collectives import COLLECTIVES

    triton = f"built-in, iris-triton {version('iris-triton')}"
    bare = _info_with()
    assert set(COLLECTIVES) <= set(bare), bare
    assert bare["all_reduce"] == f"low_latency, one_shot, sentinel, two_shot ({triton})"
    assert all(bare[c] == f"direct ({triton})" for c in COLLECTIVES if c != "all_reduce"), bare
    # The echo plugin's distribution declares an all_reduce algorithm: listed after the built-in ones.
    with_echo = _info_with(plugin_sites["echo"])
    assert with_echo["all_reduce"] == (f"low_latency, one_shot, sentinel, two_shot ({triton}); "
                                       f"echo_peer_views (plugin, iris-echo-plugin 0.1.0)")
    assert {c: v for c, v in with_echo.items() if c != "all_reduce"} == {
        c: v for c, v in bare.items() if c != "all_reduce"}
    # Two distributions declaring one name: listed, and said to be unusable.
    both = _info_with(plugin_sites["echo"], plugin_sites["twin"])
    assert ("; echo_peer_views (claimed by distribution 'iris-echo-plugin', distribution 'iris-echo-twin': "
            "unusable until all but one are uninstalled)") in both["all_reduce"], both["all_reduce"]


def test_info_lists_an_algorithm_registered_in_process():
    from iris.tools.cli import algorithm_lines
    from iris.collectives import Algorithm, algorithm_registry, register_algorithm

    with algorithm_registry("broadcast").restored():
        register_algorithm(Algorithm(name="mine", collective="broadcast", run=lambda call: None, languages=()))
        lines = algorithm_lines()
    assert any(line.startswith("  broadcast: direct (built-in, iris-triton ") and
               line.endswith("); mine (registered in process)") for line in lines), lines
    assert "mine" not in "\n".join(algorithm_lines())  # the registry is back as it was


def test_demo_checks_every_step_against_torch_and_traces_it(tmp_path):
    if not torch.cuda.is_available():
        interpreted_device()  # the demo's CPU ranks: skips where the interpreter cannot run them
    trace = tmp_path / "demo.json"
    proc = iris("demo", "--trace", str(trace), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    events = json.loads(trace.read_text())
    assert check_chrome_trace(events, torch.cuda.device_count() or 2) == []  # the demo's ranks
    names = {e["name"] for e in events["traceEvents"]}
    assert {"iris.ccl.all_reduce", "iris.device_barrier", "all_reduce", "all_gather", "broadcast"} <= names, names
    for step in ("remote store into the next rank", "device-side barrier", "all_reduce (sum, low_latency)",
                 "all_reduce (sum, sentinel)", "all_reduce (sum, one_shot)", "all_reduce (sum, two_shot)",
                 "all_reduce (max, automatic choice)", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert any(line.startswith(step) and " ok " in line for line in proc.stdout.splitlines()), proc.stdout


LISTENING = textwrap.dedent('''
    def listening(pid):
        """Local addresses (hex, as /proc writes them) of the TCP sockets ``pid`` listens on."""
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # the descriptor that listed them, closed since
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as lines:
                found += [f[1].split(":")[0] for f in (line.split() for line in list(lines)[1:])
                          if f[3] == "0A" and f[9] in inodes]
        return found
''')


def test_run_starts_ranks_of_a_script_listening_on_loopback_only(tmp_path):
    interpreted_device()  # --cpu ranks: skips where the interpreter cannot run their all_reduce
    script = tmp_path / "ranks.py"
    script.write_text("import os\n" + LISTENING + textwrap.dedent('''
        import iris, torch
        ctx = iris.create(heap_size="8MiB")
        x = ctx.ones(5) * (ctx.rank + 1)
        ctx.ccl.all_reduce(x)
        line = (f"rank {ctx.rank} of {ctx.world_size}: {x.sum().item():g}; listening {listening(os.getpid())} "
                f"launcher {listening(os.getppid())}\\n")
        os.write(1, line.encode())  # one write: print's text and newline can interleave with another rank's
        ctx.barrier()
        ctx.destroy()
    '''))
    proc = iris("run", "-n", "3", "--cpu", str(script), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for rank in range(3):
        lines = [line for line in proc.stdout.splitlines() if line.startswith(f"rank {rank} of 3: 30;")]  # 5 x 6
        assert len(lines) == 1, proc.stdout
        line = lines[0]
        ranks, launcher = (ast.literal_eval(part) for part in re.findall(r"\[[^]]*\]", line))
        # 127.0.0.1 as /proc writes it: the ranks' gloo sockets and the launcher's store, nothing else.
        assert ranks and set(ranks) <= {"0100007F"}, line
        assert launcher == ["0100007F"], line


def test_run_stops_the_other_ranks_when_one_fails_and_exits_with_its_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent('''
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopped all the same
        print(f"pid {os.getpid()}", flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(1)
            os._exit(3)
        time.sleep(600)
    '''))
    started = time.monotonic()
    proc = iris("run", "-n", "2", "--cpu", str(script), timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.endswith("iris: rank 1 of 2 exited with status 3; the other ranks were stopped\n"), proc.stderr
    assert time.monotonic() - started < 120
    for pid in re.findall(r"pid (\d+)", proc.stdout):  # the rank that slept is gone (or a zombie)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid


def test_run_across_machines_goes_through_torchrun_at_the_endpoint():
    from iris.tools.cli import _parser, torchrun_command

    args = _parser().parse_args(["run", "-n", "2", "--nnodes", "3", "--rdzv-endpoint", "10.0.0.1:29400", "train.py",
                                 "--lr", "0.1"])
    assert torchrun_command(args) == [sys.executable, "-m", "torch.distributed.run", "--nnodes=3",
                                      "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
                                      "train.py", "--lr", "0.1"]
    help_text = " ".join(iris("run", "--help").stdout.split())  # argparse wraps lines
    assert "loopback interface only" in help_text and "no authentication" in help_text, help_text


@pytest.mark.parametrize("args, message", [
    (["run", "-n", "2", "no_such_script.py"], "iris: error: no such script: no_such_script.py"),
    (["run", "-n", "0", __file__], "iris: error: -n must be at least 1, got 0"),
    (["run", "-n", "2", "--nnodes", "2", __file__], "iris: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["demo", "--nprocs", "0"], "iris: error: --nprocs must be at least 1, got 0"),
    (["bench", "--only", "nope"], "iris: error: unknown benchmark(s) nope; choose from"),
    (["tune", "--device", "cpu", "--nprocs", "0"], "iris: error: --nprocs must be at least 1, got 0"),
    (["tune", "--device", "cpu", "--collectives", "send"], "iris: error: cannot tune send; tunable collectives:"),
    (["tune", "--device", "cpu", "--dtypes", "float64"], "iris: error: unknown dtype 'float64'"),
])
def test_user_mistakes_are_one_line_errors(args, message, capsys):
    status, _, err = iris_in_process(capsys, *args)  # a traceback would be an exception raised here
    assert status == 2
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.skipif(HAS_GPUS, reason="the benchmarks run where 2 GPUs are visible")
def test_bench_without_gpus_says_what_it_needs():
    proc = iris("bench", "--quick")
    assert proc.returncode == 2
    assert proc.stderr == "iris: error: the benchmarks measure 2 GPUs against each other; " \
                          f"{torch.cuda.device_count()} visible (--cpu runs them on CPU ranks: a check of the " \
                          "benchmarks, not of speed)\n"


def test_bench_without_matplotlib_names_the_bench_extra(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else find_spec(name, *args))
    status, _, err = iris_in_process(capsys, "bench", "--cpu")
    assert status == 2
    assert err == "iris: error: iris bench draws its plots with matplotlib, which is not installed: pip install " \
                  "'iris[bench]'\n"


def test_bench_outside_a_source_checkout_says_where_the_benchmarks_are(tmp_path, monkeypatch, capsys):
    import iris.tools.cli

    monkeypatch.chdir(tmp_path)  # no benchmarks/ here, nor beside an installed (not editable) iris
    monkeypatch.setattr(iris.tools.cli, "__file__", str(tmp_path / "site-packages" / "iris" / "cli.py"))
    status, _, error = iris_in_process(capsys, "bench", "--cpu")
    assert status == 2
    assert error.startswith("iris: error: iris bench runs the benchmarks/ folder of an iris source checkout, which "
                            "is not installed with the package: run it from the root of a clone"), error
    assert "pip install -e '.[bench]'" in error and error.count("\n") == 1, error


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def undated(path: Path) -> str:
    """A benchmark's file name without its date: ``ccl-triton-cpu-all_reduce.png``."""
    return re.sub(r"-\d{4}-\d{2}-\d{2}", "", path.name)


def test_bench_on_cpu_ranks_writes_checked_results_and_plots(tmp_path):
    interpreted_device()  # skips where this Triton's interpreter cannot run iris's kernels
    pytest.importorskip("matplotlib", reason="the plots need matplotlib: pip install 'iris[bench]'")
    started = time.monotonic()
    proc = iris("bench", "--cpu", "--out", str(tmp_path), timeout=600)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "iris bench --cpu: ok" in proc.stdout, proc.stdout
    records = {undated(path): json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert set(records) == {"ccl-triton-cpu.json", "rma_bandwidth-triton-cpu.json", "fused-cpu.json",
                            "torch_collectives-cpu.json", "hierarchical-cpu.json",
                            "compiled_tp-cpu.json"}, sorted(records)
    for record in records.values():
        assert record["environment"]["device"] == "cpu" and "interpreter" in record["environment"]["note"]

    ccl = records["ccl-triton-cpu.json"]
    assert ccl["reference"] == "gloo" and ccl["unit"] == "us per call"
    assert {(row["collective"], row["bytes"]) for row in ccl["rows"]} == {
        (collective, size) for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        for size in (128, 1024)}
    for row in ccl["rows"]:
        assert set(row) == {"collective", "bytes", "correct", "eager"}, row  # no CUDA graphs on CPU ranks
        iris_names = {"iris_low_latency", "iris_sentinel", "iris_one_shot", "iris_two_shot"} \
            if row["collective"] == "all_reduce" else {"iris"}
        assert set(row["eager"]) == set(row["correct"]) == iris_names | {"gloo"}, row
        assert all(row["correct"].values()), row  # every implementation matched gloo's result
        assert all(_positive(us) for us in row["eager"].values()), row

    rma = records["rma_bandwidth-triton-cpu.json"]
    assert [row["bytes"] for row in rma["rows"]] == [16 << 10, 64 << 10]
    for row in rma["rows"]:
        assert row["correct"] is True, row  # the store and load round trip matched torch
        for mode in ("load", "store", "get", "put", "atomic_add", "torch_peer_copy"):
            assert _positive(row[mode]["median_ms"]) and _positive(row[mode]["GBps"]), (mode, row)

    fused = records["fused-cpu.json"]
    assert fused["baseline"] == "torch+gloo" and {row["operation"] for row in fused["rows"]} == {
        "all_gather_matmul", "matmul_reduce_scatter"}
    for row in fused["rows"]:
        assert set(row["ms"]) == {"torch+gloo", "iris_copy_engine", "iris_fused", "iris_sequential", "iris_auto"}
        assert all(row["correct"].values()) and set(row["correct"]) == set(row["ms"]), row
        assert all(_positive(ms) for ms in row["ms"].values()), row
        assert all(_positive(x) for x in row["speedup"].values()), row

    for name in ("torch_collectives-cpu.json", "hierarchical-cpu.json", "compiled_tp-cpu.json"):
        rows = records[name]["rows"]
        assert rows and all(all(row["correct"].values()) for row in rows), (name, rows)  # each matched gloo's
        assert all(_positive(us) for row in rows for us in row["eager"].values()), (name, rows)

    plots = sorted(undated(path) for path in tmp_path.glob("*.png"))
    assert plots == [*(f"ccl-triton-cpu-{c}.png" for c in ("all_gather", "all_reduce", "all_to_all", "reduce_scatter")),
                     "fused-cpu.png", "rma_bandwidth-triton-cpu.png"], plots
    for path in tmp_path.glob("*.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, path
    print(f"iris bench --cpu: {seconds:.1f} s")
