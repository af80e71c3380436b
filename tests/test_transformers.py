"""ple_memops.transformers and the harness that runs it (ple_memops.demo) on the CPU,
against transformers' own Gemma 3n and Qwen4Exp: checkpoints written by
``save_pretrained``, the stock models as the reference, logits compared bit for bit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ple_memops import MmapTable, TableError  # noqa: E402
from ple_memops.demo.checkpoints import (  # noqa: E402
    build_checkpoint,
    tiny_gemma3n_config,
    tiny_qwen4exp_config,
)
from ple_memops.transformers import (  # noqa: E402
    TableMismatchError,
    TableMissingError,
    UnsupportedModelError,
    serve,
)

GEMMA_KEY = "model.embed_tokens_per_layer.weight"


def _bits(t: Any) -> Any:
    return t.view(torch.int16)


@pytest.fixture(scope="module")
def gemma_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gemma") / "tiny", tiny_gemma3n_config())


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny", tiny_qwen4exp_config())


def _gemma(ckpt: Path, dtype: Any = None) -> Any:
    return transformers.Gemma3nForCausalLM.from_pretrained(
        str(ckpt), dtype=dtype or torch.bfloat16, attn_implementation="sdpa"
    ).eval()


def test_import_is_lazy() -> None:
    code = (
        "import sys, ple_memops.transformers; "
        "print('transformers' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_checkpoint_is_what_save_pretrained_wrote(gemma_ckpt: Path) -> None:
    cfg = json.loads((gemma_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "gemma3n_text"
    t = MmapTable.open(gemma_ckpt, GEMMA_KEY)
    assert (t.rows, t.row_bytes, t.dtype) == (384, 4 * 16 * 2, "BF16")
    # built once: a second call with the same config reuses the files
    mtime = (gemma_ckpt / "model.safetensors").stat().st_mtime_ns
    build_checkpoint(gemma_ckpt, tiny_gemma3n_config())
    assert (gemma_ckpt / "model.safetensors").stat().st_mtime_ns == mtime


def test_gathered_rows_are_the_stock_table_bytes(gemma_ckpt: Path) -> None:
    stock = _gemma(gemma_ckpt)
    w = stock.model.embed_tokens_per_layer.weight.detach()
    table = MmapTable.open(gemma_ckpt, GEMMA_KEY)
    ids = np.random.default_rng(1).integers(0, table.rows, 257)
    got = table.gather(ids)
    want = w[torch.from_numpy(ids)].contiguous().view(torch.uint8).numpy()
    assert np.array_equal(got, want)


def test_serve_drops_the_table_and_matches_stock(gemma_ckpt: Path) -> None:
    stock = _gemma(gemma_ckpt)
    model = _gemma(gemma_ckpt)
    served = serve(model, gemma_ckpt)
    names = [n for n, _ in model.named_parameters()] + list(model.state_dict())
    assert not any("embed_tokens_per_layer" in n for n in names)
    assert served.kind == "gemma3n" and served.server.table_bytes == 384 * 128
    ids = torch.randint(3, 384, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = stock(ids).logits
        b = model(ids).logits
    assert torch.equal(_bits(a), _bits(b))
    assert served.server.eager_gathers == 1 and served.server.eager_rows == 27
    served.close()


def test_generate_with_static_cache_matches_stock(gemma_ckpt: Path) -> None:
    stock = _gemma(gemma_ckpt)
    model = _gemma(gemma_ckpt)
    serve(model, gemma_ckpt)
    ids = torch.randint(3, 384, (2, 5), generator=torch.Generator().manual_seed(2))
    # transformers 5.17's text model indexes the table with soft-token ids (>= 384) and
    # fails; real checkpoints never emit them greedily (their rows copy the pad row).
    kw = dict(
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        suppress_tokens=list(range(384, 512)),
    )
    assert torch.equal(stock.generate(ids, **kw), model.generate(ids, **kw))


def test_ids_outside_the_table_read_row_zero(gemma_ckpt: Path) -> None:
    # Stock semantics of Gemma3nModel (and of the 5.24 text model): soft-token ids
    # (>= vocab_size_per_layer_input) read row 0 of the per-layer table.
    model = _gemma(gemma_ckpt)
    served = serve(model, gemma_ckpt)
    mod = served.modules["embed_tokens_per_layer"]
    with torch.no_grad():
        out = mod(torch.tensor([[0, 383, 384, 511]]))
        ref = mod(torch.tensor([[0, 383, 0, 0]]))
    assert torch.equal(_bits(out), _bits(ref))


def test_bench_cpu_path_every_variant_identical(gemma_ckpt: Path) -> None:
    # The captured step's code path (rows from the plan's staging buffer, filled before
    # each step; the late consumer placement) run eagerly on the CPU, against stock.
    from ple_memops.demo.cli import load_gemma
    from ple_memops.demo.runner import GemmaBench

    served, stock = load_gemma(gemma_ckpt, torch.device("cpu"))
    bench = GemmaBench(served, stock, device="cpu")
    variants, skipped = bench.available()
    assert variants == ["gpu-table", "sync-gather", "fallback"]
    assert set(skipped) == {"pinned-uva", "deferred-host", "deferred-device"}
    seen: list[str] = []
    bench.progress = seen.append
    results = bench.run_batch(
        3, 6, variants=variants, styles=["sync"], placements=["early", "late"]
    )
    # What the progress bar is sized by is what reports progress (a capture counts with
    # the run that follows it): the recording and one run per variant and placement.
    ran = [s for s in seen if not s.endswith("capture")]
    assert len(ran) == bench.planned_runs(variants, ["sync"], ["early", "late"]) == 5
    got = {(r.variant, r.placement) for r in results}
    assert got == {
        ("gpu-table", "-"),
        ("sync-gather", "early"),
        ("fallback", "early"),
        ("fallback", "late"),
    }
    for r in results:
        assert r.tokens_identical and r.logits_identical, r
        assert r.tokens.shape == (6, 3)
    fb = [r for r in results if r.variant == "fallback"]
    assert all(r.mode == "host" for r in fb)
    assert served.server.steps is None  # each variant closes its steps
    served.close()


def test_bench_runs_start_from_the_recordings_state(gemma_ckpt: Path) -> None:
    # Every run checks, after its prefill, the state its steps read (KV cache, counters,
    # token and position, prefill logits, memoised constants, weights) against the
    # recording's: a clean run reports nothing, the report says so.
    from ple_memops.demo import report
    from ple_memops.demo.cli import load_gemma
    from ple_memops.demo.runner import GemmaBench

    served, stock = load_gemma(gemma_ckpt, torch.device("cpu"))
    bench = GemmaBench(served, stock, device="cpu")
    results = bench.run_batch(
        2,
        5,
        variants=["gpu-table", "sync-gather", "fallback"],
        styles=["sync"],
        placements=["late"],
    )
    assert [r.state_diff for r in results] == [[], [], []]
    assert any("every run started from the recording's state" in x for x in report.summary(results))
    served.close()


@pytest.mark.parametrize("what", ["weights", "kv-cache", "constants"])
def test_bench_names_state_that_changed_between_runs(gemma_ckpt: Path, what: str) -> None:
    # Something changed behind the runner's back between the recording and the timed
    # runs (a stray write into a weight, a cache position the prefill's reset misses, a
    # memoised constant): the runs that differ say which state they started from.
    from ple_memops.demo import capture, report
    from ple_memops.demo.cli import load_gemma
    from ple_memops.demo.runner import GemmaBench

    served, stock = load_gemma(gemma_ckpt, torch.device("cpu"))
    bench = GemmaBench(served, stock, device="cpu")
    check_eager = bench.check_eager
    undo: list[Any] = []

    def tamper(dec: Any, record: Any) -> bool:
        ok = check_eager(dec, record)
        with torch.no_grad():
            if what == "weights":
                w = served.model.model.layers[0].mlp.down_proj.weight
                old = w[0, 0].clone()
                w[0, 0] += 1.0
                undo.append(lambda: w[0, 0].copy_(old))
            elif what == "kv-cache":
                layer = dec.cache.layers[1]
                reset = layer.reset

                def leaky_reset() -> None:  # a reset that leaves the last position
                    last = layer.keys[..., -1, :].clone()
                    reset()
                    layer.keys[..., -1, :] = last + 1

                layer.reset = leaky_reset
            else:
                _, t = next(capture.memoised_constants())
                old = t.clone()
                t.add_(1)
                undo.append(lambda: t.copy_(old))
        return ok

    bench.check_eager = tamper  # type: ignore[method-assign]
    try:
        results = bench.run_batch(
            1, 4, variants=["gpu-table", "sync-gather"], styles=["sync"], placements=["early"]
        )
    finally:
        for u in undo:
            with torch.no_grad():
                u()
    want = {"weights": "weights", "kv-cache": "kv-cache layer 1", "constants": "memoised constants"}
    for r in results:
        assert r.state_diff is not None and want[what] in r.state_diff, r
        if what == "kv-cache":  # a position past the prompt: nothing else moves
            assert r.state_diff == [want[what]], r
    text = report.text_table(results)
    assert "started from a different " in text and want[what] in text
    served.close()


def test_published_ids_live_until_the_consumer_joined(gemma_ckpt: Path) -> None:
    # Under capture the publish reads the ids on the rows' side stream, which the
    # capturing stream waits for only at the join: with a late consumer placement, layers
    # run in between, and if the ids' last reference went with rows_for, torch could hand
    # their block to one of those layers' outputs. The ticket holds them until the join.
    import gc
    import weakref

    from ple_memops.transformers._models import GEMMA3N_TABLE

    model = _gemma(gemma_ckpt)
    served = serve(model, gemma_ckpt)
    server = served.server
    seen: dict[str, Any] = {}

    class Staged:
        def join(self) -> None:
            seen["alive at join"] = seen["ids"]() is not None

    class Plan:  # the deferred steps' stage(), as rows_for calls it
        mode, deferred = "deferred", True

        def stage(self, name: str, ids: Any, rows: int) -> Staged:
            seen["ids"] = weakref.ref(ids)  # the worker keeps no reference either
            return Staged()

        def staging(self, name: str, n: int) -> Any:
            return torch.zeros((n, 4), dtype=torch.uint8)

    tickets: list[Any] = []
    server.steps, server.source, server.graph_path = Plan(), "device", True
    server.consume_later(GEMMA3N_TABLE, tickets.append)
    try:
        server.rows_for(GEMMA3N_TABLE, torch.tensor([[5], [7]]))
        gc.collect()
        assert seen["ids"]() is not None, "the published ids were freed before the join"
        tickets.pop().consume()
        gc.collect()
    finally:
        server.steps, server.source, server.graph_path = None, "device", False
        server.consume_later(GEMMA3N_TABLE, None)
    assert seen["alive at join"]
    assert seen["ids"]() is None  # and released once joined
    served.close()


def test_attention_backend_is_checked_and_pinned(gemma_ckpt: Path) -> None:
    from torch.nn.attention import SDPBackend

    from ple_memops.demo.cli import load_gemma
    from ple_memops.demo.runner import GemmaBench
    from ple_memops.errors import InvalidArgumentError

    served, stock = load_gemma(gemma_ckpt, torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="attention"):
        GemmaBench(served, stock, device="cpu", attention="flash")
    bench = GemmaBench(served, stock, device="cpu")
    assert bench.attention == "math"
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled)
    before = [f() for f in flags]
    with bench.attention_scope():
        assert not any(f() for f in flags)
        assert torch.backends.cuda.math_sdp_enabled()
    assert [f() for f in flags] == before
    with GemmaBench(served, stock, device="cpu", attention="default").attention_scope():
        assert [f() for f in flags] == before
    assert SDPBackend.MATH is not None
    served.close()


def test_late_placement_changes_nothing_eagerly(gemma_ckpt: Path) -> None:
    stock = _gemma(gemma_ckpt)
    model = _gemma(gemma_ckpt)
    served = serve(model, gemma_ckpt, placement="late")
    ids = torch.randint(3, 384, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(_bits(stock(ids).logits), _bits(model(ids).logits))
    served.set_placement("early")
    assert "project_per_layer_inputs" not in served.text_model.__dict__
    with pytest.raises(UnsupportedModelError):
        served.set_placement("sideways")
    served.close()


# -- refusals -------------------------------------------------------------------------------


def test_unknown_model_is_refused(gemma_ckpt: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="not a supported PLE model"):
        serve(torch.nn.Linear(2, 2), gemma_ckpt)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        serve(transformers.LlamaForCausalLM(cfg), gemma_ckpt)


def test_serving_twice_is_refused(gemma_ckpt: Path) -> None:
    model = _gemma(gemma_ckpt)
    serve(model, gemma_ckpt)
    with pytest.raises(UnsupportedModelError, match="already served"):
        serve(model, gemma_ckpt)


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(edit(tensors), str(dst / "model.safetensors"))
    return dst


def test_table_missing_is_refused(gemma_ckpt: Path, tmp_path: Path) -> None:
    bad = _rewrite(
        gemma_ckpt, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != GEMMA_KEY}
    )
    model = _gemma(gemma_ckpt)
    with pytest.raises(TableMissingError, match="embed_tokens_per_layer") as e:
        serve(model, bad)
    assert isinstance(e.value, TableError)
    # nothing was swapped: the model still holds its own table
    assert type(model.model.embed_tokens_per_layer).__name__ == "Gemma3nTextScaledWordEmbedding"


def test_dtype_width_and_rows_mismatch_are_refused(gemma_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(TableMismatchError, match=r"BF16.*float32"):
        serve(_gemma(gemma_ckpt, torch.float32), gemma_ckpt)

    def narrow(t: dict[str, Any]) -> dict[str, Any]:
        return {**t, GEMMA_KEY: t[GEMMA_KEY][:, :32].contiguous()}

    with pytest.raises(TableMismatchError, match="64 bytes"):
        serve(_gemma(gemma_ckpt), _rewrite(gemma_ckpt, tmp_path / "narrow", narrow))

    def short(t: dict[str, Any]) -> dict[str, Any]:
        return {**t, GEMMA_KEY: t[GEMMA_KEY][:100].contiguous()}

    with pytest.raises(TableMismatchError, match="100 rows"):
        serve(_gemma(gemma_ckpt), _rewrite(gemma_ckpt, tmp_path / "short", short))


def test_real_checkpoint_tensor_name_is_found(gemma_ckpt: Path, tmp_path: Path) -> None:
    # The released (multimodal) checkpoints name the table
    # model.language_model.embed_tokens_per_layer.weight.
    def rename(t: dict[str, Any]) -> dict[str, Any]:
        return {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}

    mm = _rewrite(gemma_ckpt, tmp_path / "mm", rename)
    stock = _gemma(gemma_ckpt)
    model = _gemma(gemma_ckpt)
    served = serve(model, mm)
    assert served.server.specs["embed_tokens_per_layer"].tensor == (
        "model.language_model.embed_tokens_per_layer.weight"
    )
    ids = torch.randint(3, 384, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(_bits(stock(ids).logits), _bits(model(ids).logits))


# -- Qwen4Exp -------------------------------------------------------------------------------


def test_qwen4exp_shards_are_served_and_eager_identical(qwen_ckpt: Path) -> None:
    from ple_memops.demo.qwen import qwen_check

    model = transformers.Qwen4ExpForCausalLM.from_pretrained(str(qwen_ckpt), dtype=torch.bfloat16)
    stock_w = {
        i: layer.ple.ple_embedding.ngram_embedding.weight.detach().clone()
        for i, layer in enumerate(model.model.layers)
        if layer.ple is not None
    }
    served = serve(model, qwen_ckpt)
    assert served.kind == "qwen4exp" and set(served.tables) == {"layers.0", "layers.2"}
    for name, table in served.tables.items():
        spec = served.server.specs[name]
        assert spec.pattern is not None and "shard_{}" in spec.pattern
        assert spec.ids_per_token == 4
        w = stock_w[int(name.split(".")[1])]
        assert table.rows == w.shape[0]
        ids = np.arange(table.rows)
        assert np.array_equal(table.gather(ids), w.contiguous().view(torch.uint8).numpy())
    assert not any("ngram_embedding" in n for n, _ in model.named_parameters())
    served.close()

    rep = qwen_check(qwen_ckpt, batch=2, steps=5, device="cpu")
    assert rep.runs == {"mmap-eager": True}
    assert "no CUDA" in rep.capture


def test_qwen4exp_missing_table_is_refused(qwen_ckpt: Path, tmp_path: Path) -> None:
    bad = _rewrite(
        qwen_ckpt,
        tmp_path / "bad",
        lambda t: {k: v for k, v in t.items() if "layers.2.ple.ple_embedding.ngram" not in k},
    )
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(str(qwen_ckpt), dtype=torch.bfloat16)
    with pytest.raises(TableMissingError, match="layer 2"):
        serve(model, bad)


# -- the command line -----------------------------------------------------------------------


def test_cli_demo_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ple_memops.__main__ import main

    png = tmp_path / "demo.png"
    rc = main(
        [
            "demo",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--steps",
            "3",
            "--batch",
            "2",
            "--no-progress",
            "--png",
            str(png),
            "--json",
            str(tmp_path / "demo.json"),
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "built the default checkpoint" in out
    assert "skipped deferred-device: needs a CUDA GPU" in out
    assert "runs: tokens identical and logits bit-identical" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    assert {r["variant"] for r in data["runs"]} == {"gpu-table", "sync-gather", "fallback"}
    assert all(r["logits_identical"] in (None, True) for r in data["runs"])


def test_cli_demo_as_a_newcomer_runs_it_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The README's command as is (progress bar on, no --png), from a directory of one's own.
    pytest.importorskip("tqdm")
    import tempfile

    from ple_memops.__main__ import main

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc = main(
        [
            *("demo", "--cache-dir", str(tmp_path / "cache")),
            *("--steps", "3", "--batch", "1,2", "--device", "cpu"),
        ]
    )
    got = capsys.readouterr()
    out, err = got.out, got.err
    assert rc == 0, out + err
    # The bar counts what runs here (5 runs a batch on the CPU) and ends full.
    counts = re.findall(r"(\d+)/(\d+) \[[^]]*run", err)  # ours (unit: run), not transformers'
    assert counts and {total for _, total in counts} == {"10"}, err
    assert counts[-1] == ("10", "10"), err
    # A log record is written above the bar, on a line of its own, once: every variant
    # and batch builds a plan that takes the host path for the same reason.
    pieces = re.split(r"[\r\n]", err)
    logged = [p for p in pieces if "use the host path" in p]
    assert len(logged) == 1 and logged[0].startswith("ple_memops: PLE rows"), err
    # The reference is named for what it is here: no GPU table without a GPU.
    assert "gpu-table" not in out and "GPU-table" not in out, out
    assert "in-memory table  -" in out and "vs in-memory table" in out, out
    assert "bit-identical to the in-memory table reference" in out
    # A word where timings are noise; the memory saved, computed from the table's shape.
    assert "CPU timings are not meaningful for the deferred protocol" in out
    assert (
        "memory, computed from the table (384 rows x 128 B): on a GPU the table would hold "
        "48.00 KiB of GPU memory, the deferred path instead 256 B on the GPU (staging, "
        "batch 2) and 256 B pinned: it would save 47.75 KiB of GPU memory; here the "
        "in-memory table holds 48.00 KiB of host memory, the served path 512 B (staging "
        "and slot)"
    ) in out
    # The PNG goes where the command was run, under a name of its own, not to the shared
    # temporary directory (where torch may keep caches of its own).
    assert not list((tmp_path / "tmp").glob("*.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "PNG skipped" in out
        assert list(cwd.iterdir()) == []
    else:
        assert list(cwd.iterdir()) == [cwd / "ple_memops_demo.png"]
        assert f"PNG written: {cwd / 'ple_memops_demo.png'}" in out


def test_cli_bench_writes_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ple_memops.__main__ import main

    md = tmp_path / "bench.md"
    rc = main(
        [
            "bench",
            "--model",
            "tiny",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--steps",
            "2",
            "--batch",
            "1",
            "--variants",
            "gpu-table,sync-gather",
            "--no-progress",
            "--markdown",
            str(md),
            "--device",
            "cpu",
        ]
    )
    assert rc == 0, capsys.readouterr().out
    text = md.read_text()
    assert "| batch | style | variant |" in text and "| 1 | sync | sync-gather |" in text


def test_cli_check_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from ple_memops.__main__ import main

    assert main(["check", "--cpu", "--steps", "2"]) == 0
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "{demo,bench,check}" in out
    assert "``" not in out, out  # plain text, not reStructuredText
    # Every option of every command says what it does, and its default.
    for command in ("demo", "bench", "check"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and ":class:" not in text, text
        flat = " ".join(text.split())
        want = {
            "demo": (
                "--steps N decode steps per run (default: 64)",
                "(default: 1,4)",
                "(default: ple_memops_demo.png in the current directory",
            ),
            "bench": (
                "--steps N decode steps per run (default: 256)",
                "(default: 1,8,64)",
                "(default: e2b)",
                "(default: warm)",
                "(default: sync,async)",
            ),
            "check": ("(default: 100)", "(default: 160)"),
        }[command]
        for w in want:
            assert w in flat, (command, w, text)
        lines = text.splitlines()
        # "  --flag METAVAR   help", or the help on the next line, indented past the flags
        options = [i for i, line in enumerate(lines) if line.startswith("  -")]
        assert len(options) > 4, lines
        for i in options:
            inline = re.match(r"^  -\S.*?\s{2,}\S", lines[i])
            below = i + 1 < len(lines) and re.match(r"^ {20,}\S", lines[i + 1])
            assert inline or below, (command, lines[i])


def _runs(captured: bool, step_us: float) -> list[Any]:
    from ple_memops.demo.runner import RunResult

    steps = [step_us + (i % 3) for i in range(8)]
    out = []
    for variant, placement in (("gpu-table", "-"), ("sync-gather", "early"), ("fallback", "late")):
        ok = variant != "fallback"
        out.append(
            RunResult(
                variant, 2, "sync", placement, 8, steps, captured,
                tokens_identical=ok, logits_identical=ok, first_mismatch=None if ok else 5,
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize("cuda", [False, True])
def test_plot_shows_identity_memory_and_plain_timings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool
) -> None:
    # What a person should see on each machine: the runs bit-identical to the reference
    # (named for what it is there), the memory the table costs against the served path's,
    # and timing axes that read as they are (no offset like "1e6" or "+2.14e4").
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ple_memops.demo import report

    seen: list[str] = []
    offsets: list[str] = []
    save = Figure.savefig

    def savefig(fig: Any, *args: Any, **kwargs: Any) -> Any:
        fig.canvas.draw()
        seen.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text))
        offsets.extend(ax.yaxis.get_offset_text().get_text() for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    png = tmp_path / "out.png"
    runs = _runs(cuda, 21_400.0 if cuda else 1_000_000.0)
    said = report.plot(runs, png, "t", {"t": (384, 128)})
    assert said == f"PNG written: {png}" and png.read_bytes()[:4] == b"\x89PNG"
    text = "\n".join(seen)
    ref = "gpu-table" if cuda else "in-memory table"
    assert f"rows: 2/3 runs bit-identical to the {ref} reference" in text, text
    assert "identical" in seen and "DIFFER\nat step 5" in seen
    assert f"{ref} (reference):\nevery row in {'GPU' if cuda else 'host'} memory" in seen
    assert "48.00 KiB" in text and "256 B" in text
    assert ("gpu-table" in text) == cuda and ("the times are noise" in text) != cuda
    assert offsets and not any(offsets), offsets


def test_capture_patch_memoises_scalars_only_in_scope() -> None:
    from ple_memops.demo.capture import _MemoTorch

    memo = _MemoTorch(torch)
    # outside a scope: torch itself (module construction never shares a tensor)
    assert memo.tensor(1e-5) is not memo.tensor(1e-5)
    memo._scope.device = torch.device("cpu")
    a = memo.tensor(1e-5)
    assert memo.tensor(1e-5) is a and a.dtype == torch.float32 and a.device.type == "cpu"
    b = memo.tensor(0.95, dtype=torch.float32, device="cpu")
    assert memo.tensor(0.95, dtype=torch.float32, device="cpu") is b and b is not a
    lst = memo.tensor([1.0, 2.0])
    assert memo.tensor([1.0, 2.0]) is not lst  # not memoised
    assert memo.zeros is torch.zeros
    memo._scope.device = None


def test_tensor_parallel_two_ranks_on_the_cpu(tmp_path: Path) -> None:
    # Two gloo ranks, each serving the table from the one checkpoint: TP 2 (deferred path
    # on the host plan) against TP 2 with the stock table, and against TP 1.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "ple_memops.demo.tp",
            "--model",
            "small",
            "--layers",
            "5",
            "--dtype",
            "float32",
            "--batch",
            "2",
            "--steps",
            "3",
            "--device",
            "cpu",
            "--cache-dir",
            str(tmp_path),
            "--require-identical-tokens",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rank0 = [x for x in out.stdout.splitlines() if x.startswith("[rank 0] batch")]
    lines = [x for x in rank0 if "prefill logits" not in x]
    assert len(lines) == 2, out.stdout
    # The prefill logits: TP 2 against TP 1, and the model's own 1-ulp sensitivity.
    pre = [x for x in rank0 if "prefill logits" in x]
    assert len(pre) == 2 and all("argmax same in 2 of 2 rows" in x for x in pre), pre
    tp_diff = float(re.search(r"TP2 vs TP1: max \|diff\| ([0-9.e+-]+)", out.stdout)[1])
    assert 0 <= tp_diff < 1e-4, tp_diff  # fp32: rounding, not a sharding error
    for line in lines:
        assert "logits bit-identical" in line and "tokens vs TP1: identical" in line
    assert "tokens identical on all 2 ranks: True" in out.stdout
    assert "every rank's checks passed: True" in out.stdout
    assert "'mlp_whole': 1" in out.stdout  # the activation-sparse layer's MLP stays whole
