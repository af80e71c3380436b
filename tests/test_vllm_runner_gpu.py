"""The vLLM runner hooks on a real GPU, driven through Model Runner V2's sequence by a
stand-in runner (vLLM itself cannot be installed on the GPU machine).

The stand-in is a small decoder (torch layers) with two PLE layers whose ids are the
Qwen4Exp n-gram ids (:class:`qwen4exp_ngram.NGramHasher`, checked against vLLM's
own ``compute_ngram_ids`` in ``test_vllm_real.py``), computed in the graph from graph-static
inputs, staged at the top of the forward and joined before each consumer, exactly as the
plugin's Qwen4Exp model does through the same custom ops. The runner follows MRV2: load
(plan), profile run (eager dummy), CUDA graph memory profiling (a throwaway manager that
captures the two largest graphs), warm-up (eager dummies and a real eager step), capture
of several decode sizes (eager warm-up, then capture in runtime mode NONE on a capture
stream), then serving with asynchronous scheduling: decode inputs come from the previous
step's samples on the GPU, the host launches each step without waiting for the previous
one, eager prefill / mixed steps interleave, and dummy replays (DP idle ranks) run armed.

Every executed step records its tokens, ids and consumed rows in a device ring; every
step's rows are checked against the table and its ids against the hash of its tokens.
Faults: a bad id, an exception between arming and the replay, a replay nobody armed, an
exception in an eager step: never a hang (every wait for the GPU is bounded), never
wrong rows (the consumer reads zeros), a typed error at the next call.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gpu_wait import done as wait_done
from qwen4exp_ngram import NGramHasher, NGramLayout

import ple_memops as pm
from ple_memops.vllm import ops
from ple_memops.vllm.hooks import PleRunnerHooks, build_hooks
from ple_memops.vllm.tables import checkpoint_tensor_names, find_layer_table, open_layer_table

torch = pytest.importorskip("torch")

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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return write_checkpoint(tmp_path_factory.mktemp("standin"))


def _boot(
    ckpt: Path,
    device: str,
    *,
    deferred: bool = True,
    stats_every: float | None = None,
    time_stalls: bool = False,
) -> StandInRunner:
    r = StandInRunner(
        ckpt, device, deferred=deferred, stats_every=stats_every, time_stalls=time_stalls
    )
    r.reqs = 0
    return r


def _serve(r: StandInRunner, tables: dict[str, np.ndarray], rng: np.random.Generator) -> int:
    """The serving schedule; returns how many step rows were checked."""
    checked, first = 0, len(r.kinds)

    def check() -> None:
        nonlocal checked, first
        checked += r.check_ring(first, tables)
        first = len(r.kinds)

    def prompts(k: int) -> list[list[int]]:
        return [list(rng.integers(0, VOCAB, rng.integers(2, 9))) for _ in range(k)]

    r.eager_step(prompts(3))  # prefill 3 requests
    for phase in ((3, 30), (5, 30), (12, 30), (16, 20), (1, 20)):
        want, steps = phase
        if want > r.reqs:
            r.eager_step(prompts(want - r.reqs))  # mixed: decode tokens + new prompts
        else:
            r.reqs = want  # requests finished
        for k in range(steps):
            r.decode_step()
            if k % 10 == 5:
                r.dummy_replay(rng.integers(1, 9))  # armed like a real step
            if len(r.kinds) - first >= HIST - 4:
                check()
        check()
    return checked


@pytest.mark.gpu
def test_mrv2_sequence_every_step_checked(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, tables = ckpt
    r = _boot(path, "cuda", time_stalls=True)
    try:
        assert r.hooks.deferred, r.hooks.plan.reason
        pool = torch.cuda.graph_pool_handle()
        r.profile_run()
        r.profile_cudagraph_memory()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [EOS, 9]])  # a real eager warm-up step (MRV2 warmup_kernels)
        r.reqs = 0
        r.capture_model(pool)
        assert r.manager is not None
        assert r.hooks.wait_descs == set(r.descs())  # every captured size, not one
        assert r.check_ring(0, tables) > 0  # the eager steps so far (dummies: ids only)
        checked = _serve(r, tables, np.random.default_rng(7))
        # 130 decode steps and 13 dummy replays (plus the mixed eager steps), two layers.
        assert checked >= 2 * (130 + 13)
        assert r.hooks.armed_steps >= 130
        # Every mixed eager step went through the workers too (the warm-up one, the
        # prefill and the phases that add requests).
        assert r.hooks.eager_steps >= 4, r.hooks.eager_steps
        stats = r.hooks.plan.stats()
        for _name, (_rows, worker) in stats.items():
            assert worker is not None and worker.failures == 0 and worker.unarmed_replays == 0
        # The stats line over the whole run: every armed step, each layer's fills and
        # their mean READY -> FILLED time, as the workers counted them.
        line = r.hooks.log_stats(force=True)
        assert line is not None
        print(line)
        armed = r.hooks.driver.armed_steps
        eager = r.hooks.eager_steps
        assert f"{armed} deferred steps ({armed - eager} replays, {eager} eager)" in line
        for name, (_rows, worker) in stats.items():
            short = name[name.index("layers.") :].split(".ple")[0]
            mean = worker.ready_to_filled_ns_total / worker.fills / 1e3
            assert f"{short} {worker.fills} fills, {mean:.1f} us (" in line, (short, line)
            # Replays' fills apart from the eager steps' (every eager step filled once).
            assert worker.eager_fills == eager, (worker.eager_fills, eager)
            replay_ns = worker.ready_to_filled_ns_total - worker.eager_fill_ns_total
            replays = worker.fills - eager
            part = f"{replays} replays {replay_ns / replays / 1e3:.1f} us, {eager} eager "
            part += f"{worker.eager_fill_ns_total / eager / 1e3:.1f} us)"
            assert part in line, (part, line)
        # Each layer's GPU stall, one sample a step its consumer ran (replays, eager
        # steps, and the warm-ups' and dummies' inline consumers): at least every armed
        # step's, and the rows were checked right, so the stamps changed nothing.
        stalls = line.split("GPU stall per step: ")[1]
        for name in stats:
            short = name[name.index("layers.") :].split(".ple")[0]
            got = re.search(rf"{re.escape(short)} (\d+) steps, (\d+) stalled", stalls)
            assert got is not None and int(got.group(1)) >= armed, (short, stalls)
        assert r.hooks.log_stats() is None  # no stats_every: only forced lines
    finally:
        r.shutdown()


@pytest.mark.gpu
def test_mrv2_sequence_with_a_sync_plan_keeps_graphs(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """The same sequence where the plan cannot defer (forced): the FULL graphs stay, each
    replay preceded by its ids graph, one host wait and the parallel gathers; every step
    (replays, dummy replays, the mixed eager steps) checked against the table."""
    path, tables = ckpt
    r = _boot(path, "cuda", deferred=False)
    try:
        assert r.hooks.plan.mode == "sync" and not r.hooks.deferred
        pool = torch.cuda.graph_pool_handle()
        r.profile_run()
        r.profile_cudagraph_memory()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [EOS, 9]])
        r.reqs = 0
        r.capture_model(pool)
        assert r.hooks.wait_descs == set(r.descs())
        checked = _serve(r, tables, np.random.default_rng(11))
        assert checked >= 2 * (130 + 13)
        assert r.hooks.sync_replays >= 130 and r.hooks.armed_steps == 0
    finally:
        r.shutdown()


def _captured(path: Path) -> StandInRunner:
    r = _boot(path, "cuda")
    pool = torch.cuda.graph_pool_handle()
    r.profile_run()
    r.capture_model(pool)
    r.eager_step([[11, 12, 13], [14, 15], [16]])
    return r


def _no_wrong_rows(r: StandInRunner, kinds_from: int) -> None:
    """After a fault: the GPU finished every step (bounded) and each step from
    ``kinds_from`` on consumed all-zero rows, never another step's."""
    for ev in r.ends:
        if ev is not None:
            assert done(ev), "the GPU hung after a fault"
    r.ends.clear()
    assert len(r.kinds) > kinds_from
    for step in range(kinds_from, len(r.kinds)):
        slot = (step + 1) % HIST
        n = int(r.model.h_ntok[slot].item()) * H
        for i in PLE_AT:
            assert not r.model.h_rows[i][slot, :n].any().item(), (step, r.kinds[step])


