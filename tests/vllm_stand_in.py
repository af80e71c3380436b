"""A stand-in for vLLM's Model Runner V2 around the plugin's runner hooks, without vLLM:
a small decoder (torch layers) whose two PLE layers take the Qwen4Exp n-gram ids
(:class:`qwen4exp_ngram.NGramHasher`) through the plugin's custom ops, its FP8 checkpoint,
MRV2's steps (profile run, CUDA graph memory profiling, warm-up, capture, armed replays,
eager steps) and the checks of every executed step (a device ring of tokens, ids and
rows). ``test_vllm_runner_gpu.py`` drives it on a GPU, ``test_vllm_integration.py`` on the
host."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gpu_wait import done as wait_done
from qwen4exp_ngram import NGramHasher, NGramLayout

from ple_memops.vllm import ops
from ple_memops.vllm.hooks import PleRunnerHooks, build_hooks
from ple_memops.vllm.tables import checkpoint_tensor_names, find_layer_table, open_layer_table

NGRAM, HEADS_PER, EOS, VOCAB = 3, 8, 3, 512
H = (NGRAM - 1) * HEADS_PER  # 16 row ids per token
HEAD_DIM = 128  # FP8 rows of 128 bytes, as Qwen3.8-Flash-Next's
HIDDEN, N_LAYERS, PLE_AT = 256, 5, (1, 3)
BASE = 3000  # per-head vocabularies of ~3000 rows: ~48k rows (6 MB) per table
MAX_REQS, MAX_TOKENS = 16, 64
SIZES = (1, 2, 4, 8, 16)  # captured decode sizes
HIST = 24
TIMEOUT = 20.0


class Mode(Enum):
    NONE = 0
    FULL = 2


@dataclass(frozen=True)
class Desc:
    """The fields of MRV2's ``BatchExecutionDescriptor`` the hooks and this runner use."""

    cg_mode: Mode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = 1
    num_ubatches: int = 1


def layout(dense: int) -> NGramLayout:
    return NGramLayout.qwen4exp(
        ngram_size=NGRAM,
        heads_per_ngram=HEADS_PER,
        vocab_size=VOCAB,
        ngram_vocab_size_base=BASE,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        dense_layer_id=dense,
        eos_token_id=EOS,
    )


def name_of(layer: int) -> str:
    return f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"


