"""``python -m ple_memops demo`` and ``python -m ple_memops bench``."""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from contextlib import AbstractContextManager, ExitStack, redirect_stdout
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .checkpoints import (
    build_checkpoint,
    default_cache_dir,
    e2b_gemma3n_config,
    tiny_gemma3n_config,
)
from .decode import GEMMA3N_TABLE
from .runner import ALL_VARIANTS, ATTENTIONS, STYLES, GemmaBench, RunResult

__all__ = [
    "BENCH_DESCRIPTION",
    "DEFAULT_PNG",
    "DEMO_DESCRIPTION",
    "HelpFormatter",
    "add_bench_args",
    "add_demo_args",
    "bench_main",
    "demo_main",
    "load_gemma",
    "plain",
    "qwen_main",
    "relayer",
]


DEFAULT_PNG = "ple_memops_demo.png"
"""Where ``demo`` draws its PNG without ``--png``: this name in the current directory."""

DEMO_DESCRIPTION = """\
Decode with a Gemma 3n checkpoint through transformers (by default a tiny random one,
built with save_pretrained on first use), its PLE table served from the checkpoint, with
every variant this machine can run; check tokens and logits bit for bit against the stock
model (the reference: its table in GPU memory, or in host memory without a GPU). Prints a
table, the runs' identity and the memory the table costs against what serving it costs,
and draws the same in a PNG (ple_memops_demo.png in the current directory unless --png
PATH or --no-png). Without a GPU it runs eagerly on the CPU: its checks hold, its
timings are noise."""

BENCH_DESCRIPTION = """\
The side-by-side benchmark: every variant at E2B shapes by default (random weights, built
once), in both scheduling styles, checked as the demo checks; --markdown appends its table
in BENCHMARKS.md form. Draws no PNG unless --png PATH."""


def plain(text: str) -> str:
    """``text`` (a docstring) without reStructuredText markup, for ``--help``: ````x````
    and roles such as ``:class:`~a.B``` become their text."""
    text = re.sub(r":[a-z]+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return re.sub(r"``([^`]*)``", r"\1", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` of the commands: descriptions as written, every option's default said
    as one would type it (``1,4``), unless its help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if (
            not action.option_strings
            or "(default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _csv_ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _csv_of(choices: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        if out == ["all"]:
            return list(choices)
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)} (or all), got {s!r}")
        return out

    return parse


def _common(
    ap: argparse.ArgumentParser,
    *,
    steps: int,
    batches: str,
    track: bool,
    png: str | None,
    png_help: str,
) -> None:
    ap.add_argument("--steps", type=int, default=steps, metavar="N", help="decode steps per run")
    ap.add_argument(
        "--batch",
        type=_csv_ints,
        default=_csv_ints(batches),
        metavar="N,N",
        help="batch sizes, comma-separated",
    )
    ap.add_argument(
        "--styles",
        type=_csv_of(STYLES),
        default=list(STYLES),
        metavar="S,S",
        help="scheduling styles: sync, async (comma-separated)",
    )
    ap.add_argument(
        "--placements",
        type=_csv_of(("early", "late")),
        default=["early", "late"],
        metavar="P,P",
        help="consumer placements of the deferred variants: early (stock), late (layer 0 end)",
    )
    ap.add_argument(
        "--variants",
        type=_csv_of(ALL_VARIANTS),
        default=list(ALL_VARIANTS),
        metavar="V,V",
        help=f"which variants, comma-separated, or all: {', '.join(ALL_VARIANTS)} (default: all)",
    )
    ap.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda if there is one)"
    )
    ap.add_argument("--png", default=png, metavar="PATH", help=png_help)
    if png is not None:
        ap.add_argument("--no-png", action="store_true", help="draw no PNG")
    ap.add_argument(
        "--json", default=None, metavar="PATH", help="write every run (per-step times too) as JSON"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument(
        "--track-arrival",
        action=argparse.BooleanOptionalAction,
        default=track,
        help="count the steps whose fill found the GPU waiting (one stream write a step)",
    )
    ap.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="math",
        help="SDPA backend of every variant: math (bit-reproducible run to run, so logits "
        "can be compared bit for bit) or default (torch's choice; on the H200 cuDNN, whose "
        "replays differ from one run to the next)",
    )
    ap.add_argument(
        "--eager-check-steps",
        type=int,
        default=4,
        metavar="N",
        help="steps of the captured reference also checked against the stock model run eagerly",
    )


_CACHE_DEFAULT = "$PLE_MEMOPS_CACHE, else $XDG_CACHE_HOME/ple_memops, else ~/.cache/ple_memops"


