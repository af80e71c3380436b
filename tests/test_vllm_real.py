"""The plugin against each released vLLM it supports (0.33.0, 0.34.0) on the CPU
(``VLLM_TARGET_DEVICE=cpu``), with ple-memops installed as a wheel and no other step:
``scripts/test.sh`` builds each release's environment and runs this file there. Skipped, with the
reason, where vLLM is not installed.

What runs here: vLLM's files against the hashes of its released RECORD; the entry point
discovered by vLLM's own plugin loader, which installs nothing with the switch off and
everything with it on; a vLLM whose names differ refused with one message; the custom
ops under ``torch.compile``; our Qwen4Exp ids against vLLM's own ``compute_ngram_ids``;
the whole Qwen4Exp model loaded by vLLM's default loader from a checkpoint transformers
wrote (tables neither read nor allocated) with PLE rows byte-identical to the device
table's, for BF16 and FP8; the per-engine switch and the refusals; and two
tensor-parallel ranks (gloo) reading full rows without the all-reduce, agreeing on the
fallback. The Triton kernels and Model Runner V2 need a GPU: ``test_vllm_engine_gpu.py``
runs the real engine there.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    # Skipped before the environment below is touched: collected beside the GPU tests on a
    # GPU host, this file must not hide the device from them.
    pytest.skip(
        "vLLM is not installed here (scripts/test.sh runs this file in each supported "
        "release's environment)",
        allow_module_level=True,
    )
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# No CUDA device to see: vLLM 0.34.0's CPU platform then accepts Triton without an active
# driver (else it refuses x86 CPUs without triton-cpu); 0.33.0 does not ask.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
vllm = pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here (scripts/test.sh runs this file in each supported "
    "release's environment)",
)

import torch  # noqa: E402
import vllm_checkpoints as ckpts  # noqa: E402
import vllm_cpu  # noqa: E402
from qwen4exp_ngram import NGramHasher, NGramLayout  # noqa: E402
from vllm.config import (  # noqa: E402
    LoadConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.engram import EngramConfig  # noqa: E402

import ple_memops as pm  # noqa: E402
from ple_memops.vllm import _compat, ops, plugin, qwen4exp, runner  # noqa: E402
from ple_memops.vllm.hooks import build_hooks  # noqa: E402
from ple_memops.vllm.settings import Settings, engine_settings  # noqa: E402

dist = vllm_cpu.dist  # the fixtures
installed = vllm_cpu.installed
_load = vllm_cpu.load_model
free_port = vllm_cpu.free_port

HERE = Path(__file__).parent
VERSION = vllm.__version__


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpts.write_checkpoint(tmp_path_factory.mktemp("ckpt"), fp8=request.param == "fp8")


MMAP = {"ple_memops": {"table_backend": "mmap"}}


def _config(
    ckpt: Path, engram: EngramConfig | None = None, *, mmap: bool = False, **kw: Any
) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16"),
        engram_config=engram,
        load_config=LoadConfig(load_format="safetensors"),
        **({"additional_config": MMAP if mmap else {}} | kw),
    )


# -- the plugin, as vLLM loads it -----------------------------------------------------------


def _sha(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_vllms_files_are_as_released() -> None:
    from importlib.metadata import distribution

    dist = distribution("vllm")
    assert dist.version in _compat.TESTED_VERSIONS
    root = Path(str(dist.locate_file("")))
    with open(root / f"vllm-{dist.version}.dist-info" / "RECORD", newline="") as f:
        record = {row[0]: row[1] for row in csv.reader(f) if row[1]}
    sources = [rel for rel in record if rel.startswith("vllm/") and rel.endswith(".py")]
    assert len(sources) > 1000
    changed = [rel for rel in sources if _sha(root / rel) != record[rel]]
    assert not changed, f"vLLM's released files were changed: {changed[:10]}"


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    full.pop("PLE_MEMOPS_TABLE_BACKEND", None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
        cwd="/",
    )


_PROBE = """
    import json, sys
    from vllm.plugins import load_general_plugins
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models import config as mc
    before = {a: repr(ModelRegistry.models[a]) for a in ("Qwen4ExpForCausalLM",
              "Qwen4ExpForConditionalGeneration")}
    hooks_before = {a: mc.MODELS_CONFIG_MAP[a].__qualname__ for a in before}
    load_general_plugins()
    from vllm.v1.worker.gpu import model_runner as mr
    from vllm.v1.worker import cpu_worker
    print(json.dumps({
        "runner": mr.GPUModelRunner.__module__ + "." + mr.GPUModelRunner.__qualname__,
        "cpu_runner_mro": [c.__module__ for c in cpu_worker.CPUModelRunner.__mro__],
        "models_changed": [a for a in before if repr(ModelRegistry.models[a]) != before[a]],
        "hooks": {a: mc.MODELS_CONFIG_MAP[a].__qualname__ for a in before},
        "hooks_before": hooks_before,
        "ours": sorted(m for m in sys.modules if m.startswith("ple_memops")),
    }))
"""

_LOG_PROBE = """
    import logging
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    configure_logging(LoggingConfig())  # what an engine (or `vllm serve`) does
    logging.getLogger("ple_memops").info("ple-memops: an info line")
    logging.getLogger("ple_memops").debug("ple-memops: a debug line")
