"""``python -m ple_memops.vllm check``: is the plugin discovered by vLLM, switched on, and
compatible with the installed vLLM?

Exit status: 0 when the install is compatible, switched on or off (off is how the plugin
ships: the check then says how to switch it on); 1 when something would go wrong (vLLM's
names differ from the ones the plugin was tested with, a setting has a bad value,
``VLLM_PLUGINS`` keeps the plugin out); 2 when vLLM or the plugin's entry point is not
installed."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

from ..errors import InvalidArgumentError
from . import _compat
from .settings import (
    BACKEND_ENV,
    COPY_ENV,
    EARLY_JOIN_ENV,
    FIRST_LAYER_THREADS_ENV,
    PREDICT_READY_ENV,
    SKIP_GATHER_ENV,
    SPIN_ENV,
    SPLIT_REST_THREADS,
    SPLIT_ROWS_ENV,
    STATS_ENV,
    TIME_GRAPHS_ENV,
    TIME_STALLS_ENV,
    TIMEOUT_ENV,
    Settings,
)

GROUP = "vllm.general_plugins"
NAME = "ple_memops"
TARGET = "ple_memops.vllm.plugin:register"


def check() -> int:
    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        print("vllm: not installed")
        print(
            f"install it with: pip install vllm=={_compat.TESTED_VERSIONS[-1]} "
            "(the version ple-memops is tested with)"
        )
        return 2
    print(f"vllm: {vllm_version}")
    found = [ep for ep in entry_points(group=GROUP) if ep.name == NAME]
    if not found:
        print(
            f"plugin: not discovered (no entry point {NAME!r} in {GROUP!r}; reinstall ple-memops)"
        )
        return 2
    print(f"plugin: discovered ({GROUP}: {found[0].name} = {found[0].value})")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and NAME not in [p.strip() for p in allowed.split(",")]:
        print(f"plugin: not loaded, VLLM_PLUGINS={allowed!r} does not name {NAME!r}")
        return 1
    try:
        settings = Settings.from_env()
    except InvalidArgumentError as exc:
        print(f"switch: {exc}")
        return 1
    state = "on" if settings.mmap else "off"
    print(
        f"switch: {state} ({BACKEND_ENV}={os.environ.get(BACKEND_ENV, '')!r}; "
        f"timeout {settings.timeout:g} s, {TIMEOUT_ENV})"
    )
    spin = "the core's default" if settings.spin is None else f"{settings.spin:g} s"
    stats = "off" if settings.stats_every is None else f"every {settings.stats_every:g} s"
    lead = settings.first_layer_threads
    lead_text = (
        f"the model's default (a split Gemma row's rest: {SPLIT_REST_THREADS} threads of its "
        "own; otherwise the shared pool)"
        if lead is None
        else "the shared pool"
        if lead == 0
        else f"{lead} threads of its own"
    )
    print(
        f"settings: copy {settings.copy} ({COPY_ENV}), spin {spin} ({SPIN_ENV}), stats lines "
        f"{stats} ({STATS_ENV}), the first PLE layer's gathers on {lead_text} "
        f"({FIRST_LAYER_THREADS_ENV}), stall timing {'on' if settings.time_stalls else 'off'} "
        f"({TIME_STALLS_ENV}), predicted READY {'on' if settings.predict_ready else 'off'} "
        f"({PREDICT_READY_ENV}), graph timing {'on' if settings.time_graphs else 'off'} "
        f"({TIME_GRAPHS_ENV}), a Gemma's rows "
        f"split at decoder layer 0 {'on' if settings.split_rows else 'off'} "
        f"({SPLIT_ROWS_ENV}); an engine's "
        "additional_config['ple_memops'] overrides them"
    )
    if settings.diag_skip_gather:
        print(
            f"diagnostics: {SKIP_GATHER_ENV} is set: rows are NOT gathered (wrong tokens); "
            "for timing the protocol only"
        )
    if settings.diag_early_join:
        print(
            f"diagnostics: {EARLY_JOIN_ENV} is set: a Gemma model run eagerly joins its rows "
            "after the projection, not at decoder layer 0's gate"
        )
    vllm_seen, problems = _compat.check()
    if problems:
        print(f"compatible: no, vLLM {vllm_seen} differs from what the plugin was tested with:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"compatible: yes (vLLM {vllm_seen}: every name the plugin relies on is there)")
    if not settings.mmap:
        print(
            f"ready, switched off: vLLM runs as released; set {BACKEND_ENV}=mmap in the "
            f"server's environment to serve {_SERVED} from the checkpoint"
        )
        return 0
    print(f"ready: vLLM would serve {_SERVED} from the checkpoint (mmap)")
    return 0


_SERVED = (
    "the per-layer embedding tables of Qwen4Exp, Gemma 4 and Gemma 3n "
    "(Gemma3nForConditionalGeneration)"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ple_memops.vllm",
        description="ple-memops's vLLM plugin: memory-mapped per-layer embedding tables "
        "(Qwen4Exp, Gemma 4, Gemma 3n) whose FULL "
        "CUDA graphs wait for rows gathered after launch.",
        epilog="check's exit status: 0 compatible (switched on or off), 1 a problem (vLLM's "
        "names differ, a bad setting, VLLM_PLUGINS keeps the plugin out), 2 vLLM or the "
        "plugin's entry point not installed",
    )
    parser.add_argument(
        "command",
        choices=["check"],
        help="check: is vLLM installed, the plugin discovered, switched on, configured and "
        "compatible with the installed vLLM (reads the environment, starts no engine)",
    )
    parser.parse_args(argv)
    return check()


if __name__ == "__main__":
    sys.exit(main())
