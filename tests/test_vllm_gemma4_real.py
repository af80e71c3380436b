"""Gemma 4's per-layer embedding table through the plugin, against the real vLLM (0.33.0, 0.34.0) on
the CPU (``VLLM_TARGET_DEVICE=cpu``), with checkpoints transformers wrote
(``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration``'s ``save_pretrained``).
Skipped, with the reason, where vLLM is not installed (``scripts/test.sh`` runs this file
in its vLLM environment).

What runs here: both classes built by vLLM's own loader with the switch on, the table
neither read (in a file of its own) nor allocated, or read and dropped (in a file with
other weights); the per-layer inputs of the stock model and ours bit for bit, eager and
compiled by Inductor (the stock graph and ours compiled alike), ids outside the table
reading row 0, image positions reading row 0 through the multimodal class's own
``embed_input_ids``; the config hook's graph mode, async scheduling and refusals; a
checkpoint whose table is missing or does not match; and that the GPU engine tests'
checkpoint can tell engines apart (decisive greedy choices, sensitive to its rows). The
engine on the GPU: ``test_vllm_gemma4_engine_gpu.py``.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
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
from vllm.config import (  # noqa: E402
    CompilationConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)

import ple_memops as pm  # noqa: E402
from ple_memops.vllm import gemma4, ops  # noqa: E402

dist = vllm_cpu.dist  # the fixtures
installed = vllm_cpu.installed
_attach = vllm_cpu.attach_hooks


def _ids(n: int, seed: int) -> torch.Tensor:
    return vllm_cpu.token_ids(n, seed, TABLE_ROWS, -1)  # outside the table: row 0


MMAP = {"ple_memops": {"table_backend": "mmap"}}
# Whole rows joined at decoder layer 0's gate, run eagerly (split_rows is on by default).
WHOLE = {"ple_memops": {"table_backend": "mmap", "split_rows": False}}
TABLE_ROWS = ckpts.GEMMA4_CONFIG["vocab_size_per_layer_input"]


@pytest.fixture(scope="module", params=["text", "mm"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma4")
    return ckpts.write_gemma4_checkpoint(root, multimodal=request.param == "mm")


def _config(ckpt: Path, *, mmap: bool, **kw: Any) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16"),
        load_config=LoadConfig(load_format="safetensors"),
        additional_config=MMAP if mmap else {"ple_memops": {"table_backend": "default"}},
        **kw,
    )


def _language(model: Any) -> Any:
    """The ``Gemma4Model`` of either class."""
    return model.language_model.model if hasattr(model, "language_model") else model.model


def _per_layer_inputs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's per-layer inputs for ``ids``, as its forward computes them."""
    lm = _language(model)
    embeds = lm.embed_input_ids(ids.clamp(0, 127))
    out: torch.Tensor = lm.project_per_layer_inputs(embeds, lm.get_per_layer_inputs(ids))
    return out


def _joined_at_gate(
    model: Any, stock: Any, mmap_cfg: Any, stock_cfg: Any, layers_n: int, split: bool = False
) -> None:
    """Run eagerly, our per-layer inputs are still the projection after
    ``project_per_layer_inputs`` and become the stock model's, bit for bit, once decoder
    layer 0's per-layer input gate (their first consumer) is called. ``split``: only
    layer 0's slice then, every later one's once layer 1's gate is called."""
    lm = _language(model)
    gates = [lm.layers[0].per_layer_input_gate, lm.layers[1].per_layer_input_gate]
    hidden = ckpts.GEMMA4_CONFIG["hidden_size"]
    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    try:
        for n, seed in ((1, 1), (9, 2), (40, 3)):
            ids = _ids(n, seed)
            with set_current_vllm_config(stock_cfg):
                want = _per_layer_inputs(stock, ids)
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                got = _per_layer_inputs(model, ids)
                projection = lm.project_per_layer_inputs(
                    lm.embed_input_ids(ids.clamp(0, 127)), None
                )
                assert torch.equal(got, projection)  # not joined yet
                gates[0](torch.zeros(n, hidden, dtype=torch.bfloat16))
                if split:
                    assert torch.equal(got[:, 0], want[:, 0])
                    assert torch.equal(got[:, 1:], projection[:, 1:])  # not joined yet
                    gates[1](torch.zeros(n, hidden, dtype=torch.bfloat16))
            assert got.shape == want.shape == (n, layers_n, 16) and want.abs().sum() > 0
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            _per_layer_inputs(model, _ids(4, 7))
            if split:  # layer 0's slice joined, the rest not: refused too
                gates[0](torch.zeros(4, hidden, dtype=torch.bfloat16))
            with pytest.raises(pm.StateError, match="never joined"):
                _per_layer_inputs(model, _ids(4, 7))
    finally:
        hooks.shutdown()