"""


def test_the_entry_point_is_discovered() -> None:
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "ple_memops"]
    assert ep.value == "ple_memops.vllm.plugin:register"
    assert ep.load() is plugin.register


def test_switch_off_the_plugin_changes_nothing() -> None:
    done = _run_python(_PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["runner"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    assert seen["models_changed"] == [] and seen["hooks"] == seen["hooks_before"]
    # vLLM imported the entry point's module; nothing of ours that needs torch came along.
    assert "ple_memops.vllm.plugin" in seen["ours"]
    for heavy in ("ple_memops.vllm.ops", "ple_memops.vllm.qwen4exp", "ple_memops.vllm.runner"):
        assert heavy not in seen["ours"]


def test_switch_on_vllms_loader_installs_everything() -> None:
    done = _run_python(_PROBE, PLE_MEMOPS_TABLE_BACKEND="mmap")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # No class of vLLM's is rebound: the runner comes with the plugin's worker, named per
    # engine (ParallelConfig.worker_cls); a CPU engine's runner is vLLM's own.
    assert seen["runner"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    assert not any(m.startswith("ple_memops") for m in seen["cpu_runner_mro"])
    assert sorted(seen["models_changed"]) == [
        "Qwen4ExpForCausalLM",
        "Qwen4ExpForConditionalGeneration",
    ]
    assert all(h.startswith("PleMemops") for h in seen["hooks"].values())


def test_our_log_lines_are_vllms_log_lines() -> None:
    """Switched on, the plugin's records go through vLLM's handler, in its format and at
    its level (they reached only Python's last-resort handler before: info lines lost)."""
    done = _run_python(_LOG_PROBE, PLE_MEMOPS_TABLE_BACKEND="mmap")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    line = next(ln for ln in out.splitlines() if "an info line" in ln)
    assert re.search(r"INFO \d\d-\d\d [\d:]+ \[<string>:\d+\] ple-memops: an info line", line), line
    assert "a debug line" not in out
    done = _run_python(_LOG_PROBE, PLE_MEMOPS_TABLE_BACKEND="mmap", VLLM_LOGGING_LEVEL="DEBUG")
    assert "ple-memops: a debug line" in done.stdout + done.stderr


def test_a_bad_switch_value_stops_the_engine_with_its_name() -> None:
    done = _run_python(_PROBE, PLE_MEMOPS_TABLE_BACKEND="uva")
    assert done.returncode != 0
    assert "PLE_MEMOPS_TABLE_BACKEND must be 'mmap' or 'default', got 'uva'" in done.stderr


def test_an_incompatible_vllm_is_refused_with_nothing_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu import model_runner as mr

    monkeypatch.delenv(_compat.UNTESTED_ENV, raising=False)
    assert VERSION in _compat.TESTED_VERSIONS
    original = mr.GPUModelRunner
    # A "renamed" method and a changed signature.
    monkeypatch.delattr(mr.GPUModelRunner, "capture_model")
    monkeypatch.setattr(
        cudagraph_utils.CudaGraphManager, "run_fullgraph", lambda self, desc, extra: None
    )
    with pytest.raises(pm.UnsupportedError) as info:
        plugin.install()
    text = str(info.value)
    assert f"installed vLLM {VERSION}; nothing was installed" in text
    assert "GPUModelRunner.capture_model" in text and "missing" in text
    assert "CudaGraphManager.run_fullgraph" in text and "(self, desc, extra)" in text
    assert mr.GPUModelRunner is original and plugin.installed() is None


DESC = "Capturing CUDA graphs"


def test_each_release_is_held_to_its_own_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fact that differs between releases is checked in the running release's form: the
    other release's form of a signature is refused, naming what this one expects."""
    from vllm.v1.worker.gpu import cudagraph_utils

    monkeypatch.delenv(_compat.UNTESTED_ENV, raising=False)
    assert _compat.check() == (VERSION, [])
    other = next(v for v in _compat.TESTED_VERSIONS if v != VERSION)

    def capture_033(self: Any, create_forward_fn: Any, progress_bar_desc: str = DESC) -> None:
        pass

    def capture_034(
        self: Any, create_forward_fn: Any, progress_bar_desc: str = DESC, stream: Any = None
    ) -> None:
        pass

    forms = {"0.33.0": capture_033, "0.34.0": capture_034}
    monkeypatch.setattr(cudagraph_utils.CudaGraphManager, "capture", forms[other])
    version, problems = _compat.check()
    assert version == VERSION and len(problems) == 1, problems
    assert "CudaGraphManager.capture" in problems[0] and "expected" in problems[0]
    # The same form passes as the release it belongs to.
    monkeypatch.setattr(vllm, "__version__", other)
    version, problems = _compat.check()
    assert version == other and not any("CudaGraphManager.capture" in p for p in problems)


def test_an_untested_release_starts_only_when_told_and_every_fact_holds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.worker.gpu import model_runner as mr

    monkeypatch.delenv(_compat.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    version, problems = _compat.check()
    assert version == "0.99.0" and len(problems) == 1
    assert "not a tested release" in problems[0] and "PLE_MEMOPS_VLLM_UNTESTED=1" in problems[0]
    with pytest.raises(pm.UnsupportedError, match=r"vLLM 0\.99\.0 is not a tested release"):
        plugin.install()
    assert plugin.installed() is None
    monkeypatch.setenv(_compat.UNTESTED_ENV, "yes")
    with pytest.raises(pm.InvalidArgumentError, match="PLE_MEMOPS_VLLM_UNTESTED must be"):
        plugin.install()
    # Told, every fact holding: it starts, saying so.
    monkeypatch.setenv(_compat.UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="ple_memops"):
        record = plugin.install()
    try:
        assert record.vllm_version == "0.99.0"
        assert any("0.99.0 is not a tested release" in r.getMessage() for r in caplog.records)
    finally:
        record.undo()
    # Told, with a fact failing: refused, naming each failing fact.
    monkeypatch.delattr(mr.GPUModelRunner, "capture_model")
    with pytest.raises(pm.UnsupportedError) as info:
        plugin.install()
    assert "GPUModelRunner.capture_model" in str(info.value)
    assert "0.99.0 is not a tested release" in str(info.value)
    assert "the facts below do not hold" in str(info.value)
    assert plugin.installed() is None


def test_the_plugins_worker_is_named_per_engine_on_cuda(
    checkpoint: Path, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner comes through vLLM's documented seam, ParallelConfig.worker_cls: named
    by the config hook for an engine the plugin serves on CUDA, left as vLLM resolves it
    elsewhere; a worker of the user's own is refused, naming both."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    from ple_memops.vllm import worker

    monkeypatch.delenv("PLE_MEMOPS_TABLE_BACKEND", raising=False)
    # A CPU engine keeps vLLM's CPU worker, switched on or not.
    for mmap in (False, True):
        assert _config(checkpoint, mmap=mmap).parallel_config.worker_cls == (
            "vllm.v1.worker.cpu_worker.CPUWorker"
        )
    # On CUDA (the platform's answer faked: this machine has no GPU), through the config
    # hook the plugin installed for the architecture.
    from vllm.model_executor.models import config as model_configs

    hook = model_configs.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"]
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # 0.33.0's CPU default is V1
    for mmap, want in ((False, "auto"), (True, worker.WORKER)):
        vc = _config(checkpoint, mmap=mmap)
        vc.parallel_config.worker_cls = "auto"
        hook.verify_and_update_config(vc)
        assert vc.parallel_config.worker_cls == want, mmap
    vc = _config(checkpoint, mmap=True)
    vc.parallel_config.worker_cls = "my.Worker"
    with pytest.raises(pm.UnsupportedError, match=r"worker_cls='my\.Worker'.*PLE_MEMOPS_TABLE"):
        hook.verify_and_update_config(vc)
    for own in ("vllm.v1.worker.gpu_worker.Worker", worker.WORKER):
        vc = types.SimpleNamespace(parallel_config=types.SimpleNamespace(worker_cls=own))
        assert worker.place_worker(vc) is None and vc.parallel_config.worker_cls == worker.WORKER
    vc = types.SimpleNamespace(parallel_config=types.SimpleNamespace(worker_cls="my.Worker"))
    refused = worker.place_worker(vc)
    assert refused is not None and "worker_cls='my.Worker'" in refused and worker.WORKER in refused
    assert vc.parallel_config.worker_cls == "my.Worker"
    # The worker is vLLM's GPU worker, building the plugin's runner.
    assert issubclass(worker.PleWorker, Worker)
    built: list[Any] = []

    class Stand(runner.PleGPUModelRunner):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, device: Any) -> None:
            built.append((vllm_config, device))

    monkeypatch.setattr(runner, "PleGPUModelRunner", Stand)
    w = object.__new__(worker.PleWorker)
    w.vllm_config = types.SimpleNamespace(is_mm_encoder_only=False)
    w.device = torch.device("cpu")
    assert isinstance(w._make_model_runner(), Stand) and built == [(w.vllm_config, w.device)]


def test_time_graphs_times_every_full_replay_armed_or_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake_stream: Any
) -> None:
    """With ``time_graphs`` the plugin's graph manager runs vLLM's replay between the
    clock's two events, inside the hooks' arming when the engine has hooks; without hooks
    (a ``default`` engine) it still times, and logs a ``ple-memops graphs`` line."""
    from vllm.v1.worker.gpu import cudagraph_utils

    from ple_memops.step_costs import GraphClock
    from ple_memops.vllm.runner import GraphTimesLog, PleCudaGraphManager

    gpu = fake_stream
    replays: list[Any] = []

    def replay(self: Any, desc: Any) -> str:
        replays.append(desc)
        gpu.now += 100.0  # the graph runs 100 us
        return f"out-{desc}"

    # vLLM's replay (ModelCudaGraphManager's, which the plugin's class extends).
    monkeypatch.setattr(cudagraph_utils.ModelCudaGraphManager, "run_fullgraph", replay)
    manager = object.__new__(PleCudaGraphManager)
    manager.ple_rows = None
    manager.ple_clock = GraphTimesLog(3600.0, GraphClock(event=gpu.event))
    # vLLM's own descriptors (each replay keyed by its batch size), then one without.
    full = cudagraph_utils.CUDAGraphMode.FULL
    descs = [cudagraph_utils.BatchExecutionDescriptor(full, n, n) for n in (8, 16, 8)]
    for d in [*descs, "c"]:
        assert manager.run_fullgraph(d) == f"out-{d}"
        gpu.now += 20.0  # the engine's eager work between graphs
    assert replays == [*descs, "c"]
    with caplog.at_level(logging.INFO, logger="ple_memops"):
        line = manager.ple_clock.log()
    assert line is not None and "4 graphs on the GPU: span us p50 100.0" in line
    assert "period p50 120.0; outside the graph p50 20.0" in line
    assert line.endswith("; span p50 by size: 8 x2 100.0, 16 x1 100.0")
    assert any("ple-memops graphs, last" in r.getMessage() for r in caplog.records)

    class Hooks:  # the rows hooks: arm, then launch what they are given
        def __init__(self) -> None:
            self.armed: list[Any] = []

        def replay(self, desc: Any, launch: Any) -> Any:
            self.armed.append(desc)
            return launch()

    hooks = Hooks()
    manager.ple_rows = hooks
    assert manager.run_fullgraph("d") == "out-d" and hooks.armed == ["d"]
    times = manager.ple_clock.clock.summary()
    assert times is not None and times.launches == 1 and times.span_p50_us == 100.0


def test_the_graph_managers_release_drops_vllms_graphs_when_ours_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An aborted plan makes the hooks' ``release_graphs`` raise ``PoisonedError``; vLLM's
    own release still runs (every GPU wait was released by the abort, so its graphs can
    go) and the error reaches the engine."""
    from ple_memops.errors import PoisonedError
    from ple_memops.vllm import runner

    released: list[str] = []
    monkeypatch.setattr(runner._BaseManager, "release_graphs", lambda self: released.append("vllm"))

    class Hooks:  # the rows hooks of an aborted plan
        def release_graphs(self) -> None:
            released.append("ours")
            raise PoisonedError("a failed launch")

    manager = object.__new__(runner.PleCudaGraphManager)
    manager.ple_rows = Hooks()
    with pytest.raises(PoisonedError, match="a failed launch"):
        manager.release_graphs()
    assert released == ["ours", "vllm"]
    manager.ple_rows = None  # a default engine's manager: vLLM's release alone
    manager.release_graphs()
    assert released == ["ours", "vllm", "vllm"]


def test_the_runner_times_the_engines_wait_for_a_steps_results(
    monkeypatch: pytest.MonkeyPatch, fake_stream: Any
) -> None:
    """Under async scheduling the runner's output is handed out later (vLLM's
    ``get_output``): with ``time_graphs`` its wait is timed on the graphs' clock, the GPU
    table's engine (no rows hooks) too; with rows hooks it is checked before it is handed
    out; with neither the output is vLLM's, untouched."""
    import time
    from types import MethodType, SimpleNamespace

    from vllm.v1.worker.gpu import model_runner as vllm_model_runner

    from ple_memops.step_costs import GraphClock, HostTime
    from ple_memops.vllm.hooks import _CountedHooks
    from ple_memops.vllm.runner import GraphTimesLog, PleGPUModelRunner

    class Output:  # vLLM's AsyncOutput: the step still runs on the GPU
        def get_output(self) -> str:
            time.sleep(0.003)
            return "tokens"

    monkeypatch.setattr(
        vllm_model_runner.GPUModelRunner, "sample_tokens", lambda self, *a, **k: Output()
    )
    runner = object.__new__(PleGPUModelRunner)
    clock = GraphClock(event=fake_stream.event)
    runner.cudagraph_manager = SimpleNamespace(ple_clock=GraphTimesLog(3600.0, clock))
    assert runner.sample_tokens(None).get_output() == "tokens"
    clock.around(lambda: None)
    times = clock.summary()
    assert times is not None and times.results_us is not None
    assert times.results_us[0] >= 3_000
    # Rows hooks as well: timed, then checked, then handed out.
    handed: list[str] = []

    def hand_out(get: Any) -> Any:
        out = get()
        handed.append(out)
        return out

    host = HostTime()
    # A stats line's hooks (which count) with their hand_out recorded.
    hooks = SimpleNamespace(hand_out=hand_out, host=host)
    hooks.step_output = MethodType(_CountedHooks.step_output, hooks)
    runner.ple_rows = hooks  # type: ignore[assignment]
    assert runner.sample_tokens(None).get_output() == "tokens" and handed == ["tokens"]
    host.end_step()
    (ours,) = host.take()  # the runner's wrapping of the output, counted as the check
    assert ours["check"] > 0 and ours["results"] == 0
    clock.around(lambda: None)
    times = clock.summary()
    assert times is not None and times.results_us is not None
    # The graphs' clock wrapping get_output is the instrument's time, not ours.
    wrap = clock.results

    def slow_results(get: Any) -> Any:
        time.sleep(0.02)
        return wrap(get)

    monkeypatch.setattr(clock, "results", slow_results)
    assert runner.sample_tokens(None).get_output() == "tokens"
    host.end_step()
    (ours,) = host.take()
    assert 0 < ours["check"] < 10_000_000, ours  # ns: the clock's 20 ms not in it
    # Neither: vLLM's own output.
    runner.ple_rows = None
    runner.cudagraph_manager = SimpleNamespace(ple_clock=None)
    out = runner.sample_tokens(None)
    assert type(out) is Output and "get_output" not in vars(out)


