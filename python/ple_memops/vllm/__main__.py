"""``python -m ple_memops.vllm check``: is the plugin discovered by vLLM, switched on, and
compatible with the installed vLLM?

Exit status: 0 when the install is compatible, switched on or off (off is how the plugin
ships: the check then says how to switch it on), and on an untested vLLM release that
meets every fact with the opt-in set; 1 when something would go wrong (an untested
release, vLLM's names differ from the ones the plugin relies on, a setting has a bad
value, ``VLLM_PLUGINS`` keeps the plugin out); 2 when vLLM or the plugin's entry point is
not installed."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, entry_points, version

from ..errors import InvalidArgumentError
from . import _compat
from .settings import BACKEND_ENV, Settings

GROUP = "vllm.general_plugins"
NAME = "ple_memops"
TARGET = "ple_memops.vllm.plugin:register"


@contextlib.contextmanager
def _quiet_vllm_import() -> Iterator[list[str]]:
    """vLLM's and torch's import-time lines (``Failed to import from vllm._C`` on a
    machine without vLLM's GPU build, torch's deprecation warnings) are not this command's
    verdict: what the block prints, at the file-descriptor level too, is kept in the list
    it yields (shown only when the check fails)."""
    kept: list[str] = []
    saved_level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield kept
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if saved_level is None:
                os.environ.pop("VLLM_LOGGING_LEVEL", None)
            else:
                os.environ["VLLM_LOGGING_LEVEL"] = saved_level
            sink.seek(0)
            kept.extend(sink.read().decode(errors="replace").splitlines())


def _changed_settings(settings: Settings) -> list[str]:
    """The settings that differ from their defaults, as ``key=value``."""
    default = Settings()
    return [
        f"{f.name}={getattr(settings, f.name)!r}"
        for f in dataclasses.fields(Settings)
        if f.name != "table_backend" and getattr(settings, f.name) != getattr(default, f.name)
    ]


def check() -> int:
    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        print("vllm: not installed")
        print(
            f"install a tested release: {', '.join(_compat.TESTED_VERSIONS)} "
            "(README says how to install each)"
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
    print(f"switch: {state} ({BACKEND_ENV}={os.environ.get(BACKEND_ENV, '')!r})")
    changed = _changed_settings(settings)
    print(
        "settings: "
        + (", ".join(changed) if changed else "the defaults")
        + " (docs/vllm.md lists each; an engine's additional_config['ple_memops'] "
        "overrides them)"
    )
    if settings.diag_skip_gather:
        print("diagnostics: rows are NOT gathered (wrong tokens); for timing the protocol only")
    try:
        with _quiet_vllm_import() as printed:
            facts = _compat.report()
        problems = _compat.problems(facts)
    except InvalidArgumentError as exc:
        print(f"compatible: {exc}")
        return 1
    total = len(_compat.REQUIREMENTS)
    if problems:
        print(f"compatible: no, vLLM {facts.version}:")
        for p in problems:
            print(f"  - {p}")
        if printed:
            print("what importing vLLM printed:")
            for line in printed[-20:]:
                print(f"  | {line}")
        return 1
    if facts.tested:
        print(
            f"compatible: yes (vLLM {facts.version} is a tested release; all {total} facts the "
            "plugin relies on hold)"
        )
    else:
        print(
            f"compatible: untested (vLLM {facts.version} is not a tested release; all {total} "
            f"facts hold and {_compat.UNTESTED_ENV}=1 lets the plugin start on it)"
        )
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
        "(Qwen4Exp, Gemma 4, Gemma 3n) whose FULL CUDA graphs wait for rows gathered "
        "after launch.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "check",
        help="is vLLM installed, the plugin discovered, switched on and compatible",
        description="Reads the environment and the installed vLLM; starts no engine. "
        f"Tested vLLM releases: {', '.join(_compat.TESTED_VERSIONS)}; another release "
        f"starts only with {_compat.UNTESTED_ENV}=1 and every fact holding.",
        epilog="exit status: 0 compatible (switched on or off), 1 a problem (an untested "
        "release, vLLM's names differ, a bad setting, VLLM_PLUGINS keeps the plugin out), "
        "2 vLLM or the plugin's entry point not installed",
    )
    parser.parse_args(argv)
    return check()


if __name__ == "__main__":
    sys.exit(main())