def test_the_model_loads_without_its_table_and_its_inputs_are_the_stock_models(
    checkpoint: Path, dist: Any, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = vllm_cpu.spy_loaded_files(monkeypatch)
    mmap_cfg = _config(checkpoint, mmap=True)
    model, _ = vllm_cpu.load_model(mmap_cfg)
    assert type(model) in (gemma4.Gemma4MmapForCausalLM, gemma4.Gemma4MmapForConditionalGeneration)
    # The table's file was not read; nothing of the table was allocated.
    assert kept == [["model-rest.safetensors"]]
    (table,) = gemma4.find_mmap_tables(model)
    assert table.weight.numel() == 0 and table.org_vocab_size == TABLE_ROWS
    monkeypatch.undo()
    stock_cfg = _config(checkpoint, mmap=False)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    assert not gemma4.find_mmap_tables(stock)  # the switch is per engine
    assert not hasattr(stock, "is_unused_checkpoint_weight")

    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    staged: list[torch.Tensor] = []
    stage = table.stage
    table.stage = lambda ids: (staged.append(ids.clone()), stage(ids))[1]
    try:
        assert hooks.steps.mode == "host" and hooks.layer_names == [table.ple_memops_name]
        for n, seed in ((1, 1), (9, 2), (40, 3)):
            ids = _ids(n, seed)
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                got = _per_layer_inputs(model, ids)
            # The model stages the token ids, row 0 for ids outside the table.
            expected = torch.where((ids >= 0) & (ids < TABLE_ROWS), ids, 0).reshape(-1)
            assert staged[-1].tolist() == expected.tolist()
            assert expected[0] == 0 and (n == 1 or expected[-1] == 0)  # ids[0], ids[-1] outside
            with set_current_vllm_config(stock_cfg):
                want = _per_layer_inputs(stock, ids)
            assert got.shape == want.shape == (n, 4, 16) and want.abs().sum() > 0
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        # Compiled by Inductor (as vLLM compiles Gemma 4), ours and the stock model's
        # graphs give the same bits; eager and compiled differ (fused arithmetic), so the
        # comparison can tell.
        ours = torch.compile(
            lambda ids: _per_layer_inputs(model, ids), fullgraph=True, dynamic=True
        )
        theirs = torch.compile(
            lambda ids: _per_layer_inputs(stock, ids), fullgraph=True, dynamic=True
        )
        differs_from_eager = False
        for n, seed in ((8, 4), (13, 5)):
            ids = _ids(n, seed)
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                got = ours(ids)
            with set_current_vllm_config(stock_cfg):
                want = theirs(ids)
                differs_from_eager |= not torch.equal(want, _per_layer_inputs(stock, ids))
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        assert differs_from_eager
    finally:
        table.stage = stage
        hooks.shutdown()


# The released E2B's structure at a tiny size: the last layers share KV (vLLM builds them
# as its cross-decoder, without K/V projections, and drops the K/V tensors the checkpoint
# still ships for them), their MLPs double wide, one KV head, full-attention heads wider
# than the sliding ones.
RELEASED_STRUCTURE = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    global_head_dim=128,
)