def test_the_hooks_bench_runs_through_vllms_runner_classes() -> None:
    """``bench_hooks.py --through runner``: our runner and graph manager over vLLM's own
    classes (its step stubbed below them) arm, replay and check every step, and vLLM's
    stubbed step alone is measured beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_hooks

    got = bench_hooks.run(1, 40, 0.0, between="sleep", through="runner", hooks_kind="ours-stats")
    # Each step went through our overrides: the replay armed the table, the output was
    # checked when handed out (both zero if vLLM's methods ran without ours).
    assert got["arm"][0] > 0 and got["check"][0] > 0 and got["step"][0] > 0
    # Served as by default (no stats line), nothing is counted by hook; the step is
    # still timed whole.
    quiet = bench_hooks.run(1, 40, 0.0, between="sleep", through="runner")
    assert "arm" not in quiet and quiet["all in"][0] == quiet["all in"][0]
    assert got["vLLM stubs"][0] > 0
    assert got["all in"][0] == got["all in"][0]  # a number, not NaN
    # The flat floor goes through the same runner and manager classes.
    flat = bench_hooks.run(1, 40, 0.0, between="sleep", through="runner", hooks_kind="flat")
    assert set(flat) == {"all in", "vLLM stubs"} and flat["all in"][0] == flat["all in"][0]


def test_forcing_the_fallback_on_some_ranks() -> None:
    """The test switch that makes a plan synchronous: on every rank, or only on the
    listed world ranks (the one-rank fault of a tensor-parallel engine)."""
    from ple_memops.vllm.runner import forced_sync

    assert not forced_sync(None, 0) and not forced_sync("", 1) and not forced_sync("0", 0)
    assert forced_sync("1", 0) and forced_sync("1", 3)
    assert forced_sync("ranks=1", 1) and not forced_sync("ranks=1", 0)
    assert forced_sync(" ranks=0,2 ", 2) and not forced_sync("ranks=0,2", 1)
    for bad in ("yes", "ranks=", "ranks=a", "ranks=-1", "rank=1", "2"):
        with pytest.raises(pm.InvalidArgumentError, match="PLE_MEMOPS_FORCE_SYNC must be"):
            forced_sync(bad, 0)


def test_check_command_reports(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from ple_memops.vllm.__main__ import main

    monkeypatch.delenv("PLE_MEMOPS_TABLE_BACKEND", raising=False)
    # Switched off is how the plugin ships, not an error: exit 0, and say how to switch on.
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"vllm: {VERSION}" in out and "plugin: discovered" in out and "switch: off" in out
    assert f"compatible: yes (vLLM {VERSION} is a tested release" in out
    assert "ready, switched off" in out and "set PLE_MEMOPS_TABLE_BACKEND=mmap" in out
    # vLLM's own import-time lines are not the verdict.
    assert "Failed to import" not in out and "WARNING" not in out
    assert "settings: the defaults" in out
    monkeypatch.setenv("PLE_MEMOPS_TABLE_BACKEND", "mmap")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "switch: on" in out
    assert "ready: vLLM would serve" in out
    assert max(len(line) for line in out.splitlines()) < 200, out
    # One setting at a time: what the check prints, or its refusal of a bad value.
    for var, value, rc, says in (
        ("PLE_MEMOPS_STATS_EVERY", "10", 0, "settings: stats_every=10.0 "),
        ("PLE_MEMOPS_FIRST_LAYER_THREADS", "6", 0, "first_layer_threads=6"),
        ("PLE_MEMOPS_FIRST_LAYER_THREADS", "1", 1, "PLE_MEMOPS_FIRST_LAYER_THREADS must be"),
        ("PLE_MEMOPS_FIRST_LAYER_THREADS", "0", 0, "first_layer_threads=0"),
        ("PLE_MEMOPS_SPLIT_ROWS", "0", 0, "split_rows=False"),
        ("PLE_MEMOPS_SPLIT_ROWS", "1", 0, "settings: the defaults"),
        ("PLE_MEMOPS_SPLIT_ROWS", "2", 1, "PLE_MEMOPS_SPLIT_ROWS must be 1 or 0"),
    ):
        monkeypatch.setenv(var, value)
        assert main(["check"]) == rc, (var, value)
        assert says in capsys.readouterr().out, (var, value)
        monkeypatch.delenv(var)
    # An untested release: refused unless told, then started when every fact holds.
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(_compat, "report", lambda: _compat.Report("0.99.0", False, []))
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "compatible: no, vLLM 0.99.0" in out and "PLE_MEMOPS_VLLM_UNTESTED=1" in out
    monkeypatch.setenv(_compat.UNTESTED_ENV, "1")
    assert main(["check"]) == 0
    assert "compatible: untested (vLLM 0.99.0" in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setenv("PLE_MEMOPS_TABLE_BACKEND", "mmap")
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    assert main(["check"]) == 1
    assert "does not name 'ple_memops'" in capsys.readouterr().out
    # The command line: help text for its argument and exit codes, and the exit status a
    # script sees for a compatible install switched off.
    monkeypatch.delenv("VLLM_PLUGINS")
    with pytest.raises(SystemExit) as helped:
        main(["check", "--help"])
    assert helped.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m ple_memops.vllm check" in out and "exit status: 0 compatible" in out
    assert all(v in out for v in _compat.TESTED_VERSIONS)
    env = {k: v for k, v in os.environ.items() if k != "PLE_MEMOPS_TABLE_BACKEND"}
    off = subprocess.run(
        [sys.executable, "-m", "ple_memops.vllm", "check"], capture_output=True, text=True, env=env
    )
    assert off.returncode == 0, off.stdout + off.stderr
    assert "switch: off" in off.stdout


# -- the custom ops ---------------------------------------------------------------------------


def test_ops_compile(checkpoint: Path, dist: Any) -> None:
    from ple_memops.vllm.tables import checkpoint_tensor_names, find_layer_table, open_layer_table

    name = "model.layers.0.ple.ple_embedding.ngram_embedding"
    table = open_layer_table(checkpoint, find_layer_table(checkpoint_tensor_names(checkpoint), 0))
    hooks = build_hooks({name: table}, rows_per_token=4, max_rows=64, device="cpu", timeout=30.0)

    def consumer(ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.ops.ple_memops.stage_rows(ids, out, name)
        torch.ops.ple_memops.join_rows(out, name)
        return out.to(torch.int32).sum(dim=-1)

    try:
        compiled = torch.compile(consumer, fullgraph=True, backend="aot_eager")
        ids = torch.randint(0, table.rows, (5, 4), dtype=torch.int64)
        out = hooks.output(name, 5)
        layer = types.SimpleNamespace(ple_memops_hooks=hooks)
        with hooks.eager(dummy=False), ops.layers({name: layer}):
            got = compiled(ids, out)
        want = torch.from_numpy(table.gather(ids.reshape(-1).numpy())).to(torch.int32).sum(-1)
        assert torch.equal(got, want)
    finally:
        hooks.shutdown()
        table.close()


# -- ids -----------------------------------------------------------------------------------------


def _ngram_modules(checkpoint: Path) -> Iterator[tuple[int, Any, Any]]:
    """vLLM's own n-gram embeddings of three PLE layers of the test model (with each
    layer's dense index and the text config)."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    vc = _config(checkpoint, EngramConfig(cpu_offload=False))
    cfg = vc.model_config.hf_text_config
    with set_current_vllm_config(vc):
        for dense in (0, 1, 5):
            emb = Qwen4ExpNGramEmbedding(
                cfg,
                64,
                dense,
                64,
                data_parallel_rank=0,
                prefix=f"h{dense}",
                params_dtype=torch.bfloat16,
            )
            yield dense, cfg, emb