def write_checkpoint(root: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """FP8 tables in 4 row shards per layer (safetensors), like a Qwen4Exp checkpoint."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tables, files, weight_map = {}, {}, {}
    for dense, layer in enumerate(PLE_AT):
        rows = layout(dense).rows
        data = (torch.randn(rows, HEAD_DIM, generator=g) * 8).to(torch.float8_e4m3fn)
        tables[name_of(layer)] = data.view(torch.uint8).numpy()
        per = -(-rows // 4)
        shards = {
            f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{k}.weight": data[
                k * per : (k + 1) * per
            ].contiguous()
            for k in range(4)
        }
        files[f"ple-{layer}.safetensors"] = shards
    for fname, tensors in files.items():
        save_file(tensors, str(root / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root, tables


def done(event: Any, timeout: float = TIMEOUT) -> bool:
    return wait_done(event, timeout)


class StandInModel(torch.nn.Module):
    """A few torch layers; PLE layers consume deferred rows through the custom ops."""

    def __init__(self, hooks: PleRunnerHooks, device: Any) -> None:
        super().__init__()
        dt = torch.bfloat16
        g = torch.Generator().manual_seed(1)
        self.hooks, self.device = hooks, torch.device(device)
        # What vLLM's forward context holds for the ops: each layer carries the hooks.
        self.layers = {name_of(i): SimpleNamespace(ple_memops_hooks=hooks) for i in PLE_AT}
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN).to(device, dt)
        self.mlps = torch.nn.ModuleList(
            torch.nn.Linear(HIDDEN, HIDDEN, bias=False).to(device, dt) for _ in range(N_LAYERS)
        )
        self.ple_proj = torch.nn.ModuleDict(
            {
                str(i): torch.nn.Linear(H * HEAD_DIM, HIDDEN, bias=False).to(device, dt)
                for i in PLE_AT
            }
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        self.lm_head = torch.randn(HIDDEN, VOCAB, generator=g).to(device, dt)
        self.hashers = {i: NGramHasher(layout(d), device) for d, i in enumerate(PLE_AT)}
        z = dict(device=device)
        self.ids = {i: torch.zeros((MAX_TOKENS, H), dtype=torch.int64, **z) for i in PLE_AT}
        self.sampled = torch.zeros(MAX_TOKENS, dtype=torch.int64, **z)
        self.fault = torch.zeros(1, dtype=torch.int64, **z)  # adds an out-of-range offset
        # The ring every executed step writes: tokens, query starts, context, ids, rows.
        self.counter = torch.zeros(1, dtype=torch.int64, **z)
        self.h_tokens = torch.zeros((HIST, MAX_TOKENS), dtype=torch.int32, **z)
        self.h_ntok = torch.zeros(HIST, dtype=torch.int64, **z)
        self.h_qsl = torch.zeros((HIST, MAX_REQS + 1), dtype=torch.int32, **z)
        self.h_ctx = torch.zeros((HIST, MAX_REQS, NGRAM - 1), dtype=torch.int32, **z)
        self.h_ids = {i: torch.zeros((HIST, MAX_TOKENS, H), dtype=torch.int64, **z) for i in PLE_AT}
        self.h_rows = {
            i: torch.zeros((HIST, MAX_TOKENS * H, HEAD_DIM), dtype=torch.uint8, **z) for i in PLE_AT
        }
        self.pad_tokens = torch.zeros(MAX_TOKENS, dtype=torch.int32, **z)
        self.pad_ids = torch.zeros((MAX_TOKENS, H), dtype=torch.int64, **z)
        self.pad_rows = torch.zeros((MAX_TOKENS * H, HEAD_DIM), dtype=torch.uint8, **z)

    def forward(self, input_ids: Any, qsl: Any, ctx: Any) -> Any:
        with ops.layers(self.layers):
            return self._forward(input_ids, qsl, ctx)

    def _forward(self, input_ids: Any, qsl: Any, ctx: Any) -> Any:
        t = int(input_ids.shape[0])
        hooks = self.hooks
        self.counter.add_(1)
        slot = self.counter % HIST

        # Stage every PLE layer's rows at the top: each host gather overlaps all the GPU
        # work before its consumer.
        def compute_ids() -> None:
            for i in PLE_AT:
                self.hashers[i](input_ids, qsl, ctx, out=self.ids[i][:t])
                self.ids[i][:t].add_(self.fault * 10_000_000)

        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            hooks.note_ids_source(compute_ids)  # a synchronous plan's graphs need it
        compute_ids()
        for i in PLE_AT:
            ops.stage_rows(self.ids[i][:t], hooks.output(name_of(i), t), name_of(i))
        h = self.embed(input_ids.long())
        for k, mlp in enumerate(self.mlps):
            if k in PLE_AT:
                out = hooks.output(name_of(k), t)
                ops.join_rows(out, name_of(k))
                rows = out.view(torch.float8_e4m3fn).view(t, H * HEAD_DIM).to(torch.bfloat16)
                h = h + self.ple_proj[str(k)](rows)
                self.pad_rows[: t * H].copy_(out)
                self.h_rows[k].index_copy_(0, slot, self.pad_rows.unsqueeze(0))
                self.pad_ids[:t].copy_(self.ids[k][:t])
                self.h_ids[k].index_copy_(0, slot, self.pad_ids.unsqueeze(0))
            h = h + torch.nn.functional.gelu(mlp(h))
        self.sampled[:t].copy_((h @ self.lm_head).argmax(dim=-1))
        self.pad_tokens[:t].copy_(input_ids)
        self.h_tokens.index_copy_(0, slot, self.pad_tokens.unsqueeze(0))
        self.h_ntok.index_fill_(0, slot, t)
        self.h_qsl.index_copy_(0, slot, qsl.unsqueeze(0))
        self.h_ctx.index_copy_(0, slot, ctx.unsqueeze(0))
        return h


class GraphManager:
    """MRV2's ``CudaGraphManager`` as the hooks see it, and its capture loop."""

    def __init__(self, runner: StandInRunner) -> None:
        self.runner = runner
        self.graphs: dict[Desc, Any] = {}
        self.fail_next_replay = False

    def capture(self, descs: list[Desc], pool: Any) -> None:
        r = self.runner
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for desc in descs:
                r.prepare_dummy(desc.num_tokens, desc.num_reqs or desc.num_tokens)
                with r.hooks.warmup():  # the eager warm-up in runtime mode NONE
                    r.forward(desc.num_tokens, kind="dummy")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream), r.hooks.capture(desc):
                    r.model(r.input_ids[: desc.num_tokens], r.qsl, r.ctx)
                self.graphs[desc] = graph
        torch.cuda.current_stream().wait_stream(stream)

    def run_fullgraph(self, desc: Desc) -> None:
        if self.fail_next_replay:
            self.fail_next_replay = False
            raise RuntimeError("injected: the launch failed")
        self.graphs[desc].replay()
        self.runner.kinds.append("replay")


