"""``python -m ple_memops.vllm apply [--check] | revert [--check]``: patch the installed
vLLM 0.33.0 for memory-mapped PLE tables, and say what changed."""

from __future__ import annotations

import argparse
import sys

from ._patch import VLLM_VERSION, WHY, PatchError, apply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ple_memops.vllm",
        description=f"Apply ple-memops's patch to the installed vllm {VLLM_VERSION} "
        "(Qwen4Exp PLE tables memory-mapped from the checkpoint, FULL CUDA graphs that "
        "wait for rows gathered after launch). Idempotent; writes nothing when any file "
        "differs from what the patch expects.",
    )
    parser.add_argument("command", choices=["apply", "revert"])
    parser.add_argument(
        "--check",
        action="store_true",
        help="report what would change without writing; exit 0 when nothing would, 1 otherwise",
    )
    parser.add_argument(
        "--site", help="a site-packages directory holding vllm (default: the importable one)"
    )
    args = parser.parse_args(argv)
    revert = args.command == "revert"
    try:
        root, states, changes = apply(site=args.site, check=args.check, revert=revert)
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"vllm {VLLM_VERSION} at {root / 'vllm'}")
    done_state = "unpatched" if revert else "patched"
    for s in states:
        plus, minus = s.delta
        if s.state == done_state:
            what = "already reverted" if revert else "already patched"
        elif args.check:
            what = "would revert" if revert else "would patch"
        else:
            what = "reverted" if revert else "patched"
        print(f"  {what:16} {s.path} (+{plus} -{minus}): {WHY.get(s.path, '')}")
    if not changes:
        print("nothing to do")
    elif not revert and not args.check:
        print(
            'enable it with --engram-config \'{"table_backend": "mmap"}\' or '
            "PLE_MEMOPS_TABLE_BACKEND=mmap"
        )
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