def test_our_ids_equal_vllms_compute_ngram_ids(checkpoint: Path, dist: Any) -> None:
    rng = random.Random(11)
    for dense, cfg, emb in _ngram_modules(checkpoint):
        lay = NGramLayout.from_config(cfg, dense)
        assert list(lay.sizes) == emb.ngram_heads_vocab_sizes.tolist()
        assert list(lay.offsets) == emb.ngram_heads_offsets.tolist()
        assert emb.layer_multipliers.tolist() == [
            m - (1 << 64) if m >= 1 << 63 else m for m in lay.multipliers
        ]
        assert lay.rows == emb.ngram_embedding.org_vocab_size
        ours = NGramHasher(lay)
        tok = lambda: rng.choice([7, rng.randint(0, 127)])  # noqa: E731
        for toks, qsl, ctx in _random_steps(rng, 120, tok, max_len=5):
            assert torch.equal(ours(toks, qsl, ctx), emb.compute_ngram_ids(toks, qsl, ctx))


def _random_steps(
    rng: random.Random, count: int, tok: Any, *, max_len: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``compute_ngram_ids``' arguments for ``count`` random steps (steps of no token
    skipped): 1-6 requests of 0-``max_len`` tokens each, 0-4 tokens past the last
    request's end, every token and the two context tokens a request from ``tok()``."""
    for _ in range(count):
        nreq = rng.randint(1, 6)
        starts = [0]
        for _r in range(nreq):
            starts.append(starts[-1] + rng.randint(0, max_len))
        total = starts[-1] + rng.randint(0, 4)
        if total == 0:
            continue
        toks = torch.tensor([tok() for _ in range(total)], dtype=torch.int32)
        ctx = torch.tensor([[tok(), tok()] for _ in range(nreq)], dtype=torch.int32)
        yield toks, torch.tensor(starts, dtype=torch.int32), ctx