def add_demo_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="a Gemma 3n checkpoint directory (default: a tiny random one, built if missing)",
    )
    ap.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"where the default checkpoint is built (default: {_CACHE_DEFAULT})",
    )
    _common(
        ap,
        steps=64,
        batches="1,4",
        track=True,
        png=DEFAULT_PNG,
        png_help="where to draw the PNG: the runs' identity to the reference, the memory "
        f"the table costs against the served path's, per-step latency (default: {DEFAULT_PNG} "
        "in the current directory, overwritten)",
    )


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model",
        default="e2b",
        metavar="tiny|e2b|DIR",
        help="tiny, e2b (E2B shapes, random weights, built once) or a checkpoint directory",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="layers of the built model (default: the config's)",
    )
    ap.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"where built checkpoints live (default: {_CACHE_DEFAULT})",
    )
    ap.add_argument(
        "--page-cache",
        choices=("warm", "cold"),
        default="warm",
        help="warm: the table's pages stay cached; cold: dropped before every run",
    )
    ap.add_argument(
        "--markdown",
        default=None,
        metavar="PATH",
        help="append the BENCHMARKS.md table here (default: none written)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds from loading the model past which no further variant is started "
        "(what was measured is still reported; default: none)",
    )
    ap.add_argument("--qwen", action="store_true", help="also run the Qwen4Exp eager check")
    _common(
        ap,
        steps=256,
        batches="1,8,64",
        track=True,
        png=None,
        png_help="draw the runs' identity, the memory and per-step latency here (default: no PNG)",
    )