@pytest.mark.gpu
def test_fault_bad_id_is_typed_and_releases_the_gpu(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, tables = ckpt
    r = _captured(path)
    try:
        for _ in range(4):
            r.decode_step()
        r.check_ring(0, tables)
        before = len(r.kinds)
        r.model.fault.fill_(1)  # enqueued: the next step's ids leave the table
        r.decode_step()
        r.model.fault.fill_(0)
        with pytest.raises(pm.PleMemopsError) as err:
            for _ in range(4):  # the error surfaces at a later call, typed
                r.decode_step()
            r.hooks.quiesce()
        assert isinstance(err.value, pm.RowIdError | pm.PoisonedError), err.value
        _no_wrong_rows(r, before)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()


@pytest.mark.gpu
def test_fault_exception_between_begin_and_replay(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, _ = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        r.decode_step()  # two steps armed
        assert r.manager is not None
        r.manager.fail_next_replay = True
        with pytest.raises(RuntimeError, match="injected"):
            r.decode_step()
        for ev in r.ends:  # the armed steps that did launch still finish
            assert ev is None or done(ev)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
        with pytest.raises(pm.PoisonedError):
            r.hooks.quiesce()
    finally:
        r.shutdown()


@pytest.mark.gpu
def test_fault_replay_nobody_armed(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, tables = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        r.check_ring(0, tables)
        assert r.manager is not None
        before = len(r.kinds)
        desc = r.dispatch(r.reqs)
        r.prepare_decode(r.reqs, desc.num_tokens)
        r.manager.run_fullgraph(desc)  # a runner bug: replayed without begin()
        r.record_end()
        _no_wrong_rows(r, before)
        with pytest.raises(pm.UnarmedReplayError):
            r.decode_step()
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()


@pytest.mark.gpu
def test_fault_exception_in_an_eager_step(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        with pytest.raises(ValueError, match="injected"), r.hooks.eager(dummy=False):
            raise ValueError("injected: a kernel failed mid-step")
        for ev in r.ends:
            assert ev is None or done(ev)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()


def test_stand_in_eager_on_the_host(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    """The same runner without a GPU (host plan, eager steps only): its inputs, ring and
    checks, so the GPU run starts from code that ran."""
    path, tables = ckpt
    r = _boot(path, "cpu")
    try:
        assert r.hooks.plan.mode == "host"
        r.profile_run()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [EOS, 9, 10]])
        for _ in range(6):
            r.eager_step([])
        r.eager_step([[1, 2]])
        assert r.check_ring(0, tables) == 2 * 8
    finally:
        r.shutdown()


def test_stats_lines_every_interval(
    ckpt: tuple[Path, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    """``stats_every``: a ``ple-memops stats`` line once the interval passed, checked at
    each step, and a last one at shutdown; none in between."""
    path, _tables = ckpt
    caplog.set_level(logging.INFO, logger="ple_memops")
    r = _boot(path, "cpu", stats_every=3600.0)
    try:
        r.profile_run()
        r.eager_step([[5, 6, 7, 8], [EOS, 9, 10]])
        assert not [m for m in caplog.messages if m.startswith("ple-memops stats")]
        r.hooks.stats_every = 1e-9  # every step from now on
        r.eager_step([])
        r.eager_step([])
        lines = [m for m in caplog.messages if m.startswith("ple-memops stats")]
        assert len(lines) == 2, lines
        assert "0 deferred steps (0 replays, 0 eager), 0 synchronous replays" in lines[0]
        assert "layers." in lines[0] and "0 fills" in lines[0]  # a host plan: no workers
        # The checkpoint was just written, so its pages are cached: adopted at open, no
        # row of these host gathers was read cold.
        assert "fills, 0.0% rows cold" in lines[0], lines[0]
        # Our own host time per engine step, by hook (two steps since the last line); no
        # GPU stall part on the host.
        assert "host us per engine step over 2: total p50 " in lines[0], lines[0]
        assert "step p50" in lines[0] and "stats p50" in lines[0], lines[0]
        assert "GPU stall" not in lines[0], lines[0]
    finally:
        r.shutdown()
    lines = [m for m in caplog.messages if m.startswith("ple-memops stats")]
    assert len(lines) == 3, lines  # the last interval's, at shutdown
    with pytest.raises(pm.InvalidArgumentError, match="stats_every must be > 0"):
        PleRunnerHooks(r.hooks.plan, rows_per_token=H, stats_every=0)