def test_the_released_structure_kv_shared_layers_double_wide_mlps(
    tmp_path: Path, dist: Any, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = ckpts.write_gemma4_checkpoint(tmp_path / "shared", **RELEASED_STRUCTURE)
    kept = vllm_cpu.spy_loaded_files(monkeypatch)
    mmap_cfg = _config(ckpt, mmap=True, compilation_config=CompilationConfig(mode=0))
    mmap_cfg.additional_config = WHOLE
    model, _ = vllm_cpu.load_model(mmap_cfg)
    assert kept == [["model-rest.safetensors"]]  # the table's file was not read
    monkeypatch.undo()
    stock_cfg = _config(ckpt, mmap=False, compilation_config=CompilationConfig(mode=0))
    stock, _ = vllm_cpu.load_model(stock_cfg)
    lm = _language(model)
    assert len(lm.self_decoder.decoder_layers) == 4 and len(lm.cross_decoder.decoder_layers) == 2
    # Every weight but the table is the stock model's (the shared layers' too).
    table = "embed_tokens_per_layer.weight"
    theirs = dict(_language(stock).named_parameters())
    ours = dict(lm.named_parameters())
    assert table in theirs and set(ours) == set(theirs) - {table}
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    _joined_at_gate(model, stock, mmap_cfg, stock_cfg, layers_n=6)


def test_run_eagerly_the_rows_join_at_layer_0s_gate_with_the_stock_models_bits(
    checkpoint: Path, dist: Any, installed: Any
) -> None:
    # vLLM's -O0 (both classes): the per-layer inputs are still the projection after
    # project_per_layer_inputs, and become the stock model's, bit for bit, when decoder
    # layer 0's per-layer input gate (their first consumer) is called; a forward whose
    # gate never ran is refused at the next one.
    eager = CompilationConfig(mode=0)
    mmap_cfg = _config(checkpoint, mmap=True, compilation_config=eager)
    mmap_cfg.additional_config = WHOLE
    stock_cfg = _config(checkpoint, mmap=False, compilation_config=CompilationConfig(mode=0))
    model, _ = vllm_cpu.load_model(mmap_cfg)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    _joined_at_gate(model, stock, mmap_cfg, stock_cfg, layers_n=4)


def _table_mappings() -> int:
    """Mappings of a per-layer table file in this process: areas that begin at the file's
    offset 0 (advice on part of a mapping splits it into areas at other offsets)."""
    areas = [m.split() for m in Path("/proc/self/maps").read_text().splitlines()]
    return sum(a[-1].endswith("model-ple.safetensors") and int(a[2], 16) == 0 for a in areas)


@pytest.mark.parametrize("structure", ["default", "released", "multimodal"])
def test_split_rows_layer_0s_slice_joins_at_its_gate_and_the_rest_at_layer_1s(
    tmp_path: Path, dist: Any, installed: Any, structure: str
) -> None:
    # split_rows (the default): two tables of one checkpoint tensor (column windows), the
    # rows of the stock model, bit for bit, each slice joined right before its first
    # consumer (the text class at the default and the released structure, and the
    # multimodal class).
    kw: dict[str, Any] = RELEASED_STRUCTURE if structure == "released" else {}
    if structure == "multimodal":
        kw = {"multimodal": True}
    ckpt = ckpts.write_gemma4_checkpoint(tmp_path / structure, **kw)
    layers_n = int(kw.get("num_hidden_layers", 4))
    eager = CompilationConfig(mode=0)
    mmap_cfg = _config(ckpt, mmap=True, compilation_config=eager)
    assert mmap_cfg.additional_config == MMAP  # split_rows unnamed: the default
    stock_cfg = _config(ckpt, mmap=False, compilation_config=CompilationConfig(mode=0))
    model, _ = vllm_cpu.load_model(mmap_cfg)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    want_class = {"multimodal": gemma4.Gemma4MmapForConditionalGeneration}
    assert type(model) is want_class.get(structure, gemma4.Gemma4MmapForCausalLM)
    first, rest = gemma4.find_mmap_tables(model)
    assert first.rest is rest and rest.rest is None
    assert first.columns == (0, 16) and rest.columns == (16, (layers_n - 1) * 16)
    assert (first.ple_memops_layer_index(), rest.ple_memops_layer_index()) == (0, 1)
    assert (first.row_bytes, rest.row_bytes) == (32, (layers_n - 1) * 32)
    assert rest.ple_memops_name == first.ple_memops_name + ".rest"
    # The rest's table gets threads of its own: 8 by default, first_layer_threads' count
    # when set, the shared pool at 0; layer 0's slices are gathered inline.
    for lead, want in ((None, 8), (3, 3), (0, None)):
        lead_cfg = {} if lead is None else {"first_layer_threads": lead}
        mmap_cfg.additional_config = {"ple_memops": MMAP["ple_memops"] | lead_cfg}
        gc.collect()  # the last round's tables, unmapped
        before = _table_mappings()
        hooks = _attach(model, mmap_cfg)
        try:
            assert hooks.layer_names == [first.ple_memops_name, rest.ple_memops_name]
            threads = {n: layer.table.gather_threads for n, layer in hooks.steps.tables.items()}
            assert threads == {first.ple_memops_name: None, rest.ple_memops_name: want}
            assert hooks.steps.tables[rest.ple_memops_name].table.columns == rest.columns
            # One mapping of the table's file serves both windows.
            assert _table_mappings() == before + 1
        finally:
            hooks.shutdown()
            for table in (first, rest):  # as the runner's shutdown does
                table.ple_memops_bind(None, 0)
            del hooks
    mmap_cfg.additional_config = MMAP
    _joined_at_gate(model, stock, mmap_cfg, stock_cfg, layers_n=layers_n, split=True)
    # Compiled, the setting changes nothing: one table, joined where Inductor places it.
    compiled_cfg = _config(ckpt, mmap=True)
    compiled_cfg.additional_config = {"ple_memops": MMAP["ple_memops"] | {"split_rows": True}}
    compiled, _ = vllm_cpu.load_model(compiled_cfg)
    (table,) = gemma4.find_mmap_tables(compiled)
    assert table.columns is None and not table.joins_late


def test_compiled_the_ids_are_staged_before_the_projection_and_joined_after(
    checkpoint: Path, dist: Any, installed: Any
) -> None:
    # Compiled by Inductor (vLLM's default), the text class stages inside the compiled
    # forward: the staging must stay ahead of the projection's matmul (Inductor moves an
    # untagged functional op right before its only consumer, the join, and the host's
    # gather would overlap nothing), the join after it. (The torch vLLM 0.33.0 pins, 2.14,
    # keeps a nondeterministic_seeded op in place; torch 2.11 did not.)
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    mmap_cfg = _config(checkpoint, mmap=True)
    model, _ = vllm_cpu.load_model(mmap_cfg)
    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    compiled = torch.compile(lambda ids: _per_layer_inputs(model, ids), fullgraph=True)
    try:
        with (
            set_current_vllm_config(mmap_cfg),
            hooks.eager(dummy=False),
            ops.layers(layers),
            inductor_config.patch(fx_graph_cache=False),
        ):
            _, codes = run_and_get_code(compiled, _ids(8, 4))
    finally:
        hooks.shutdown()
    calls = [line.strip() for line in "\n".join(codes).splitlines()]

    def first(pred: Any) -> int:
        return next(i for i, line in enumerate(calls) if pred(line))

    stage = first(lambda line: "= torch.ops.ple_memops.stage_ids" in line)
    read = first(lambda line: "= torch.ops.ple_memops.read_rows" in line)
    matmul = first(lambda line: "mm(" in line or "linear" in line)
    assert stage < matmul < read, (stage, matmul, read)


def test_the_multimodal_class_reads_row_0_at_image_positions(
    tmp_path_factory: pytest.TempPathFactory, dist: Any, installed: Any
) -> None:
    ckpt = ckpts.write_gemma4_checkpoint(tmp_path_factory.mktemp("mm"), multimodal=True)
    mmap_cfg, stock_cfg = _config(ckpt, mmap=True), _config(ckpt, mmap=False)
    model, _ = vllm_cpu.load_model(mmap_cfg)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    assert model.per_layer_embeddings is None  # vLLM's rows buffer is not allocated
    hooks = _attach(model, mmap_cfg)
    try:
        ids = _ids(12, 6).clamp(0, 127)
        image = torch.zeros(12, dtype=torch.bool)
        image[3:7] = True  # placeholder positions: their ids read row 0
        with set_current_vllm_config(mmap_cfg):
            embeds = model.embed_input_ids(ids, is_multimodal=image)
        with set_current_vllm_config(stock_cfg):
            want_embeds = stock.embed_input_ids(ids, is_multimodal=image)
        assert torch.equal(embeds, want_embeds)
        assert model.ple_memops_ids[:12].tolist() == torch.where(image, 0, ids).tolist()
        lm, ls = _language(model), _language(stock)
        layers = mmap_cfg.compilation_config.static_forward_context
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            staged = lm.get_per_layer_inputs(model.ple_memops_ids[:12])
            got = lm.project_per_layer_inputs(embeds, staged)
        with set_current_vllm_config(stock_cfg):
            want = ls.project_per_layer_inputs(want_embeds, stock.per_layer_embeddings[:12])
        assert torch.equal(got, want)
    finally:
        hooks.shutdown()


def test_a_table_in_a_file_with_other_weights_is_read_and_dropped(
    tmp_path_factory: pytest.TempPathFactory, dist: Any, installed: Any
) -> None:
    ckpt = ckpts.write_gemma4_checkpoint(tmp_path_factory.mktemp("one"), separate_table=False)
    cfg = _config(ckpt, mmap=True)
    model, _ = vllm_cpu.load_model(cfg)
    (table,) = gemma4.find_mmap_tables(model)
    assert table.weight.numel() == 0
    hooks = _attach(model, cfg)
    hooks.shutdown()


def test_a_missing_or_mismatched_table_is_refused_naming_it(
    checkpoint: Path, dist: Any, installed: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    cfg = _config(checkpoint, mmap=True)
    model, _ = vllm_cpu.load_model(cfg)
    missing = ckpts.copy_without_table(checkpoint, tmp_path / "missing")
    cfg.model_config.model = str(missing)
    with pytest.raises(pm.TableError, match="no per-layer embedding table"):
        _attach(model, cfg)
    narrow = tmp_path / "narrow"
    shutil.copytree(checkpoint, narrow)
    f = narrow / "model-ple.safetensors"
    tensors = load_file(str(f))
    save_file({k: v[:-1].contiguous() for k, v in tensors.items()}, str(f))
    cfg.model_config.model = str(narrow)
    with pytest.raises(pm.TableError, match=r"embed_tokens_per_layer\.weight.*111 rows"):
        _attach(model, cfg)


def test_graph_mode_and_refusals(installed: Any) -> None:
    from vllm.config.compilation import CUDAGraphMode

    # The hook alone, on configs without a model (a CPU platform's own is NONE): the
    # default graph mode becomes FULL_DECODE_ONLY; FULL, FULL_DECODE_ONLY and NONE stay.
    vc = VllmConfig(additional_config=MMAP)
    for mode, want in (
        (None, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
        (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
    ):
        vc.compilation_config.cudagraph_mode = mode
        gemma4.verify_and_update_config(vc)
        assert vc.compilation_config.cudagraph_mode == want, mode
    # Async scheduling stays as asked (two steps in flight defer their rows alike).
    for asked in (None, True, False):
        vc.scheduler_config.async_scheduling = asked
        gemma4.verify_and_update_config(vc)
        assert vc.scheduler_config.async_scheduling is asked, asked
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    with pytest.raises(pm.UnsupportedError, match="cudagraph_mode=PIECEWISE"):
        gemma4.verify_and_update_config(vc)
    off = VllmConfig(additional_config={"ple_memops": {"table_backend": "default"}})
    off.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    off.scheduler_config.async_scheduling = True
    gemma4.verify_and_update_config(off)  # the switch off: nothing refused, nothing changed
    assert off.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert off.scheduler_config.async_scheduling is True
    vc = VllmConfig(additional_config=MMAP)
    vc.cache_config.kv_sharing_fast_prefill = True
    vc.parallel_config = ParallelConfig(pipeline_parallel_size=2)
    with pytest.raises(pm.UnsupportedError, match=r"pipeline parallelism.*kv_sharing_fast_prefill"):
        gemma4.verify_and_update_config(vc)


def test_the_engine_tests_checkpoint_tells_engines_apart(tmp_path: Path) -> None:
    """The GPU engine tests compare an engine's greedy tokens with the stock engine's up to
    the stock engine's first near tie (``vllm_harness.assert_same_greedy``): engines compiled
    apart differ in rounding, so a near tie may go either way. On their checkpoint, run by
    transformers' own model, most tokens must come before a request's first near tie, and a
    table whose rows are shifted by one must change the tokens, or the comparison could
    not fail."""
    from transformers import AutoModelForCausalLM

    ckpt = ckpts.write_gemma4_checkpoint(tmp_path, separate_table=False)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ckpts.check_greedy_oracle(model, model.model.embed_tokens_per_layer, TABLE_ROWS)


def test_tensor_parallel_ranks_read_full_rows(tmp_path: Path) -> None:
    """Two tensor-parallel ranks (processes, gloo): vLLM's table is split over them and
    its lookup combined by an all-reduce; the mmap table holds nothing, each rank reads
    full rows, without one, and every rank's per-layer inputs are the stock model's bit
    for bit; one rank that cannot defer makes both synchronous."""
    ckpt = ckpts.write_gemma4_checkpoint(tmp_path / "ckpt")
    for report in vllm_cpu.run_tp_ranks("gemma4", ckpt, tmp_path):
        assert report["plan_mode"] == "host" and report["agreed"] == [False, True], report
        assert report["mmap_rows"] == 0 and report["stock_rows"] < TABLE_ROWS, report
        for r in report["inputs"]:
            assert r["equal"] and r["nonzero"], report
            assert r["stock_reduces"] == 1 and r["mmap_reduces"] == 0, report


class _Int8Embedding:
    """A quantization method that quantizes embeddings (as compressed-tensors' weight-only
    INT scheme does), shaped as vLLM calls one."""

    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never looked up")

    def apply(self, layer: Any, x: torch.Tensor, bias: Any = None) -> torch.Tensor:
        raise AssertionError("never applied")


class _QuantizesEmbeddings:
    online_quantization_config = None

    def get_name(self) -> str:
        return "int8-embeddings"

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        return _Int8Embedding() if isinstance(layer, VocabParallelEmbedding) else None


def test_a_quantized_table_is_refused_and_fp8_keeps_the_table(dist: Any, installed: Any) -> None:
    """vLLM's FP8 method leaves embeddings unquantized: the table is served as it is. A
    method that quantizes embeddings (compressed-tensors can) is refused, typed, naming
    the table and the method."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from ple_memops.vllm.token_table import PerLayerTokenTable

    with set_current_vllm_config(VllmConfig()):
        table = PerLayerTokenTable(
            TABLE_ROWS, 64, torch.bfloat16, quant_config=Fp8Config(), prefix="fp8.per_layer"
        )
        assert table.weight.numel() == 0 and table.row_bytes == 128
        with pytest.raises(pm.UnsupportedError, match=r"int8-embeddings.*q\.per_layer.*_Int8"):
            PerLayerTokenTable(
                TABLE_ROWS, 64, torch.bfloat16, quant_config=_QuantizesEmbeddings(),
                prefix="q.per_layer",
            )  # fmt: skip