class StandInRunner:
    """Model Runner V2's steps, around :class:`PleRunnerHooks` (the same calls the patch
    adds to vLLM)."""

    def __init__(
        self,
        ckpt: Path,
        device: Any,
        *,
        deferred: bool = True,
        stats_every: float | None = None,
        time_stalls: bool = False,
    ) -> None:
        self.device = torch.device(device)
        names = checkpoint_tensor_names(ckpt)
        self.tables = {}
        for dense, i in enumerate(PLE_AT):
            self.tables[name_of(i)] = open_layer_table(
                ckpt,
                find_layer_table(names, i),
                rows=layout(dense).rows,
                row_bytes=HEAD_DIM,
                dtype="F8_E4M3",
            )
        plan_device = 0 if self.device.type == "cuda" else "cpu"
        self.hooks = build_hooks(
            self.tables,
            rows_per_token=H,
            max_rows=MAX_TOKENS * H,
            device=plan_device,
            timeout=TIMEOUT,
            deferred=deferred,
            stats_every=stats_every,
            time_stalls=time_stalls,
        )
        self.model = StandInModel(self.hooks, self.device)
        z = dict(device=self.device)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int32, **z)
        self.qsl = torch.zeros(MAX_REQS + 1, dtype=torch.int32, **z)
        self.ctx = torch.full((MAX_REQS, NGRAM - 1), EOS, dtype=torch.int32, **z)
        self.arange = torch.arange(MAX_REQS + 1, dtype=torch.int32, **z)
        # Request state, on the GPU only (async scheduling): last sample, last two tokens.
        self.last = torch.zeros(MAX_REQS, dtype=torch.int64, **z)
        self.hist = torch.full((MAX_REQS, NGRAM - 1), EOS, dtype=torch.int64, **z)
        self.manager: GraphManager | None = None
        self.kinds: list[str] = []  # one entry per executed forward, in ring order
        self.ends: list[Any] = []

    # -- inputs ---------------------------------------------------------------------------

    def prepare_dummy(self, tokens: int, reqs: int) -> None:
        self.input_ids[:tokens].zero_()
        self.ctx.fill_(EOS)
        if reqs == tokens:  # one token a request: built on the GPU, no host sync
            self.qsl.copy_(self.arange.clamp(max=tokens))
            return
        per, extra = divmod(tokens, reqs)
        lens = [per + (1 if r >= reqs - extra else 0) for r in range(reqs)]
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        self.qsl[: reqs + 1].copy_(torch.from_numpy(starts))
        self.qsl[reqs + 1 :].fill_(tokens)
        self.ctx.fill_(EOS)

    def prepare_decode(self, reqs: int, tokens: int) -> None:
        """Decode inputs from the previous step's samples, on the GPU (no host sync)."""
        self.input_ids[:reqs].copy_(self.last[:reqs])
        self.input_ids[reqs:tokens].zero_()
        self.qsl.copy_(self.arange.clamp(max=reqs))
        self.ctx[:reqs].copy_(self.hist[:reqs])
        self.ctx[reqs:].fill_(EOS)

    def postprocess_decode(self, reqs: int) -> None:
        self.hist[:reqs, 0].copy_(self.hist[:reqs, 1])
        self.hist[:reqs, 1].copy_(self.input_ids[:reqs])
        self.last[:reqs].copy_(self.model.sampled[:reqs])

    # -- MRV2 steps -----------------------------------------------------------------------

    def forward(self, tokens: int, kind: str) -> None:
        self.model(self.input_ids[:tokens], self.qsl, self.ctx)
        self.kinds.append(kind)

    def profile_run(self) -> None:
        self.prepare_dummy(MAX_TOKENS, MAX_REQS)
        with self.hooks.eager(dummy=True):
            self.forward(MAX_TOKENS, "dummy")

    def descs(self) -> list[Desc]:
        return [Desc(Mode.FULL, n, n) for n in sorted(SIZES, reverse=True)]

    def profile_cudagraph_memory(self) -> None:
        """MRV2 captures the two largest FULL graphs into a throwaway manager (and pool)
        and drops them."""
        self.hooks.quiesce()
        throwaway = GraphManager(self)
        throwaway.capture(self.descs()[:2], torch.cuda.graph_pool_handle())
        assert self.hooks.wait_descs == set(self.descs()[:2])
        del throwaway
        self.hooks.release_graphs()  # the plugin's runner does this for a new manager
        assert not self.hooks.wait_descs

    def warm_up(self) -> None:
        for n in SIZES:  # compile_or_warm_up_model's _dummy_run(size)
            self.prepare_dummy(n, n)
            with self.hooks.eager(dummy=True):
                self.forward(n, "dummy")

    def capture_model(self, pool: Any) -> None:
        self.hooks.quiesce()
        self.manager = GraphManager(self)
        self.manager.capture(self.descs(), pool)
        self.hooks.build_ids_graphs()  # the plugin's capture_model does this after

    def dispatch(self, reqs: int) -> Desc:
        size = min(s for s in SIZES if s >= reqs)
        return Desc(Mode.FULL, size, size)

    def decode_step(self) -> None:
        """One asynchronous decode step for ``self.reqs`` requests: inputs on the GPU,
        armed FULL replay, state update on the GPU; the host does not wait."""
        assert self.manager is not None
        desc = self.dispatch(self.reqs)
        self.prepare_decode(self.reqs, desc.num_tokens)
        manager = self.manager
        self.hooks.replay(desc, lambda: manager.run_fullgraph(desc))
        self.postprocess_decode(self.reqs)
        self.record_end()

    def dummy_replay(self, reqs: int) -> None:
        """``execute_dummy_batch`` (an idle DP rank): a FULL replay with dummy inputs."""
        assert self.manager is not None
        desc = self.dispatch(reqs)
        self.prepare_dummy(desc.num_tokens, desc.num_tokens)
        manager = self.manager
        self.hooks.replay(desc, lambda: manager.run_fullgraph(desc))
        self.kinds[-1] = "dummy-replay"
        self.record_end()

    def eager_step(self, prompts: list[list[int]]) -> None:
        """A mixed step, eager: one decode token for each running request (from the GPU)
        plus whole prompts for new requests. Opened as Model Runner V2's execute_model
        does (``hooks.step``): with a deferring plan the step is one more deferred step
        (pending replays are not completed first, the rows come through the workers),
        else the PLE op gathers on the host."""
        running = self.reqs
        lens = [1] * running + [len(p) for p in prompts]
        tokens = sum(lens)
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        self.input_ids[:running].copy_(self.last[:running])
        flat = [t for p in prompts for t in p]
        if flat:
            self.input_ids[running:tokens].copy_(torch.tensor(flat, dtype=torch.int32))
        nreq = running + len(prompts)
        self.qsl[: nreq + 1].copy_(torch.from_numpy(starts))
        self.qsl[nreq + 1 :].fill_(tokens)
        self.ctx[:running].copy_(self.hist[:running])
        self.ctx[running:].fill_(EOS)
        with self.hooks.step(dummy=False):
            self.forward(tokens, "eager")
        for r in range(nreq):  # the last two tokens of each sequence, and its sample
            end = int(starts[r + 1])
            seq = torch.cat([self.ctx[r].long(), self.input_ids[int(starts[r]) : end].long()])
            self.hist[r].copy_(seq[-2:])
            self.last[r].copy_(self.model.sampled[end - 1])
        self.reqs = nreq
        self.record_end()

    def record_end(self) -> None:
        ev = torch.cuda.Event() if self.device.type == "cuda" else None
        if ev is not None:
            ev.record()
        self.ends.append(ev)

    def shutdown(self) -> None:
        self.hooks.shutdown()
        for t in self.tables.values():
            t.close()

    # -- checks ---------------------------------------------------------------------------

    def settle(self) -> None:
        """Complete everything pending and wait (bounded) for the GPU."""
        self.hooks.quiesce()
        for ev in self.ends:
            if ev is not None:
                assert done(ev), "a step never finished on the GPU"
        self.ends.clear()

    def check_ring(self, first: int, tables: dict[str, np.ndarray]) -> int:
        """Check every executed step from index ``first`` (in ``kinds``): rows are the
        table's rows of the recorded ids, ids the hash of the recorded tokens. Returns
        the number of steps checked."""
        self.settle()
        last = len(self.kinds)
        assert last - first <= HIST, "checked too late: the ring wrapped"
        assert int(self.model.counter.item()) == last, "every executed forward writes a slot"
        m = self.model
        cpu_hash = {i: NGramHasher(layout(d), "cpu") for d, i in enumerate(PLE_AT)}
        checked = 0
        for step in range(first, last):
            slot = (step + 1) % HIST
            kind = self.kinds[step]
            n_tok = int(m.h_ntok[slot].item())
            tokens = m.h_tokens[slot, :n_tok].cpu()
            qsl, ctx = m.h_qsl[slot].cpu(), m.h_ctx[slot].cpu()
            for i in PLE_AT:
                ids = m.h_ids[i][slot, :n_tok].cpu()
                assert torch.equal(ids, cpu_hash[i](tokens, qsl, ctx)), (step, kind, i)
                if kind == "dummy":
                    continue  # an eager dummy publishes no data: the staging is stale
                rows = m.h_rows[i][slot, : n_tok * H].cpu().numpy()
                want = tables[name_of(i)][ids.reshape(-1).numpy()]
                np.testing.assert_array_equal(rows, want, err_msg=f"step {step} ({kind})")
                checked += 1
        return checked


def boot(
    ckpt: Path,
    device: str,
    *,
    deferred: bool = True,
    stats_every: float | None = None,
    time_stalls: bool = False,
) -> StandInRunner:
    """A runner on ``device`` (``"cuda"`` or ``"cpu"``) with no request running yet."""
    r = StandInRunner(
        ckpt, device, deferred=deferred, stats_every=stats_every, time_stalls=time_stalls
    )
    r.reqs = 0
    return r
