"""Gemma 3n's per-layer embedding table through the plugin, against the real vLLM (0.33.0, 0.34.0)
on the CPU (``VLLM_TARGET_DEVICE=cpu``), with a checkpoint transformers wrote
(``Gemma3nForConditionalGeneration.save_pretrained``, the class the released checkpoints
are). Skipped, with the reason, where vLLM or timm (which transformers' Gemma 3n vision
tower needs) is not installed (``scripts/test.sh`` runs this file in its vLLM
environment).

What runs here: the multimodal class built by vLLM's own loader with the switch on, the
table neither read (in a file of its own) nor allocated and vLLM's rows buffer not
allocated; the per-layer inputs the self-decoder computes bit for bit equal to the stock
model's (rows looked up eagerly into vLLM's buffer), eager and with the combination
compiled by Inductor, ids outside the table reading row 0; the config hook the plugin adds
for an architecture vLLM has none for; a checkpoint whose table is missing; and that the
GPU engine tests' checkpoint can tell engines apart (decisive greedy choices, sensitive to
its rows).
"""

from __future__ import annotations

import importlib.util
import os
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
pytest.importorskip("timm", reason="timm is not installed (transformers' Gemma 3n needs it)")

import torch  # noqa: E402
import vllm_checkpoints as ckpts  # noqa: E402
import vllm_cpu  # noqa: E402
from vllm.config import (  # noqa: E402
    CompilationConfig,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)

import ple_memops as pm  # noqa: E402
from ple_memops.vllm import gemma3n, ops, plugin  # noqa: E402

dist = vllm_cpu.dist  # the fixtures
installed = vllm_cpu.installed
_attach = vllm_cpu.attach_hooks

ARCH = "Gemma3nForConditionalGeneration"
TABLE_ROWS = ckpts.GEMMA3N_CONFIG["vocab_size_per_layer_input"]
LAYERS = ckpts.GEMMA3N_CONFIG["num_hidden_layers"]
WIDTH = ckpts.GEMMA3N_CONFIG["hidden_size_per_layer_input"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpts.write_gemma3n_checkpoint(tmp_path_factory.mktemp("gemma3n"))


def _config(ckpt: Path, *, mmap: bool, eager: bool = False) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(ckpt),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            limit_mm_per_prompt={"image": 0, "audio": 0},
        ),
        load_config=LoadConfig(load_format="safetensors"),
        additional_config={"ple_memops": {"table_backend": "mmap" if mmap else "default"}},
        # eager: vLLM's -O0 (the forward runs as written); else its default, compiled.
        compilation_config=CompilationConfig(mode=0) if eager else CompilationConfig(),
    )


def _ids(n: int, seed: int) -> torch.Tensor:
    return vllm_cpu.token_ids(n, seed, TABLE_ROWS)  # outside the table: row 0