# -- the model with the mmap backend ------------------------------------------------------------


def test_model_loads_without_its_tables_and_rows_match_the_device_table(
    checkpoint: Path,
    dist: Any,
    installed: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.config.compilation import CUDAGraphMode

    from ple_memops.vllm.qwen4exp import Qwen4ExpPLEMmapEmbedding

    kept = vllm_cpu.spy_loaded_files(monkeypatch)
    mmap_cfg = _config(checkpoint, mmap=True)
    mmap_cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    model, _ = _load(mmap_cfg)
    assert isinstance(model, qwen4exp.Qwen4ExpMmapForCausalLM)
    assert model.is_unused_checkpoint_weight(
        "model.layers.2.ple.ple_embedding.ngram_embedding.shard_3.weight"
    )
    # Files holding only table rows were not read; nothing of the tables was allocated.
    assert kept == [["model-rest.safetensors"]]
    tables = [m for m in model.modules() if isinstance(m, Qwen4ExpPLEMmapEmbedding)]
    assert len(tables) == 2 and all(t.weight.numel() == 0 for t in tables)
    monkeypatch.undo()
    device_cfg = _config(checkpoint, EngramConfig(cpu_offload=False))
    device_model, _ = _load(device_cfg)
    # An engine without the mmap settings builds vLLM's own tables, also with the plugin.
    assert not qwen4exp.find_mmap_embeddings(device_model)
    assert not hasattr(device_model, "is_unused_checkpoint_weight")

    fake = types.SimpleNamespace(model=model, vllm_config=mmap_cfg, device=torch.device("cpu"))
    ours = logging.getLogger("ple_memops")
    ours.addHandler(caplog.handler)  # the plugin routes it to vLLM's handler, not the root's
    monkeypatch.setenv("PLE_MEMOPS_FIRST_LAYER_THREADS", "3")
    built: list[tuple[list[str], bool]] = []

    def spy(tables: Any, **kw: Any) -> Any:
        built.append((list(tables), kw["read_in_order"]))
        return build_hooks(tables, **kw)

    build_hooks = runner.build_hooks
    monkeypatch.setattr(runner, "build_hooks", spy)
    try:
        with caplog.at_level(logging.WARNING, logger="ple_memops"):
            with set_current_vllm_config(mmap_cfg):
                hooks = runner.attach_runner(fake)
    finally:
        ours.removeHandler(caplog.handler)
        monkeypatch.delenv("PLE_MEMOPS_FIRST_LAYER_THREADS")
        monkeypatch.setattr(runner, "build_hooks", build_hooks)
    # Qwen4Exp stages every table at the top: its tables read in layer order (the steps'
    # tables in that order; host tables here, with no workers, have none to keep).
    ((names, in_order),) = built
    layer_of = [int(n.split("layers.")[1].split(".")[0]) for n in names]
    assert in_order and layer_of == sorted(layer_of) and len(layer_of) > 1, names
    assert hooks is not None and hooks.steps.mode == "host"
    by_layer = sorted(
        (
            int(name.split("layers.")[1].split(".")[0]),
            layer.table.gather_threads,
            layer.table.parallel_min_bytes,
        )
        for name, layer in hooks.steps.tables.items()
    )
    # The first PLE layer's table (the one every step waits for) got threads of its own;
    # every table keeps the core's parallel threshold (measured: 128 rows inline beat
    # them at c8, BENCHMARKS.md).
    assert [(t, m) for _, t, m in by_layer] == [(3, 256 << 10)] + [(None, 256 << 10)] * (
        len(by_layer) - 1
    ), by_layer
    # What a user sees when the plan cannot defer: the reason and what changes.
    assert "deferred PLE rows are unavailable (no CUDA device" in caplog.text
    assert "cudagraph_mode FULL_DECODE_ONLY -> NONE" in caplog.text
    assert mmap_cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    try:
        g = torch.Generator().manual_seed(3)
        for i in ckpts.PLE_LAYERS:
            ids = torch.randint(0, 128, (9,), generator=g, dtype=torch.int32)
            ids[4] = 7  # an EOS inside a request
            qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
            ctx = torch.randint(0, 128, (3, 2), generator=g, dtype=torch.int32)
            hidden = torch.zeros(9, 256, dtype=torch.bfloat16)
            layer, ref = model.model.layers[i].ple, device_model.model.layers[i].ple
            layers = mmap_cfg.compilation_config.static_forward_context
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                layer.start_prefetch(ids, qsl, ctx)
                got = layer.ple_embedding(hidden, ids, qsl, ctx)
            with set_current_vllm_config(device_cfg):
                want = ref.ple_embedding(hidden, ids, qsl, ctx)
            assert got.dtype == want.dtype and got.shape == want.shape == (9, 64)
            assert want.view(torch.uint8).any()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(
                layer._dequantize_embeddings(got, torch.bfloat16),
                ref._dequantize_embeddings(want, torch.bfloat16),
            )
    finally:
        hooks.shutdown()


def test_a_missing_table_is_a_clear_error(
    checkpoint: Path, dist: Any, installed: Any, tmp_path: Path
) -> None:
    mmap_cfg = _config(checkpoint, mmap=True)
    model, _ = _load(mmap_cfg)
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "ple-layer-2.safetensors").unlink()
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if v != "ple-layer-2.safetensors"
    }
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    mmap_cfg.model_config.model = str(broken)
    fake = types.SimpleNamespace(model=model, vllm_config=mmap_cfg, device=torch.device("cpu"))
    with pytest.raises(pm.TableError, match="no PLE table for layer 2"):
        runner.attach_runner(fake)