class _Progress(AbstractContextManager["_Progress"]):
    """A tqdm bar on stderr, counting the runs of the variants that run here; while it is
    shown, log records and lines printed to stdout are written above it (the bar is
    cleared, the line written, the bar redrawn) instead of into it."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        self._redirects = ExitStack()
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
                from tqdm.contrib.logging import (  # type: ignore[import-untyped,unused-ignore]
                    logging_redirect_tqdm,
                )
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
                self._redirects.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))
                above = _AboveBar(self.bar, sys.stdout)
                self._redirects.callback(above.finish)  # after stdout is restored
                self._redirects.enter_context(redirect_stdout(above))
        self.last = ""

    def __call__(self, what: str) -> None:
        if self.bar is not None:
            if self.last and not self.last.endswith("capture"):
                self.bar.update(1)
            self.bar.set_description(what)
        self.last = what

    def __exit__(self, *exc: object) -> None:
        self._redirects.close()
        if self.bar is not None:
            if self.last:
                self.bar.update(1)
            self.bar.close()


class _AboveBar(io.TextIOBase):
    """A stdout whose complete lines are written above a progress bar."""

    def __init__(self, bar: Any, out: Any) -> None:
        self._bar, self._out, self._pending = bar, out, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._pending += s
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            self._bar.clear()
            self._out.write(done + "\n")
            self._out.flush()
            self._bar.refresh()
        return len(s)

    def flush(self) -> None:
        self._out.flush()

    def finish(self) -> None:
        """Write what is left of an unfinished line."""
        if self._pending:
            self._out.write(self._pending)
            self._pending = ""
        self._out.flush()


def _device(arg: str | None) -> Any:
    import torch

    dev = torch.device(arg or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"--device {arg}: no CUDA device here")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_gemma(
    checkpoint: str | Path, device: Any, placement: str = "early", dtype: Any = None
) -> tuple[Any, Any]:
    """Load a Gemma 3n checkpoint on the CPU, keep its stock PLE module (with the table, on
    the CPU) for the reference variants, serve the table from the checkpoint, move the
    model to ``device``. Returns ``(served, stock_module)``."""
    import torch
    import transformers

    from ..transformers import serve

    cls: Any = transformers.Gemma3nForCausalLM
    model = cls.from_pretrained(
        str(checkpoint), dtype=dtype or torch.bfloat16, attn_implementation="sdpa"
    )
    model.eval()
    stock = model.model.embed_tokens_per_layer
    served = serve(model, checkpoint, placement=placement)
    model.to(device)
    return served, stock


def _run(
    args: Any, checkpoint: Path, title: str, *, quiet_skips: bool = False
) -> tuple[list[RunResult], GemmaBench, dict[str, str]]:
    import torch

    device = _device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    served, stock = load_gemma(checkpoint, device)
    print(
        f"loaded {checkpoint} in {time.perf_counter() - t0:.1f} s: PLE table "
        f"{served.tables[GEMMA3N_TABLE].rows} rows x "
        f"{served.tables[GEMMA3N_TABLE].row_bytes} B served from the checkpoint"
    )
    bench = GemmaBench(
        served,
        stock,
        device=device,
        eager_check_steps=args.eager_check_steps,
        track_arrival=args.track_arrival,
        attention=getattr(args, "attention", "math"),
    )
    avail, skipped = bench.available()
    variants = [v for v in args.variants if v in avail]
    if "gpu-table" not in variants:
        variants.insert(0, "gpu-table")
    for v, why in skipped.items():
        if v in args.variants:
            print(f"skipped {v}: {why}")
    if device.type != "cuda":
        print(
            "no CUDA device: decode runs eagerly on the CPU (no captured graphs, no deferral); "
            "the served variants take the captured step's code path with rows filled before "
            "each step, checked bit for bit against the stock model"
        )
    results: list[RunResult] = []
    from . import report

    deadline = getattr(args, "deadline", None)
    styles = args.styles if device.type == "cuda" else ["sync"]  # no async on the CPU path
    total = bench.planned_runs(variants, styles, args.placements) * len(args.batch)
    with _Progress(total, not args.no_progress) as prog:
        bench.progress = prog
        if deadline is not None:
            bench.deadline = t0 + deadline
        for b in args.batch:
            if deadline is not None and time.perf_counter() - t0 > deadline:
                print(f"skipped batch {b}: past the --deadline of {deadline:.0f} s")
                continue
            got = bench.run_batch(
                b,
                args.steps,
                variants=variants,
                styles=styles,
                placements=args.placements,
                cold=getattr(args, "page_cache", "warm") == "cold",
            )
            results += got
            if args.no_progress:  # a log: each batch's table as soon as it is done
                print(f"-- batch {b} done at {time.perf_counter() - t0:.0f} s")
            if args.json:  # keep what is measured if a later batch is cut short
                report.to_json(results, args.json, {"title": title, "partial": True})
    for b, ok in bench.eager_check.items() if bench.cuda else ():
        print(
            f"batch {b}: captured reference vs the stock model run eagerly "
            f"({min(args.eager_check_steps, args.steps)} steps): "
            + ("bit-identical" if ok else "DIFFER")
        )
    return results, bench, skipped


def _shapes(bench: GemmaBench) -> dict[str, tuple[int, int]]:
    """``name -> (rows, row_bytes)`` of every table the model serves."""
    return {name: (t.rows, t.row_bytes) for name, t in bench.served.tables.items()}


def _finish(args: Any, results: list[RunResult], bench: GemmaBench, title: str) -> int:
    from . import report

    print(report.text_table(results, bench.cuda))
    if not bench.cuda:
        print(report.CPU_TIMINGS)
    table_bytes = bench.served.server.table_bytes
    for line in report.summary(results, table_bytes, _shapes(bench), bench.cuda):
        print(line)
    if args.png and not getattr(args, "no_png", False):
        png = Path(args.png).expanduser().absolute()
        print(report.plot(results, png, title, _shapes(bench), bench.cuda))
    if args.json:
        report.to_json(
            results,
            args.json,
            {"title": title, "table_bytes": table_bytes, "eager_check": bench.eager_check},
        )
    bad = [r for r in results if r.logits_identical is False or r.tokens_identical is False]
    bad_eager = [b for b, ok in bench.eager_check.items() if not ok]
    bench.served.close()
    return 1 if bad or bad_eager else 0


def demo_main(args: Any) -> int:
    """Build (if missing) a tiny random Gemma 3n checkpoint with transformers'
    ``save_pretrained``, decode with every variant this machine can run, check tokens and
    logits against the stock model, print the table and draw the PNG."""
    import transformers

    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        ckpt = root / f"gemma3n-tiny-tf{transformers.__version__}"
        had = (ckpt / "model.safetensors").is_file()
        build_checkpoint(ckpt, tiny_gemma3n_config())
        print(("using" if had else "built") + f" the default checkpoint {ckpt}")
    title = f"Gemma 3n ({ckpt.name})"
    results, bench, _ = _run(args, ckpt, title)
    where = str(bench.device) if bench.cuda else "the CPU (no CUDA device)"
    return _finish(args, results, bench, f"{title} on {where}")


def bench_main(args: Any) -> int:
    """The side-by-side benchmark; appends its table to ``--markdown`` in BENCHMARKS.md form."""
    import transformers

    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    build_dev = _device(args.device).type  # random init on the GPU is much faster
    if args.model == "tiny":
        cfg = tiny_gemma3n_config()
        if args.layers:
            cfg = relayer(cfg, args.layers, tiny=True)
        ckpt = root / f"gemma3n-tiny{args.layers or ''}-tf{transformers.__version__}"
    elif args.model == "e2b":
        cfg = e2b_gemma3n_config()
        if args.layers:
            cfg = relayer(cfg, args.layers, tiny=False)
        ckpt = root / f"gemma3n-e2b-shaped{args.layers or ''}-tf{transformers.__version__}"
    else:
        ckpt, cfg = Path(args.model), None
    if cfg is not None:
        t0 = time.perf_counter()
        build_checkpoint(ckpt, cfg, device=build_dev)
        print(f"checkpoint {ckpt} ready in {time.perf_counter() - t0:.1f} s")
    title = f"{ckpt.name}, {args.page_cache} page cache"
    results, bench, _ = _run(args, ckpt, title)
    rc = _finish_bench(args, results, bench, title)
    if args.qwen:
        rc |= qwen_main(root, device=args.device)
    return rc


def relayer(cfg: Any, layers: int, *, tiny: bool) -> Any:
    """``cfg`` with ``layers`` layers: transformers' default attention pattern, a third of
    the layers KV-shared where the pattern allows it (every shared layer needs a
    non-shared layer of its type), activation sparsity as the default gives it."""
    d = cfg.to_dict()
    for k in ("layer_types", "activation_sparsity_pattern", "intermediate_size"):
        d.pop(k, None)
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    shared = layers // 3
    while shared and not set(types[layers - shared :]) <= set(types[: layers - shared]):
        shared -= 1
    d["num_hidden_layers"] = layers
    d["layer_types"] = types
    d["num_kv_shared_layers"] = shared
    d["intermediate_size"] = cfg.intermediate_size[0]
    if tiny:
        d["activation_sparsity_pattern"] = [0.95] + [0.0] * (layers - 1)
    return type(cfg)(**{k: v for k, v in d.items() if k not in ("transformers_version",)})


def _finish_bench(args: Any, results: list[RunResult], bench: GemmaBench, title: str) -> int:
    from . import report

    if args.markdown:
        import torch

        dev = _device(args.device)
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        import transformers

        with open(args.markdown, "a") as f:
            f.write(
                f"\n### {title}\n\n{gpu}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}; {args.steps} steps a run; "
                f"`python -m ple_memops bench --model {args.model} --batch "
                f"{','.join(map(str, args.batch))} --styles {','.join(args.styles)} "
                f"--page-cache {args.page_cache}`\n\n"
            )
            f.write(report.markdown(results, bench.cuda) + "\n\n")
            if not bench.cuda:
                f.write(f"- {report.CPU_TIMINGS}\n")
            table_bytes = bench.served.server.table_bytes
            for line in report.summary(results, table_bytes, _shapes(bench), bench.cuda):
                f.write(f"- {line}\n")
    return _finish(args, results, bench, title)


def qwen_main(root: Path, *, device: str | None = None, steps: int = 16) -> int:
    """Build (if missing) a tiny random Qwen4Exp checkpoint under ``root`` and run
    :func:`~ple_memops.demo.qwen.qwen_check` on it; print what it found. Returns 0 when
    every run was bit-identical to the stock model."""
    import transformers

    from .checkpoints import tiny_qwen4exp_config
    from .qwen import qwen_check

    ckpt = root / f"qwen4exp-tiny-tf{transformers.__version__}"
    build_checkpoint(ckpt, tiny_qwen4exp_config())
    rep = qwen_check(ckpt, steps=steps, device=device)
    print(
        f"Qwen4Exp ({ckpt.name}): tables "
        + ", ".join(f"{n}: {r} rows x {b} B" for n, (r, b) in rep.tables.items())
    )
    for name, ok in rep.runs.items():
        print(
            f"  {name}: {'bit-identical' if ok else 'DIFFER'} to the stock model "
            f"({rep.steps} steps, batch {rep.batch})"
        )
    print(f"  capture: {rep.capture}")
    stock_b, served_b = rep.gpu_bytes
    if stock_b is not None and served_b is not None:
        tables = sum(r * b for r, b in rep.tables.values())
        mib = 2**20
        print(
            f"  GPU memory: stock model {stock_b / mib:,.2f} MiB, served {served_b / mib:,.2f} "
            f"MiB: saved {(stock_b - served_b) / mib:,.2f} MiB (tables {tables / mib:,.2f} MiB)"
        )
    for n in rep.notes:
        print(f"  note: {n}")
    return 0 if all(rep.runs.values()) else 1