def test_the_model_loads_without_its_table_and_its_inputs_are_the_stock_models(
    checkpoint: Path, dist: Any, installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = vllm_cpu.spy_loaded_files(monkeypatch)
    mmap_cfg = _config(checkpoint, mmap=True)
    model, _ = vllm_cpu.load_model(mmap_cfg)
    assert type(model) is gemma3n.Gemma3nMmapForConditionalGeneration
    assert kept == [["model-rest.safetensors"]]  # the table's file was not read
    (table,) = gemma3n.find_mmap_tables(model)
    assert table.weight.numel() == 0 and table.org_vocab_size == TABLE_ROWS
    assert model.per_layer_embeddings is None  # vLLM's rows buffer is not allocated
    monkeypatch.undo()
    stock_cfg = _config(checkpoint, mmap=False)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    assert not gemma3n.find_mmap_tables(stock)  # the switch is per engine

    ours, theirs = model.language_model.model.self_decoder, stock.language_model.model.self_decoder
    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    assert hooks.steps.mode == "host" and hooks.layer_names == [table.ple_memops_name]

    def stock_inputs(ids: torch.Tensor, combine: Any) -> torch.Tensor:
        # vLLM's: the rows looked up eagerly into the buffer, the buffer's slice combined.
        with set_current_vllm_config(stock_cfg):
            embeds = stock.embed_input_ids(ids)
            out: torch.Tensor = combine(embeds, stock.per_layer_embeddings[: ids.shape[0]])
        return out

    def mmap_inputs(ids: torch.Tensor, combine: Any) -> torch.Tensor:
        # Ours: the ids recorded, staged where vLLM read its buffer, joined in the combination.
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            embeds = model.embed_input_ids(ids)
            staged = ours.get_per_layer_input_embeddings(model.ple_memops_ids[: ids.shape[0]])
            out: torch.Tensor = combine(embeds, staged)
        return out

    try:
        for n, seed in ((1, 1), (9, 2), (40, 3)):
            ids = _ids(n, seed)
            got = mmap_inputs(ids, ours.get_per_layer_inputs)
            want = stock_inputs(ids, theirs.get_per_layer_inputs)
            assert got.shape == want.shape == (n, LAYERS, WIDTH) and want.abs().sum() > 0
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        # The combination compiled by Inductor (vLLM compiles the text model), ours with
        # the join inside it.
        compiled_ours = torch.compile(ours.get_per_layer_inputs, fullgraph=True, dynamic=True)
        compiled_theirs = torch.compile(theirs.get_per_layer_inputs, fullgraph=True, dynamic=True)
        for n, seed in ((8, 4), (13, 5)):
            ids = _ids(n, seed)
            got = mmap_inputs(ids, compiled_ours)
            want = stock_inputs(ids, compiled_theirs)
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        # A wrong row shows: rows shifted by one give other inputs.
        shifted = _ids(8, 6)
        got = mmap_inputs(shifted, ours.get_per_layer_inputs)
        want = stock_inputs((shifted + 1) % TABLE_ROWS, theirs.get_per_layer_inputs)
        assert not torch.equal(got, want)
    finally:
        hooks.shutdown()


def _stock_inputs(stock: Any, stock_cfg: VllmConfig, ids: torch.Tensor) -> torch.Tensor:
    """The stock model's per-layer inputs for ``ids`` (its rows buffer as its
    ``embed_input_ids`` filled it)."""
    with set_current_vllm_config(stock_cfg):
        embeds = stock.embed_input_ids(ids)
        out: torch.Tensor = stock.language_model.model.self_decoder.get_per_layer_inputs(
            embeds, stock.per_layer_embeddings[: len(ids)]
        )
    return out


def _our_inputs(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our model's per-layer inputs for ``ids`` (joined or still to be joined) and its
    projection alone; inside the mmap config, the hooks' eager scope and the layers."""
    ours = model.language_model.model.self_decoder
    embeds = model.embed_input_ids(ids)
    staged = ours.get_per_layer_input_embeddings(model.ple_memops_ids[: len(ids)])
    got = ours.get_per_layer_inputs(embeds, staged)
    return got, ours.get_per_layer_inputs(embeds, None)


def test_run_eagerly_the_rows_join_at_layer_0s_gate_with_the_stock_models_bits(
    checkpoint: Path, dist: Any, installed: Any
) -> None:
    # vLLM's -O0: the per-layer inputs leave the self-decoder's combination still the
    # projection, and become the stock model's, bit for bit, when decoder layer 0's
    # per-layer input gate (their first consumer) is called; a forward whose gate never
    # ran is refused at the next one.
    mmap_cfg = _config(checkpoint, mmap=True, eager=True)
    mmap_cfg.additional_config["ple_memops"]["split_rows"] = False  # on by default
    model, _ = vllm_cpu.load_model(mmap_cfg)
    stock_cfg = _config(checkpoint, mmap=False, eager=True)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    ours = model.language_model.model.self_decoder
    gate = ours.decoder_layers[0].per_layer_input_gate
    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    try:
        for n, seed in ((1, 1), (9, 2), (40, 3)):
            ids = _ids(n, seed)
            want = _stock_inputs(stock, stock_cfg, ids)
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                got, projection = _our_inputs(model, ids)
                assert torch.equal(got, projection)  # not joined yet
                gate(torch.zeros(n, ckpts.GEMMA3N_CONFIG["hidden_size"], dtype=torch.bfloat16))
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            embeds = model.embed_input_ids(_ids(4, 7))
            staged = ours.get_per_layer_input_embeddings(model.ple_memops_ids[:4])
            ours.get_per_layer_inputs(embeds, staged)
            with pytest.raises(pm.StateError, match="never joined"):
                ours.get_per_layer_inputs(embeds, staged)
    finally:
        hooks.shutdown()
    # The diagnostic that keeps the join after the projection: joined there, same bits.
    early_cfg = _config(checkpoint, mmap=True, eager=True)
    early_cfg.additional_config["ple_memops"]["diag_early_join"] = True
    early, _ = vllm_cpu.load_model(early_cfg)
    hooks = _attach(early, early_cfg)
    layers = early_cfg.compilation_config.static_forward_context
    try:
        ids = _ids(9, 2)
        with set_current_vllm_config(early_cfg), hooks.eager(dummy=False), ops.layers(layers):
            got, _ = _our_inputs(early, ids)
        assert torch.equal(got, _stock_inputs(stock, stock_cfg, ids))
    finally:
        hooks.shutdown()


def test_split_rows_layer_0s_slice_joins_at_its_gate_and_the_rest_at_layer_1s(
    checkpoint: Path, dist: Any, installed: Any
) -> None:
    # split_rows (the default): decoder layer 0's slice of each row and the rest are two
    # tables (column windows of the one tensor); the same bits as the stock model's, each
    # part joined right before its first consumer (layer 1 may be in the cross-decoder).
    mmap_cfg = _config(checkpoint, mmap=True, eager=True)
    model, _ = vllm_cpu.load_model(mmap_cfg)
    stock_cfg = _config(checkpoint, mmap=False, eager=True)
    stock, _ = vllm_cpu.load_model(stock_cfg)
    first, rest = gemma3n.find_mmap_tables(model)
    layers_n = ckpts.GEMMA3N_CONFIG["num_hidden_layers"]
    width = ckpts.GEMMA3N_CONFIG["hidden_size_per_layer_input"]
    assert first.rest is rest
    assert first.columns == (0, width) and rest.columns == (width, (layers_n - 1) * width)
    gates = [layer.per_layer_input_gate for layer in model.language_model.model.layers[:2]]
    hidden = ckpts.GEMMA3N_CONFIG["hidden_size"]
    hooks = _attach(model, mmap_cfg)
    layers = mmap_cfg.compilation_config.static_forward_context
    try:
        assert hooks.layer_names == [first.ple_memops_name, rest.ple_memops_name]
        for n, seed in ((1, 1), (9, 2), (40, 3)):
            ids = _ids(n, seed)
            want = _stock_inputs(stock, stock_cfg, ids)
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
                got, projection = _our_inputs(model, ids)
                gates[0](torch.zeros(n, hidden, dtype=torch.bfloat16))
                assert torch.equal(got[:, 0], want[:, 0])
                assert torch.equal(got[:, 1:], projection[:, 1:])  # not joined yet
                gates[1](torch.zeros(n, hidden, dtype=torch.bfloat16))
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
    finally:
        hooks.shutdown()


def test_the_plugin_adds_a_config_hook_for_gemma3n(installed: Any) -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    hook = MODELS_CONFIG_MAP[ARCH]  # vLLM has none of its own for this architecture
    vc = VllmConfig(additional_config={"ple_memops": {"table_backend": "mmap"}})
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    hook.verify_and_update_config(vc)
    assert vc.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    with pytest.raises(pm.UnsupportedError, match="cudagraph_mode=PIECEWISE"):
        hook.verify_and_update_config(vc)
    assert f"config hook {ARCH}" in " ".join(installed.changes)


def test_a_missing_table_is_refused_naming_it(
    checkpoint: Path, dist: Any, installed: Any, tmp_path: Path
) -> None:
    cfg = _config(checkpoint, mmap=True)
    model, _ = vllm_cpu.load_model(cfg)
    missing = ckpts.copy_without_table(checkpoint, tmp_path / "missing")
    cfg.model_config.model = str(missing)
    with pytest.raises(pm.TableError, match="no per-layer embedding table"):
        _attach(model, cfg)


def test_the_engine_tests_checkpoint_tells_engines_apart(tmp_path: Path) -> None:
    """See ``test_vllm_gemma4_real.py``'s test of the same name (transformers' own
    Gemma 3n here)."""
    from transformers import Gemma3nForConditionalGeneration

    ckpt = ckpts.write_gemma3n_checkpoint(tmp_path, separate_table=False)
    model = Gemma3nForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    table = model.model.language_model.embed_tokens_per_layer
    ckpts.check_greedy_oracle(model, table, TABLE_ROWS)


def test_the_hook_is_gone_after_undo(installed: Any) -> None:
    # Last in this file: it undoes the module's install.
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    record = plugin.install()
    assert ARCH in MODELS_CONFIG_MAP
    record.undo()
    assert ARCH not in MODELS_CONFIG_MAP