def test_a_cpu_engine_keeps_vllms_runner_and_its_mmap_table_refuses_to_serve(
    checkpoint: Path, dist: Any, installed: Any
) -> None:
    """On a CPU engine the plugin changes neither the worker nor the runner (vLLM's
    CPUModelRunner subclasses its GPU runner); switched on, the mmap table has no steps
    and its first forward says why instead of serving wrong rows."""
    from vllm.v1.worker import cpu_worker

    vc = _config(checkpoint, mmap=True)
    assert vc.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert not any(c.__module__.startswith("ple_memops") for c in cpu_worker.CPUModelRunner.__mro__)
    model, _ = _load(vc)
    table = qwen4exp.find_mmap_embeddings(model)[0]
    with pytest.raises(pm.StateError, match="only the plugin's worker attaches one"):
        table.finalize_prefetch(1)


@pytest.mark.skipif(
    "disk_offload" not in EngramConfig.__dataclass_fields__,
    reason=f"vLLM {VERSION} has no engram_config.disk_offload (0.34.0 brought it)",
)
def test_vllms_disk_offload_and_the_mmap_backend_are_not_combined(
    checkpoint: Path, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.34.0's disk offload builds a table class of its own: with the mmap backend
    on as well, the plugin would do nothing, so the engine is refused naming both."""
    monkeypatch.delenv("PLE_MEMOPS_TABLE_BACKEND", raising=False)
    vc = _config(checkpoint, mmap=True)
    vc.engram_config.disk_offload = True
    with pytest.raises(pm.UnsupportedError) as info:
        qwen4exp.verify_and_update_config(vc)
    text = str(info.value)
    assert "engram_config.disk_offload=True" in text and "PLE_MEMOPS_TABLE_BACKEND" in text
    # Switched off for the engine, vLLM's hook and ours let it through.
    vc = _config(checkpoint)
    vc.engram_config = EngramConfig(disk_offload=True)
    qwen4exp.verify_and_update_config(vc)


def test_a_table_that_does_not_match_the_model_is_refused_naming_it(
    checkpoint: Path, dist: Any, installed: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    mmap_cfg = _config(checkpoint, mmap=True)
    model, _ = _load(mmap_cfg)
    broken = tmp_path / "narrow"
    shutil.copytree(checkpoint, broken)
    f = broken / "ple-layer-2.safetensors"
    tensors = load_file(str(f))
    save_file({k: v[:, : v.shape[1] // 2].contiguous() for k, v in tensors.items()}, str(f))
    mmap_cfg.model_config.model = str(broken)
    fake = types.SimpleNamespace(model=model, vllm_config=mmap_cfg, device=torch.device("cpu"))
    with pytest.raises(pm.TableError, match=r"layer 2 \(.*layers\.2\.ple\.ple_embedding.*rows of"):
        runner.attach_runner(fake)


# -- the switch and the refusals ---------------------------------------------------------------


def test_switch_per_engine_and_refusals(
    checkpoint: Path, dist: Any, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PLE_MEMOPS_TABLE_BACKEND", raising=False)
    # Through vLLM's own config resolution (our Qwen4Exp config hook): no data-parallel
    # sharing of a pinned table that does not exist.
    vc = _config(checkpoint, mmap=True)
    assert engine_settings(vc).mmap
    assert vc.engram_config is not None and vc.engram_config.dp_shared_memory is False
    assert not engine_settings(_config(checkpoint)).mmap
    monkeypatch.setenv("PLE_MEMOPS_TABLE_BACKEND", "mmap")
    assert engine_settings(_config(checkpoint)).mmap
    off = {"ple_memops": {"table_backend": "default", "timeout": 5}}
    assert engine_settings(_config(checkpoint, additional_config=off)) == (Settings("default", 5.0))
    monkeypatch.delenv("PLE_MEMOPS_TABLE_BACKEND")
    with pytest.raises(pm.UnsupportedError, match="embedding_across_dp"):
        _config(checkpoint, EngramConfig(embedding_across_dp=True), mmap=True)
    # vLLM turns breakable (PIECEWISE) graphs on for Qwen4Exp unless told otherwise: an
    # mmap engine tells it otherwise, and one that asks for them is refused.
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    _config(checkpoint, mmap=True)
    assert os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
    monkeypatch.setattr(qwen4exp, "_USER_BREAKABLE", "1")  # as if set before vLLM started
    with pytest.raises(pm.UnsupportedError, match="breakable CUDA graphs"):
        _config(checkpoint, mmap=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown keys"):  # pydantic wraps ours
        _config(checkpoint, additional_config={"ple_memops": {"backend": "mmap"}})
    # Refusals vLLM's CPU config cannot reach, on the hook itself.
    base = _config(checkpoint)
    for change, match in (
        (lambda v: setattr(v.parallel_config, "pipeline_parallel_size", 2), "pipeline"),
        (lambda v: setattr(v.parallel_config, "enable_dbo", True), "DBO"),
    ):
        v = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1, enable_dbo=False),
            engram_config=None,
            compilation_config=base.compilation_config,
            additional_config=MMAP,
        )
        change(v)
        with pytest.raises(pm.UnsupportedError, match=match):
            qwen4exp.verify_and_update_config(v)
    # NVFP4 tables (packed rows plus block scales) are refused when the layer is built.
    from vllm.models.qwen4_exp.nvidia import ngram_embedding

    vc = _config(checkpoint, mmap=True)
    cfg = vc.model_config.hf_text_config
    monkeypatch.setattr(cfg, "ple_embedding_dtype", "nvfp4", raising=False)
    with (
        set_current_vllm_config(vc),
        qwen4exp._mmap_table_class(),
        pytest.raises(pm.UnsupportedError, match="NVFP4"),
    ):
        ngram_embedding.Qwen4ExpNGramEmbedding(
            cfg, 64, 0, 64, data_parallel_rank=0, prefix="nv", params_dtype=torch.bfloat16
        )
    # The table classes are vLLM's again afterwards.
    assert ngram_embedding.Qwen4ExpPLEDeviceEmbedding.__name__ == "Qwen4ExpPLEDeviceEmbedding"


# -- tensor parallel ------------------------------------------------------------------------------


def test_tensor_parallel_ranks_read_full_rows(checkpoint: Path, tmp_path: Path) -> None:
    for report in vllm_cpu.run_tp_ranks("qwen4exp", checkpoint, tmp_path):
        rank = report["rank"]
        assert report["plan_mode"] == "host"
        # Rank 1 alone could not defer: both ranks took the synchronous path.
        assert report["agreed"] == [False, True]
        for layer, r in report["layers"].items():
            # The device table is split over the two ranks and combined by an all-reduce;
            # the mmap table holds nothing and reads full rows without one.
            assert r["equal"] and r["nonzero"], (rank, layer, r)
            assert r["mmap_rows"] == 0 and r["device_rows"] in (2048, 2112)
            assert r["device_reduces"] == 1 and r["mmap_reduces"] == 0
