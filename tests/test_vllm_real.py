"""The integration against the real vLLM 0.33.0 on the CPU (``VLLM_TARGET_DEVICE=cpu``),
with ple-memops's patch applied: ``scripts/test.sh`` builds that environment and runs
this file there. Skipped, with the reason, where vLLM is not installed.

What runs here: the patch against the installed release files, the patched modules'
imports, the custom ops through vLLM's registration helper and ``torch.compile``, our
Qwen4Exp ids against vLLM's own ``compute_ngram_ids``, the whole Qwen4Exp model loaded by
vLLM's default loader from a checkpoint transformers wrote (tables neither read nor
allocated) with PLE rows byte-identical to the device table's, the switch and the
refusals, and two tensor-parallel ranks (gloo) reading full rows without the all-reduce.
The Triton kernels and Model Runner V2 need a GPU: ``test_vllm_runner_gpu.py`` drives the
runner hooks through MRV2's sequence there.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The ops register through vLLM's helper when vLLM is imported first (as inside vLLM); a
# session that imported them earlier (test_vllm_integration.py) registered them with torch.
OPS_BEFORE_VLLM = "ple_memops.vllm.ops" in sys.modules
vllm = pytest.importorskip(
    "vllm",
    reason="vLLM 0.33.0 is not installed here (scripts/test.sh runs this file in its "
    "vLLM environment)",
)

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.engram import EngramConfig  # noqa: E402

import ple_memops as pm  # noqa: E402
from ple_memops.vllm import _patch, ops, runner  # noqa: E402
from ple_memops.vllm.ngram import NGramHasher, NGramLayout  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import vllm_checkpoints as ckpts  # noqa: E402

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dist() -> Any:
    """A one-rank gloo world, as vLLM's CPU workers set it up."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpts.write_checkpoint(tmp_path_factory.mktemp("ckpt"), fp8=request.param == "fp8")


def _config(ckpt: Path, engram: EngramConfig, **kw: Any) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16"),
        engram_config=engram,
        load_config=LoadConfig(load_format="safetensors"),
        **kw,
    )


def _load(vc: VllmConfig) -> tuple[torch.nn.Module, Any]:
    """vLLM's default loader, minus the CPU kernel packing after loading (it needs vLLM's
    compiled ``_C`` extension, which the CPU wheel does not carry)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    with set_current_vllm_config(vc):
        loader = get_model_loader(vc.load_config)
        with torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config)
        loader.load_weights(model, vc.model_config)
    return model, loader


# -- the patch ------------------------------------------------------------------------------

PATCHED = [f.path for f in _patch.parse(_patch.PATCH.read_text())]


def _sha(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_installed_vllm_is_patched_and_the_patch_reverts_to_the_release(tmp_path: Path) -> None:
    root, states, changes = _patch.apply(check=True)
    assert not changes, (
        "the vLLM here is not patched: run `python -m ple_memops.vllm apply` "
        f"({[(s.path, s.state) for s in states]})"
    )
    assert {s.state for s in states} == {"patched"}
    # On a copy: reverting gives the released files byte for byte (their RECORD hashes),
    # applying again gives the installed ones.
    dist = next(root.glob("vllm-0.33.0.dist-info"))
    site = tmp_path / "site"
    shutil.copytree(dist, site / dist.name)
    for rel in PATCHED:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, site / rel)
    (site / "vllm" / "__init__.py").touch()
    with open(dist / "RECORD", newline="") as f:
        record = {row[0]: row[1] for row in csv.reader(f)}
    _patch.apply(site=site, revert=True)
    for rel in PATCHED:
        assert _sha(site / rel) == record[rel], rel
    _, states, changed = _patch.apply(site=site)
    assert changed and {s.state for s in states} == {"unpatched"}
    for rel in PATCHED:
        assert (site / rel).read_bytes() == (root / rel).read_bytes(), rel


def test_cli_check_reports_patched(capsys: pytest.CaptureFixture[str]) -> None:
    from ple_memops.vllm.__main__ import main

    assert main(["apply", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("already patched") == len(PATCHED) and "nothing to do" in out


def test_patched_modules_import() -> None:
    import importlib

    for rel in PATCHED:
        module = importlib.import_module(rel[: -len(".py")].replace("/", "."))
        assert module.__file__ is not None and module.__file__.endswith(rel)
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert EngramConfig().table_backend == "default"
    assert "ple_wait_descs" in CudaGraphManager.__init__.__code__.co_names
    assert "attach_runner" in GPUModelRunner.load_model.__code__.co_names


# -- the custom ops ---------------------------------------------------------------------------


def test_ops_are_registered_through_vllm_and_compile(checkpoint: Path, dist: Any) -> None:
    assert ops.registered_with() == ("torch" if OPS_BEFORE_VLLM else "vllm")
    from ple_memops.vllm.tables import checkpoint_tensor_names, find_layer_table, open_layer_table

    name = "model.layers.0.ple.ple_embedding.ngram_embedding"
    table = open_layer_table(checkpoint, find_layer_table(checkpoint_tensor_names(checkpoint), 0))
    hooks = runner.build_hooks({name: table}, rows_per_token=4, max_rows=64, device="cpu")

    def consumer(ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.ops.ple_memops.stage_rows(ids, out, name)
        torch.ops.ple_memops.join_rows(out, name)
        return out.to(torch.int32).sum(dim=-1)

    try:
        compiled = torch.compile(consumer, fullgraph=True, backend="aot_eager")
        ids = torch.randint(0, table.rows, (5, 4), dtype=torch.int64)
        out = hooks.output(name, 5)
        with hooks.eager(dummy=False):
            got = compiled(ids, out)
        want = torch.from_numpy(table.gather(ids.reshape(-1).numpy())).to(torch.int32).sum(-1)
        assert torch.equal(got, want)
    finally:
        hooks.shutdown()
        table.close()


# -- ids -----------------------------------------------------------------------------------------


def test_our_ids_equal_vllms_compute_ngram_ids(checkpoint: Path, dist: Any) -> None:
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    vc = _config(checkpoint, EngramConfig(cpu_offload=False))
    cfg = vc.model_config.hf_text_config
    rng = random.Random(11)
    with set_current_vllm_config(vc):
        for dense in (0, 1, 5):
            emb = Qwen4ExpNGramEmbedding(
                cfg,
                64,
                dense,
                64,
                data_parallel_rank=0,
                prefix=f"x{dense}",
                params_dtype=torch.bfloat16,
            )
            lay = NGramLayout.from_config(cfg, dense)
            assert list(lay.sizes) == emb.ngram_heads_vocab_sizes.tolist()
            assert list(lay.offsets) == emb.ngram_heads_offsets.tolist()
            assert emb.layer_multipliers.tolist() == [
                m - (1 << 64) if m >= 1 << 63 else m for m in lay.multipliers
            ]
            assert lay.rows == emb.ngram_embedding.org_vocab_size
            ours = NGramHasher(lay)
            for _ in range(120):
                nreq = rng.randint(1, 6)
                starts = [0]
                for _r in range(nreq):
                    starts.append(starts[-1] + rng.randint(0, 5))
                total = starts[-1] + rng.randint(0, 4)
                if total == 0:
                    continue
                toks = torch.tensor(
                    [rng.choice([7, rng.randint(0, 127)]) for _ in range(total)], dtype=torch.int32
                )
                qsl = torch.tensor(starts, dtype=torch.int32)
                ctx = torch.tensor(
                    [[rng.choice([7, rng.randint(0, 127)]) for _ in range(2)] for _ in range(nreq)],
                    dtype=torch.int32,
                )
                assert torch.equal(ours(toks, qsl, ctx), emb.compute_ngram_ids(toks, qsl, ctx))


# -- the model with the mmap backend ------------------------------------------------------------


def test_model_loads_without_its_tables_and_rows_match_the_device_table(
    checkpoint: Path, dist: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.model_executor.model_loader import default_loader

    from ple_memops.vllm.qwen4exp import Qwen4ExpPLEMmapEmbedding

    kept: list[list[str]] = []
    real_filter = default_loader.filter_safetensors_files_by_weight_name

    def spy(files: list[str], is_unused: Any) -> list[str]:
        result = real_filter(files, is_unused)
        kept.append([Path(f).name for f in result])
        return result

    monkeypatch.setattr(default_loader, "filter_safetensors_files_by_weight_name", spy)
    mmap_cfg = _config(checkpoint, EngramConfig(table_backend="mmap"))
    mmap_cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    model, loader = _load(mmap_cfg)
    # Files holding only table rows were not read; nothing of the tables was allocated.
    assert kept == [["model-rest.safetensors"]]
    tables = [m for m in model.modules() if isinstance(m, Qwen4ExpPLEMmapEmbedding)]
    assert len(tables) == 2 and all(t.weight.numel() == 0 for t in tables)
    monkeypatch.undo()
    device_cfg = _config(checkpoint, EngramConfig(cpu_offload=False))
    device_model, _ = _load(device_cfg)

    fake = types.SimpleNamespace(model=model, vllm_config=mmap_cfg, device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="ple_memops"), set_current_vllm_config(mmap_cfg):
        hooks = runner.attach_runner(fake, loader)
    assert hooks is not None and hooks.plan.mode == "host"
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
            with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False):
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


def test_a_missing_table_is_a_clear_error(checkpoint: Path, dist: Any, tmp_path: Path) -> None:
    mmap_cfg = _config(checkpoint, EngramConfig(table_backend="mmap"))
    model, loader = _load(mmap_cfg)
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
        runner.attach_runner(fake, loader)


# -- the switch and the refusals ---------------------------------------------------------------


def test_switch_and_refusals(checkpoint: Path, dist: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runner.BACKEND_ENV, raising=False)
    assert _config(checkpoint, EngramConfig(cpu_offload=False)).engram_config.table_backend == (
        "default"
    )
    assert _config(checkpoint, EngramConfig(table_backend="mmap")).engram_config.table_backend == (
        "mmap"
    )
    monkeypatch.setenv(runner.BACKEND_ENV, "mmap")
    vc = VllmConfig(
        model_config=ModelConfig(model=str(checkpoint), skip_tokenizer_init=True, dtype="bfloat16")
    )
    assert vc.engram_config is not None and vc.engram_config.table_backend == "mmap"
    assert vc.engram_config.dp_shared_memory is False
    monkeypatch.delenv(runner.BACKEND_ENV)
    with pytest.raises(pm.UnsupportedError, match="embedding_across_dp"):
        _config(checkpoint, EngramConfig(table_backend="mmap", embedding_across_dp=True))
    with pytest.raises(pm.UnsupportedError, match="pipeline parallelism"):
        runner.resolve_engram_config(
            EngramConfig(table_backend="mmap"), ParallelConfig(pipeline_parallel_size=2)
        )
    # NVFP4 tables (packed rows plus block scales) are refused when the layer is built.
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    vc = _config(checkpoint, EngramConfig(table_backend="mmap"))
    cfg = vc.model_config.hf_text_config
    monkeypatch.setattr(cfg, "ple_embedding_dtype", "nvfp4", raising=False)
    with set_current_vllm_config(vc), pytest.raises(pm.UnsupportedError, match="NVFP4"):
        Qwen4ExpNGramEmbedding(
            cfg, 64, 0, 64, data_parallel_rank=0, prefix="nv", params_dtype=torch.bfloat16
        )


# -- tensor parallel ------------------------------------------------------------------------------


def test_tensor_parallel_ranks_read_full_rows(checkpoint: Path, tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "vllm_tp_rank.py"),
                str(rank),
                "2",
                str(port),
                str(checkpoint),
                str(tmp_path / f"rank{rank}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["plan_mode"] == "host"
        for layer, r in report["layers"].items():
            # The device table is split over the two ranks and combined by an all-reduce;
            # the mmap table holds nothing and reads full rows without one.
            assert r["equal"] and r["nonzero"], (rank, layer, r)
            assert r["mmap_rows"] == 0 and r["device_rows"] in (2048, 2112)
            assert r["device_reduces"] == 1 and r["mmap_reduces"] == 0
