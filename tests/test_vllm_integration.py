"""The vLLM integration layer without vLLM: Qwen4Exp ids, table discovery, the runner
hooks (against real host-mode Steps, and a recording fake for the step sequencing),
the custom ops (eager and under torch.compile), the GPU tests' stand-in runner on the host
(``vllm_stand_in.py``), and the settings.

The same layer against the real vLLM 0.33.0 is in ``test_vllm_real.py``; on a GPU, through
Model Runner V2's sequence, in ``test_vllm_runner_gpu.py``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ple_memops as pm
from ple_memops.errors import (
    ClosedError,
    InvalidArgumentError,
    PoisonedError,
    StateError,
    TableError,
)

torch = pytest.importorskip("torch")
import vllm_stand_in as stand_in  # noqa: E402
from qwen4exp_ngram import NGramHasher, NGramLayout, _is_prime  # noqa: E402
from safetensors.torch import save_file as save_torch  # noqa: E402

from ple_memops.step_costs import HOST_KINDS, HostTime, NoHostTime  # noqa: E402
from ple_memops.steps import StepCounters, Steps, StepTable  # noqa: E402
from ple_memops.vllm import hooks, ops, settings  # noqa: E402
from ple_memops.vllm.__main__ import main as cli  # noqa: E402
from ple_memops.vllm.hooks import PleRunnerHooks, deferrable  # noqa: E402
from ple_memops.vllm.tables import (  # noqa: E402
    LayerTable,
    checkpoint_tensor_names,
    find_layer_table,
    is_table_weight,
    open_layer_table,
)

# -- Qwen4Exp ids ----------------------------------------------------------------------


def _layout(dense: int = 0, eos: int = 7) -> NGramLayout:
    return NGramLayout.qwen4exp(
        ngram_size=3,
        heads_per_ngram=2,
        vocab_size=128,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        dense_layer_id=dense,
        eos_token_id=eos,
    )


def _reference_ids(
    lay: NGramLayout, tokens: list[int], starts: list[int], context: list[list[int]]
) -> list[list[int]]:
    """Per token, straight from the definition: walk back through the request's tokens,
    then its context; stop at the first EOS (it and everything older reads as EOS)."""
    mask = (1 << 64) - 1
    out = []
    for t, tok in enumerate(tokens):
        r = max(i for i in range(len(starts) - 1) if starts[i] <= t) if t >= starts[0] else 0
        seq = context[r] + tokens[starts[r] : t + 1]  # oldest first, current token last
        window, crossed = [tok], False
        for k in range(1, lay.ngram_size):
            prev = lay.eos_token_id if crossed else seq[-1 - k]
            crossed = crossed or prev == lay.eos_token_id
            window.append(prev)
        row = []
        for n in range(2, lay.ngram_size + 1):
            h = 0
            for k in range(n):
                h ^= (window[k] * lay.multipliers[k]) & mask
            signed = h - (1 << 64) if h >= 1 << 63 else h
            for j in range(lay.heads_per_ngram):
                head = (n - 2) * lay.heads_per_ngram + j
                row.append(lay.offsets[head] + signed % lay.sizes[head])
        out.append(row)
    return out


def test_layout_primes_and_rows() -> None:
    lay = _layout(dense=1)
    assert lay.heads == 4
    assert all(_is_prime(s) for s in lay.sizes)
    # Layer 1's heads take the primes after layer 0's: consecutive, all >= the base.
    lay0 = _layout(dense=0)
    assert lay0.sizes == (1009, 1013, 1019, 1021)
    assert lay.sizes[0] > lay0.sizes[-1]
    assert [p for p in range(1000, lay.sizes[-1] + 1) if _is_prime(p)] == [
        *lay0.sizes,
        *lay.sizes,
    ]
    assert lay.offsets == (0, lay.sizes[0], sum(lay.sizes[:2]), sum(lay.sizes[:3]))
    assert lay.rows % 128 == 0 and 0 <= lay.rows - sum(lay.sizes) < 128
    assert all(m % 2 == 1 and 0 < m < 1 << 63 for m in lay.multipliers)
    assert _layout(dense=0).multipliers != lay.multipliers


def test_ids_match_the_definition_on_random_layouts() -> None:
    rng = random.Random(3)
    lay = _layout(dense=2)
    hasher = NGramHasher(lay)
    for _ in range(150):
        nreq = rng.randint(1, 5)
        lens = [rng.randint(0, 6) for _ in range(nreq)]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        total = starts[-1] + rng.randint(0, 3)  # trailing padding tokens
        if total == 0:
            continue
        toks = [rng.choice([7, rng.randint(0, 127)]) for _ in range(total)]
        ctx = [[rng.choice([7, rng.randint(0, 127)]) for _ in range(2)] for _ in range(nreq)]
        got = hasher(
            torch.tensor(toks, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32),
        )
        assert got.dtype == torch.int64 and tuple(got.shape) == (total, lay.heads)
        assert got.tolist() == _reference_ids(lay, toks, starts, ctx)
        assert int(got.min()) >= 0 and int(got.max()) < lay.rows


def test_ids_into_out_and_wrapping_products() -> None:
    lay = NGramLayout.qwen4exp(
        ngram_size=4,
        heads_per_ngram=3,
        vocab_size=248320,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        dense_layer_id=0,
        eos_token_id=248044,
    )
    toks = [248319, 5, 248044, 17, 248318, 9]
    starts, ctx = [0, 4, 6], [[1, 2, 248044], [248044, 3, 4]]
    out = torch.full((6, lay.heads), -1, dtype=torch.int64)
    ret = NGramHasher(lay)(torch.tensor(toks), torch.tensor(starts), torch.tensor(ctx), out=out)
    assert ret is out
    assert out.tolist() == _reference_ids(lay, toks, starts, ctx)


# -- tables ----------------------------------------------------------------------------

H, HEAD_DIM = 4, 16  # 4 ids per token, FP8 rows of 16 bytes


def _write_checkpoint(
    root: Path, layers: dict[int, int], *, index: bool = True, shards: int = 3
) -> dict[int, np.ndarray]:
    """Layer index -> table rows, stored as row shards next to an unrelated weight."""
    rng = np.random.default_rng(0)
    tables, files, weight_map = {}, {}, {}
    for i, rows in layers.items():
        data = rng.integers(0, 256, (rows, HEAD_DIM), dtype=np.uint8)
        tables[i] = data
        per = -(-rows // shards)
        tensors = {
            f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight": data[
                k * per : (k + 1) * per
            ].view(np.uint8)
            for k in range(shards)
        }
        files[f"ple-{i}.safetensors"] = tensors
    files["rest.safetensors"] = {"model.embed_tokens.weight": np.ones((4, 4), np.float32)}
    for fname, tensors in files.items():
        # FP8 rows (numpy has no FP8): the bytes, written as float8_e4m3fn by safetensors.
        save_torch(
            {
                k: torch.from_numpy(np.ascontiguousarray(v)).view(torch.float8_e4m3fn)
                if v.dtype == np.uint8
                else torch.from_numpy(v)
                for k, v in tensors.items()
            },
            str(root / fname),
        )
        weight_map.update({k: fname for k in tensors})
    if index:
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return tables


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict[int, np.ndarray]]:
    return tmp_path, _write_checkpoint(tmp_path, {1: 4096, 3: 2048})


def test_table_discovery(ckpt: tuple[Path, dict[int, np.ndarray]]) -> None:
    root, tables = ckpt
    names = checkpoint_tensor_names(root)
    assert "model.embed_tokens.weight" in names
    index = root / "model.safetensors.index.json"
    index.rename(root / "saved.json")
    assert sorted(checkpoint_tensor_names(root)) == sorted(names)  # from the headers
    (root / "saved.json").rename(index)
    spec = find_layer_table(names, 1)
    pattern = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_{}.weight"
    assert spec == LayerTable(1, pattern=pattern)
    with pytest.raises(TableError, match="no PLE table for layer 2"):
        find_layer_table(names, 2)
    both = [*names, "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.weight"]
    with pytest.raises(TableError, match="ambiguous"):
        find_layer_table(both, 1)
    whole = find_layer_table(["x.layers.5.ple.ple_embedding.ngram_embedding.weight"], 5)
    assert whole.name == "x.layers.5.ple.ple_embedding.ngram_embedding.weight"
    table = open_layer_table(root, spec, rows=4096, row_bytes=HEAD_DIM, dtype="F8_E4M3")
    try:
        ids = np.array([0, 1365, 1366, 4095, 7])
        assert np.array_equal(table.gather(ids), tables[1][ids])
    finally:
        table.close()
    with pytest.raises(TableError, match="4096 rows, the model has 4224"):
        open_layer_table(root, spec, rows=4224)
    with pytest.raises(TableError, match="dtype F8_E4M3, the model's is BF16"):
        open_layer_table(root, spec, dtype="BF16")
    with pytest.raises(TableError, match="no such checkpoint"):
        checkpoint_tensor_names(root / "missing")


def test_is_table_weight() -> None:
    assert is_table_weight("model.layers.2.ple.ple_embedding.ngram_embedding.shard_17.weight")
    assert is_table_weight("model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight")
    assert not is_table_weight("model.layers.2.ple.ple_embedding.ngram_embedding.weight_scale")
    assert not is_table_weight("model.layers.2.ple.kv_proj.weight")
    assert not is_table_weight("model.layers.2.ple.ple_embedding.layer_multipliers")


# -- hooks and ops with real (host-mode) Steps ------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str


FULL, NONE, PIECEWISE = Mode("FULL"), Mode("NONE"), Mode("PIECEWISE")


@dataclass(frozen=True)
class Desc:
    """The fields of vLLM's ``BatchExecutionDescriptor`` the hooks read."""

    cg_mode: Mode
    num_tokens: int
    uniform_token_count: int | None = 1
    num_ubatches: int = 1


class Manager:
    """The engine's graph manager: replays are recorded, not run."""

    def __init__(self) -> None:
        self.replays: list[Any] = []

    def run_fullgraph(self, desc: Any) -> str:
        self.replays.append(desc)
        return f"out{desc.num_tokens}"


def _replay(hk: PleRunnerHooks, mgr: Manager, desc: Desc) -> Any:
    return hk.replay(desc, lambda: mgr.run_fullgraph(desc))


def _host_plan(root: Path) -> tuple[PleRunnerHooks, dict[str, Any], dict[str, Any]]:
    """Host-mode steps, their tables, and the layers the ops find by name (what vLLM's
    forward context holds: each carries the hooks)."""
    names = checkpoint_tensor_names(root)
    tables = {
        f"model.layers.{i}.ple.ple_embedding.ngram_embedding": open_layer_table(
            root, find_layer_table(names, i)
        )
        for i in (1, 3)
    }
    steps = Steps.build(tables, max_rows=64 * H, device="cpu", log_fallback=False)
    hk = PleRunnerHooks(steps, rows_per_token=H)
    layers = {n: SimpleNamespace(ple_memops_hooks=hk) for n in tables}
    return hk, tables, layers


def test_eager_ops_gather_table_bytes_on_the_host(
    ckpt: tuple[Path, dict[int, np.ndarray]],
) -> None:
    root, data = ckpt
    hk, tables, layers = _host_plan(root)
    with ops.layers(layers):
        _eager_ops_gather(hk, tables, layers, data)


def _eager_ops_gather(
    hk: PleRunnerHooks, tables: dict[str, Any], layers: dict[str, Any], data: Any
) -> None:
    try:
        assert hk.steps.mode == "host" and not hk.deferred
        assert "no CUDA device" in str(hk.steps.reason)
        name = "model.layers.1.ple.ple_embedding.ngram_embedding"
        ids = torch.randint(0, 4096, (5, H), dtype=torch.int64)
        out = hk.output(name, 5)
        assert tuple(out.shape) == (5 * H, HEAD_DIM) and out.dtype == torch.uint8
        with hk.eager(dummy=False):
            ops.stage_rows(ids, out, name)
            ops.join_rows(out, name)
        assert np.array_equal(out.numpy(), data[1][ids.reshape(-1).numpy()])
        # A dummy step publishes no data: the staging keeps the last rows.
        before = out.clone()
        with hk.eager(dummy=True):
            ops.stage_rows(torch.zeros((5, H), dtype=torch.int64), out, name)
            ops.join_rows(out, name)
        assert torch.equal(out, before)
        # Outside any scope the op gathers for real (e.g. a direct model call).
        ops.stage_rows(ids.flip(0), out, name)
        assert np.array_equal(out.numpy(), data[1][ids.flip(0).reshape(-1).numpy()])
        # A bad id is a typed error before anything is written.
        bad = ids.clone()
        bad[2, 1] = 4096
        with pytest.raises(pm.RowIdError), hk.eager(dummy=False):
            ops.stage_rows(bad, out, name)
        with pytest.raises(PoisonedError):  # the exception aborted every table
            with hk.eager(dummy=False):
                ops.stage_rows(ids, out, name)
    finally:
        hk.shutdown()
        for layer in layers.values():  # as the runner's shutdown unbinds them
            layer.ple_memops_hooks = None
    with pytest.raises(StateError, match="has no steps bound"):
        ops.stage_rows(ids, out, name)
    with pytest.raises(ClosedError):
        hk.quiesce()
    hk.shutdown()  # idempotent
    for t in tables.values():
        t.close()


def test_an_eager_forward_of_a_sync_plan_gathers_every_layer_at_once(
    ckpt: tuple[Path, dict[int, np.ndarray]],
) -> None:
    """Every PLE layer staged at the top of the forward, then joined: the rows of both
    layers come from one copy of their ids and the parallel gathers, right at the first
    consumer; a second forward in the same engine step gets its own rows."""
    root, data = ckpt
    hk, tables, layers = _host_plan(root)
    names = list(tables)
    try:
        g = torch.Generator().manual_seed(5)
        with hk.step(dummy=False), ops.layers(layers):
            for _ in range(2):
                ids = {n: torch.randint(0, 2048, (3, H), generator=g) for n in names}
                for n in names:
                    ops.stage_rows(ids[n], hk.output(n, 3), n)
                for n, i in zip(names, (1, 3), strict=True):
                    ops.join_rows(hk.output(n, 3), n)
                    got = hk.output(n, 3).numpy()
                    np.testing.assert_array_equal(got, data[i][ids[n].reshape(-1).numpy()])
    finally:
        hk.shutdown()
        for t in tables.values():
            t.close()


def test_op_output_must_be_the_staging_for_eager_copy(
    ckpt: tuple[Path, dict[int, np.ndarray]],
) -> None:
    root, data = ckpt
    hk, tables, layers = _host_plan(root)
    try:
        name = "model.layers.3.ple.ple_embedding.ngram_embedding"
        ids = torch.tensor([[0, 1, 2, 2047]], dtype=torch.int64)
        other = torch.zeros((H, HEAD_DIM), dtype=torch.uint8)
        with hk.eager(dummy=False), ops.layers(layers):
            ops.stage_rows(ids, other, name)  # eagerly a separate output gets a copy
        assert np.array_equal(other.numpy(), data[3][[0, 1, 2, 2047]])
    finally:
        hk.shutdown()
        for t in tables.values():
            t.close()


def test_ops_compile_fullgraph(ckpt: tuple[Path, dict[int, np.ndarray]]) -> None:
    root, data = ckpt
    hk, tables, layers = _host_plan(root)
    name = "model.layers.1.ple.ple_embedding.ngram_embedding"
    out = hk.output(name, 3)

    def consumer(ids: Any, out: Any) -> Any:
        torch.ops.ple_memops.stage_rows(ids, out, name)
        torch.ops.ple_memops.join_rows(out, name)
        return out.view(torch.float8_e4m3fn).to(torch.float32).sum(dim=-1)

    try:
        compiled = torch.compile(consumer, fullgraph=True, backend="aot_eager")
        ids = torch.randint(0, 4096, (3, H), dtype=torch.int64)
        with hk.eager(dummy=False), ops.layers(layers):
            got = compiled(ids, out)
        want = (
            torch.from_numpy(data[1][ids.reshape(-1).numpy()])
            .view(torch.float8_e4m3fn)
            .to(torch.float32)
            .sum(dim=-1)
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    finally:
        hk.shutdown()
        for t in tables.values():
            t.close()


def test_ops_without_a_forward_context_say_so() -> None:
    out = torch.zeros((4, 8), dtype=torch.uint8)
    with pytest.raises(StateError, match="no forward context names the PLE layer 'x'"):
        ops.stage_rows(torch.zeros((2, 2), dtype=torch.int64), out, "x")
    with ops.layers({}), pytest.raises(StateError, match="has no steps bound"):
        ops.join_rows(out, "x")


# -- hooks sequencing against a recording plan -------------------------------------------


class Staged:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def join(self, stream: Any = None) -> None:
        self.log.append(f"join {self.name}")


class RecordingPlan:
    """The tables' steps as the hooks use them (``ple_memops.steps.Steps``: arming up to
    ``depth`` steps, completing the oldest first, settling, all-or-none aborts), recording
    every call."""

    def __init__(self, names: list[str], depth: int = 2, mode: str = "deferred") -> None:
        self.log: list[str] = []
        self.names, self.depth, self.mode = names, depth, mode
        self.deferred = mode == "deferred"
        self.reason = None if self.deferred else "probe said sync"
        self.timeout = 5.0
        self.armed: list[int] = []
        self.eager_begins: list[bool] = []  # arm()'s eager for each step, in order
        self.poisoned: str | None = None
        self.closed = False
        self.fail_complete: BaseException | None = None
        self.bufs = {n: torch.zeros((256, 8), dtype=torch.uint8) for n in names}
        self.counts = {"armed": 0, "eager": 0, "completed": 0}

    @property
    def tables(self) -> dict[str, Any]:
        # What the stats line reads of a table: its page counters (none here).
        return {n: SimpleNamespace(table=SimpleNamespace(page_stats=dict)) for n in self.names}

    @property
    def in_flight(self) -> int:
        return len(self.armed)

    @property
    def poison_cause(self) -> str | None:
        return self.poisoned

    def counters(self, name: str | None = None) -> StepCounters:
        return StepCounters(**self.counts)

    @property
    def step_counts(self) -> tuple[int, int, int]:
        return self.counts["armed"], self.counts["eager"], self.counts["completed"]

    def stall_samples(self) -> dict[str, Any]:
        return {}

    def _live(self) -> None:
        if self.closed:
            raise ClosedError("closed")
        if self.poisoned is not None:
            raise PoisonedError(self.poisoned)

    def stage(self, name: str, ids: Any, *, rows: int) -> Staged:
        self._live()
        self.log.append(f"stage {name} {rows}")
        return Staged(self.log, name)

    def stage_eager(self, name: str, ids: Any, *, rows: int) -> Staged:
        self._live()
        assert self.armed and self.armed[-1] == rows, "eager stage without its step begun"
        self.log.append(f"eager {name} {rows}")
        return Staged(self.log, name)

    def arm(self, rows: int, eager: bool = False) -> tuple[int, int, int]:
        """As the native step: completes the oldest while ``depth`` are armed, then arms;
        a failure aborts every table."""
        self._live()
        done = 0
        while len(self.armed) >= self.depth:
            self._complete()
            done += 1
        self.armed.append(rows)
        self.eager_begins.append(eager)
        self.counts["armed"] += 1
        self.counts["eager"] += int(eager)
        self.log.append(f"begin {rows}")
        return done, 0, 0

    def _complete(self) -> None:
        if self.fail_complete is not None:
            self.abort(f"completing a step: {self.fail_complete}")
            raise self.fail_complete
        self.log.append(f"complete {self.armed.pop(0)}")
        self.counts["completed"] += 1

    def settle(self, limit: int = 0) -> int:
        self._live()
        done = 0
        while len(self.armed) > limit:
            self._complete()
            done += 1
        return done

    def drain(self) -> int:
        return self.settle(0)

    def raise_if_failed(self) -> None:
        if self.poisoned is not None:
            raise PoisonedError(self.poisoned)

    def guard(self, what: str) -> Any:
        steps = self

        class _G:
            def __enter__(self) -> None:
                return None

            def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
                if exc is not None:
                    steps.abort_on(what, exc)

        return _G()

    def gather_now(
        self, name: str, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> Any:
        self.drain()
        self.log.append(f"gather {name} {rows}")
        return self.bufs[name][:rows]

    def gather_many_now(
        self, ids: dict[str, Any], rows: int | None = None, *, stream: Any = None
    ) -> dict[str, Any]:
        self.drain()
        out = {}
        for name, table_ids in ids.items():
            n = len(table_ids) if rows is None else rows
            self.log.append(f"gather {name} {n}")
            out[name] = self.bufs[name][:n]
        return out

    def dummy_now(self, name: str, rows: int, *, stream: Any = None) -> Any:
        self.drain()
        self.log.append(f"dummy {name} {rows}")
        return self.bufs[name][:rows]

    def staging(self, name: str, n: int | None = None) -> Any:
        return self.bufs[name][:n]

    def abort(self, reason: str) -> None:
        self.log.append("abort")
        self.poisoned = self.poisoned or reason

    def abort_on(self, what: str, exc: BaseException) -> None:
        if not self.closed:
            self.abort(f"exception in {what}: {exc!r}")

    def drain_for_shutdown(self) -> None:
        if self.closed:
            return
        try:
            self.drain()
        except BaseException as exc:
            self.abort(f"shutdown: {exc!r}")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.drain_for_shutdown()
        self.log.append("close")
        self.closed = True


@pytest.fixture()
def capturing(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Pretend the current stream is (not) being captured, as the test says."""
    state = [False]
    monkeypatch.setattr(hooks, "_capturing", lambda _t: state[0])
    return state


def _capture(hk: PleRunnerHooks, mgr: Manager, desc: Desc, cap: list[bool], run: Any) -> None:
    cap[0] = True
    try:
        with hk.capture(desc):
            run()
    finally:
        cap[0] = False


def _forward(hk: PleRunnerHooks, names: list[str], tokens: int) -> None:
    """The model: stage every layer at the top, join each before its consumer."""
    ids = torch.zeros((tokens, 2), dtype=torch.int64)
    for n in names:
        hk.stage(n, ids, hk.output(n, tokens))
    for n in names:
        hk.join(n, hk.output(n, tokens))


def test_capture_records_deferrable_graphs(capturing: list[bool]) -> None:
    names = ["a", "b"]
    plan = RecordingPlan(names)
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    for size in (1, 4, 8):  # every captured decode size, not only one token
        with hk.warmup():
            _forward(hk, names, size)
        _capture(hk, mgr, Desc(FULL, size), capturing, lambda s=size: _forward(hk, names, s))
    assert hk.wait_descs == {Desc(FULL, 1), Desc(FULL, 4), Desc(FULL, 8)}
    assert plan.log[:6] == ["dummy a 2", "dummy b 2", "stage a 2", "stage b 2", "join a", "join b"]
    # A mixed FULL graph (cudagraph_mode=FULL) defers too: its ids come from the graph.
    _capture(hk, mgr, Desc(FULL, 8, None), capturing, lambda: _forward(hk, names, 8))
    assert Desc(FULL, 8, None) in hk.wait_descs
    # A graph without PLE work (another rank's layers) is not armed at replay.
    _capture(hk, mgr, Desc(FULL, 2), capturing, lambda: None)
    assert Desc(FULL, 2) not in hk.wait_descs


@pytest.mark.parametrize(
    ("desc", "match"),
    [
        (Desc(PIECEWISE, 4, None), "a PIECEWISE graph"),
        (Desc(FULL, 4, 1, num_ubatches=2), "microbatched"),
    ],
)
def test_capture_of_other_graphs_raises(capturing: list[bool], desc: Desc, match: str) -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    refusal = f"cannot be gathered inside this CUDA graph capture.*{match}"
    with pytest.raises(StateError, match=refusal):
        _capture(hk, mgr, desc, capturing, lambda: _forward(hk, ["a"], 4))
    assert not hk.wait_descs and "stage a 8" not in plan.log
    # Captured without any scope (a runner without the hooks): the same refusal.
    capturing[0] = True
    with pytest.raises(StateError, match="opened no ple-memops capture scope"):
        _forward(hk, ["a"], 4)
    capturing[0] = False


def test_capture_in_sync_mode_raises(capturing: list[bool]) -> None:
    hk = PleRunnerHooks(RecordingPlan(["a"], mode="sync"), rows_per_token=2)
    with pytest.raises(StateError, match="synchronous here \\(probe said sync\\)"):
        _capture(hk, Manager(), Desc(FULL, 4), capturing, lambda: _forward(hk, ["a"], 4))


class _FakeGraphParts:
    """What a synchronous replay touches of its ids graph, recorded."""

    def __init__(self, log: list[str], what: str) -> None:
        self.log, self.what = log, what

    def replay(self) -> None:
        self.log.append(f"{self.what} replay")

    def record(self) -> None:
        self.log.append(f"{self.what} record")

    def synchronize(self) -> None:
        self.log.append(f"{self.what} synchronize")


def test_a_sync_plan_keeps_full_graphs(
    capturing: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous plan (no deferral on this device) keeps its FULL graphs: the capture
    records the layers' graph-static ids and the model's ids source; before each replay
    the ids graph runs, the host waits for its copy of the ids, every layer is gathered
    (in parallel, ``gather_many_now``), then the graph replays. Nothing is armed."""
    names = ["a", "b"]
    plan = RecordingPlan(names, mode="sync")
    hk = PleRunnerHooks(plan, rows_per_token=2, sync_graphs=True)
    mgr = Manager()
    built: list[Any] = []

    def fake_capture(entry: Any) -> None:
        built.append(entry)
        entry.graph = _FakeGraphParts(plan.log, "ids")
        entry.done = _FakeGraphParts(plan.log, "event")
        entry.host = torch.arange(len(entry.names) * entry.rows).reshape(len(entry.names), -1)

    monkeypatch.setattr(hooks, "_capture_ids_graph", fake_capture)
    sources: list[str] = []

    def forward(size: int) -> None:
        hk.note_ids_source(lambda: sources.append(f"ids {size}"))
        _forward(hk, names, size)

    for size in (1, 4):
        _capture(hk, mgr, Desc(FULL, size), capturing, lambda s=size: forward(s))
    assert hk.wait_descs == {Desc(FULL, 1), Desc(FULL, 4)}
    assert not [e for e in plan.log if e.startswith(("stage", "begin", "gather"))]
    assert hk.build_ids_graphs() == 2 and hk.build_ids_graphs() == 0
    assert [e.rows for e in built] == [2, 8] and built[0].names == names
    built[1].source()
    assert sources == ["ids 4"]
    plan.log.clear()
    assert _replay(hk, mgr, Desc(FULL, 4)) == "out4"
    assert plan.log == [
        "ids replay",
        "event record",
        "event synchronize",
        "gather a 8",
        "gather b 8",
    ]
    assert hk.sync_replays == 1 and hk.armed_steps == 0 and plan.in_flight == 0
    # A graph captured without an ids source cannot be replayed with fresh rows: refused.
    with pytest.raises(StateError, match="gave no ids source"):
        _capture(hk, mgr, Desc(FULL, 2), capturing, lambda: _forward(hk, names, 2))
    hk.release_graphs()
    assert not hk.wait_descs and hk.build_ids_graphs() == 0


def test_released_graphs_replay_unarmed_even_the_last_one_replayed(
    capturing: list[bool],
) -> None:
    """The hooks remember the last descriptor they armed for (vLLM replays the captured
    objects themselves): once the engine drops its graphs, that very object replays
    unarmed, and a capture of it records it again."""
    names = ["a", "b"]
    plan, hk, mgr = _captured(names, (4,), capturing)
    desc = next(iter(hk.wait_descs))
    _replay(hk, mgr, desc)
    _replay(hk, mgr, desc)  # the same object again: armed again
    assert plan.log == ["begin 8", "begin 8"]
    hk.release_graphs()
    plan.log.clear()
    assert _replay(hk, mgr, desc) == "out4" and plan.log == []  # not armed
    _capture(hk, mgr, desc, capturing, lambda: _forward(hk, names, 4))
    plan.log.clear()
    _replay(hk, mgr, desc)
    assert plan.log == ["begin 8"]
    hk.shutdown()  # forgets every graph too: a replay after it is the engine's own
    plan.log.clear()
    assert _replay(hk, mgr, desc) == "out4" and plan.log == []


def test_capture_checks(capturing: list[bool]) -> None:
    plan = RecordingPlan(["a", "b"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    with pytest.raises(StateError, match="but not for \\['b'\\]"):
        _capture(hk, mgr, Desc(FULL, 4), capturing, lambda: _forward(hk, ["a"], 4))
    ids = torch.zeros((4, 2), dtype=torch.int64)

    def unjoined() -> None:
        for n in ("a", "b"):
            hk.stage(n, ids, hk.output(n, 4))

    with pytest.raises(StateError, match="never joined"):
        _capture(hk, mgr, Desc(FULL, 4), capturing, unjoined)
    with pytest.raises(StateError, match="produced 8 row ids under capture"):
        _capture(hk, mgr, Desc(FULL, 3), capturing, lambda: _forward(hk, ["a", "b"], 4))
    with pytest.raises(StateError, match="staging view"):
        _capture(
            hk,
            mgr,
            Desc(FULL, 4),
            capturing,
            lambda: hk.stage("a", ids, torch.zeros((8, 8), dtype=torch.uint8)),
        )
    with pytest.raises(StateError, match="stream is not capturing"), hk.capture(Desc(FULL, 4)):
        _forward(hk, ["a", "b"], 4)
    with pytest.raises(StateError, match="already open"), hk.eager(dummy=True):
        with hk.warmup():
            pass
    assert not hk.wait_descs


def _captured(
    names: list[str], sizes: tuple[int, ...], capturing: list[bool]
) -> tuple[RecordingPlan, PleRunnerHooks, Manager]:
    """A recording plan of ``names``, its hooks and a manager, a FULL graph of each size
    captured with rows (two ids a token), the plan's log cleared."""
    plan = RecordingPlan(names)
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    for size in sizes:
        _capture(hk, mgr, Desc(FULL, size), capturing, lambda s=size: _forward(hk, names, s))
    plan.log.clear()
    return plan, hk, mgr


def test_replays_keep_two_steps_armed(capturing: list[bool]) -> None:
    names = ["a", "b"]
    plan, hk, mgr = _captured(names, (2, 4), capturing)
    plan.eager_begins.clear()
    # Async scheduling: the host launches step N+1 before completing step N.
    assert _replay(hk, mgr, Desc(FULL, 2)) == "out2"
    assert _replay(hk, mgr, Desc(FULL, 4)) == "out4"
    assert plan.log == ["begin 4", "begin 8"]
    _replay(hk, mgr, Desc(FULL, 4))  # the third completes only the oldest
    assert plan.log[2:] == ["complete 4", "begin 8"] and plan.in_flight == 2
    # A FULL graph without PLE work replays unarmed and leaves the pending steps alone.
    _replay(hk, mgr, Desc(FULL, 16))
    assert plan.in_flight == 2 and mgr.replays[-1] == Desc(FULL, 16)
    # An eager forward (a prefill, a mixed batch) is one more deferred step: armed when
    # its first PLE op runs (completing only the oldest, as a replay does), every layer
    # staged on its side stream and joined before its consumer; nothing is gathered on
    # the launching thread.
    with hk.step(dummy=False):
        _forward(hk, names, 3)
    assert plan.log[4:] == ["complete 8", "begin 6", "eager a 6", "eager b 6", "join a", "join b"]
    assert hk.armed_steps == 3 and hk.eager_steps == 1 and hk.recorded_graphs == 2
    # Two forwards in one engine step: two steps.
    with hk.step(dummy=False):
        _forward(hk, names, 1)
        _forward(hk, names, 2)
    assert [e for e in plan.log[10:] if e.startswith("begin")] == ["begin 2", "begin 4"]
    assert hk.eager_steps == 3
    # hk.eager() completes everything first (an eager pass that must not overlap).
    with hk.eager(dummy=False):
        _forward(hk, names, 3)
    assert plan.log[-7:] == [
        "complete 2",
        "complete 4",
        "begin 6",
        "eager a 6",
        "eager b 6",
        "join a",
        "join b",
    ]
    # Dummy replays after capture are armed like real steps.
    _replay(hk, mgr, Desc(FULL, 2))
    assert plan.log[-1] == "begin 4"
    # Eager forwards' steps are begun as eager (their fills are counted apart from the
    # replays' in the stats lines), replays' not.
    assert plan.eager_begins == [False] * 3 + [True] * 4 + [False]
    hk.quiesce()
    assert plan.log[-1] == "complete 4" and plan.in_flight == 0
    hk.shutdown()
    assert plan.log[-1] == "close"


def test_eager_forwards_of_a_sync_plan_gather_on_the_host(capturing: list[bool]) -> None:
    names = ["a", "b"]
    plan = RecordingPlan(names, mode="sync")
    hk = PleRunnerHooks(plan, rows_per_token=2)
    with hk.step(dummy=False):
        _forward(hk, names, 3)
    assert plan.log == ["gather a 6", "gather b 6"] and hk.eager_steps == 0
    with hk.step(dummy=True):
        _forward(hk, names, 3)
    assert plan.log[2:] == ["dummy a 6", "dummy b 6"]


def test_eager_forward_checks(capturing: list[bool]) -> None:
    names = ["a", "b"]
    plan = RecordingPlan(names)
    hk = PleRunnerHooks(plan, rows_per_token=2)
    ids = torch.zeros((3, 2), dtype=torch.int64)
    # A layer left out: its worker was armed for the step, so the step is refused (and
    # the plan aborted: no GPU wait outlives it).
    with pytest.raises(StateError, match="but not for \\['b'\\]"), hk.step(dummy=False):
        hk.stage("a", ids, hk.output("a", 3))
        hk.join("a", hk.output("a", 3))
    assert plan.poisoned is not None
    plan = RecordingPlan(names)
    hk = PleRunnerHooks(plan, rows_per_token=2)
    with pytest.raises(StateError, match="never joined"), hk.step(dummy=False):
        for n in names:
            hk.stage(n, ids, hk.output(n, 3))
    assert plan.log[-3:-1] == ["join a", "join b"]  # ordered before anything after the step
    plan = RecordingPlan(names)
    hk = PleRunnerHooks(plan, rows_per_token=2)
    with pytest.raises(StateError, match="4 row ids in an eager step of 6"):
        with hk.step(dummy=False):
            hk.stage("a", ids, hk.output("a", 3))
            hk.stage("b", ids[:2], hk.output("b", 2))


def test_exceptions_abort(capturing: list[bool]) -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    _capture(hk, mgr, Desc(FULL, 4), capturing, lambda: _forward(hk, ["a"], 4))

    def boom(desc: Any) -> None:
        raise KeyboardInterrupt

    mgr.run_fullgraph = boom  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        _replay(hk, mgr, Desc(FULL, 4))
    assert plan.log[-2:] == ["begin 8", "abort"]
    assert "exception in the replay of Desc" in (plan.poisoned or "")
    with pytest.raises(PoisonedError):
        hk.quiesce()
    with pytest.raises(PoisonedError):
        _replay(hk, mgr, Desc(FULL, 4))
    hk.shutdown()  # logs, closes, never raises
    assert plan.closed


def test_an_aborted_plan_with_nothing_in_flight_still_refuses_quiesce(
    capturing: list[bool],
) -> None:
    # The real worker drops its armed steps once its thread has seen them released (an
    # abort), so the plan can be poisoned with nothing in flight: quiesce (before a
    # capture, an eager pass, graph release) must still refuse, not pass silently.
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    _capture(hk, mgr, Desc(FULL, 4), capturing, lambda: _forward(hk, ["a"], 4))
    _replay(hk, mgr, Desc(FULL, 4))
    hk.abort("a failed launch")
    plan.armed.clear()
    assert plan.in_flight == 0
    with pytest.raises(PoisonedError, match="a failed launch"):
        hk.quiesce()
    assert hk.wait_descs == {Desc(FULL, 4)}
    with pytest.raises(PoisonedError, match="a failed launch"):
        hk.release_graphs()
    assert hk.wait_descs == frozenset()  # the engine's graphs are gone all the same
    with pytest.raises(PoisonedError), hk.eager(dummy=False):
        pass
    hk.shutdown()
    assert plan.closed


def test_failed_completion_aborts_and_raises(capturing: list[bool]) -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    mgr = Manager()
    _capture(hk, mgr, Desc(FULL, 4), capturing, lambda: _forward(hk, ["a"], 4))
    _replay(hk, mgr, Desc(FULL, 4))
    plan.fail_complete = pm.RowIdError("row id 99 out of range")
    with pytest.raises(pm.RowIdError), hk.eager(dummy=False):
        pass
    assert plan.log[-1] == "abort"
    with pytest.raises(PoisonedError):
        _replay(hk, mgr, Desc(FULL, 4))


def test_a_replay_arms_in_one_native_call_and_its_failure_aborts_every_table(
    tmp_path: Path,
) -> None:
    """Over real steps of host-fed workers, a replay arms in the steps' one native call; a
    fill that failed comes out of the next replay's arming typed, and every table is
    released then, by the native step itself (the hooks hold no abort policy of their
    own for it)."""
    data = np.arange(64 * 16, dtype=np.uint32).astype(np.uint8).reshape(64, 16)
    save_torch({"t": torch.from_numpy(data).view(torch.float16)}, str(tmp_path / "t.st"))
    table = pm.MmapTable.open(tmp_path / "t.st", "t")
    made = []
    for name in ("a", "b"):
        rows = pm.DeferredRows(8, table.row_bytes, device="cpu", watchdog=None)
        made.append(StepTable(name, table, rows, pm.GatherWorker(rows, table, depth=2)))
    steps = Steps(made, "deferred", None, None, 2, 5.0)
    hk = PleRunnerHooks(steps, rows_per_token=2)
    assert hk._arm is steps.arm and type(hk._arm).__module__ == "ple_memops._native"
    desc, mgr = Desc(FULL, 2), Manager()
    hk._wait_descs.add(desc)  # as a capture of this size would have

    def replay(ids: dict[str, list[int]], scoped: bool = True) -> None:
        def launch() -> None:  # the graph's publish of the step's ids
            for name, got in ids.items():
                steps.publish_host(name, got)
            mgr.run_fullgraph(desc)

        if not scoped:  # a replay outside a step: only the replay's own abort
            hk.replay(desc, launch)
            return
        with hk.step(dummy=False):
            hk.replay(desc, launch)

    for k in range(3):
        replay({"a": [k, 1, 2, 3], "b": [k, 4, 5, 6]})
    assert (hk.armed_steps, steps.counters().completed, steps.in_flight) == (3, 1, 2)
    hk.quiesce()  # the last step's rows, complete
    np.testing.assert_array_equal(steps.staging("b", 4), data[[2, 4, 5, 6]])
    replay({"a": [1, 64 + 9, 1, 1], "b": [1, 1, 1, 1]})  # table a's fill fails
    with pytest.raises(pm.RowIdError):
        for _ in range(2):  # raised by the arming after it, at the latest by completing it
            replay({"a": [1, 1, 1, 1], "b": [1, 1, 1, 1]}, scoped=False)
    assert all(t.rows.phase == "poisoned" for t in steps)
    assert "arming a step of 4 rows" in (steps.tables["b"].rows.poison_cause or "")
    with pytest.raises(PoisonedError):
        replay({})
    hk.shutdown()
    with pytest.raises(ClosedError):  # closed with the steps
        hk._arm(2)
    table.close()


def test_exception_in_eager_step_aborts() -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)
    with pytest.raises(RuntimeError), hk.eager(dummy=False):
        raise RuntimeError("kernel failed")
    assert plan.poisoned is not None and "kernel failed" in plan.poisoned


def test_a_step_is_one_scope_at_a_time_timed_once_and_its_failures_abort() -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2, stats_every=3600.0)  # counted for the line
    with hk.step(dummy=False):
        with pytest.raises(StateError, match="already open"), hk.step(dummy=True):
            pass
    (step,) = hk.host.take()  # one sample a step, the opening and the end in one
    assert step["step"] > 0 and plan.poisoned is None

    # A failure at the step's end (its checks: here an eager forward's layer staged and
    # never joined) aborts, and the next step opens (the scope was closed) but its arming
    # is refused.
    with pytest.raises(StateError, match="never joined"), hk.step(dummy=False):
        hk.stage("a", torch.zeros((1, 2), dtype=torch.int64), hk.output("a", 1))
    assert plan.poisoned is not None and "never joined" in plan.poisoned
    with pytest.raises(PoisonedError), hk.step(dummy=False):
        plan.arm(2)


def test_a_served_step_reuses_its_scope_until_an_eager_forward_or_a_failure_used_it() -> None:
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2)  # served: no stats line
    # One context a kind of step, made once; a replay's step leaves its scope as found.
    assert hk.step(dummy=False) is hk.step(dummy=False)
    assert hk.step(dummy=True) is not hk.step(dummy=False)
    with hk.step(dummy=False):
        first = hk._scope
    with hk.step(dummy=False):
        assert hk._scope is first
        # Opening the same kind again inside is refused and changes nothing.
        for dummy in (False, True):
            with pytest.raises(StateError, match="already open"), hk.step(dummy=dummy):
                pass
        assert hk._scope is first
    assert hk._scope is None

    # An eager forward used the scope: the next step has a fresh one.
    ids = torch.zeros((1, 2), dtype=torch.int64)
    with hk.step(dummy=False):
        out = hk.output("a", 1)
        hk.stage("a", ids, out)
        hk.join("a", out)
        used = hk._scope
        assert used is first and used.rows == 2 and used.staged == {"a"}
    with hk.step(dummy=False):
        fresh = hk._scope
        assert fresh is not used and fresh.rows is None and not fresh.staged and not fresh.forks
    assert plan.poisoned is None

    # So does a failure (here a layer staged and never joined, which aborts).
    with pytest.raises(StateError, match="never joined"), hk.step(dummy=False):
        hk.stage("a", ids, hk.output("a", 1))
    with pytest.raises(PoisonedError), hk.step(dummy=False):
        assert hk._scope is not fresh and hk._scope.rows is None and not hk._scope.forks
        plan.arm(2)
    assert hk._scope is None


def test_deferrable() -> None:
    assert deferrable(Desc(FULL, 8)) is None
    assert deferrable(Desc(FULL, 8, None)) is None
    assert "NONE" in str(deferrable(Desc(NONE, 8)))
    assert "microbatched" in str(deferrable(Desc(FULL, 8, num_ubatches=2)))
    with pytest.raises(InvalidArgumentError):
        PleRunnerHooks(RecordingPlan(["a"]), rows_per_token=0)


# -- the stand-in runner of test_vllm_runner_gpu.py, on the host ------------------------


@pytest.fixture(scope="module")
def stand_in_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return stand_in.write_checkpoint(tmp_path_factory.mktemp("standin"))


def test_stand_in_eager_on_the_host(stand_in_ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    """The same runner without a GPU (host plan, eager steps only): its inputs, ring and
    checks, so the GPU run starts from code that ran."""
    path, tables = stand_in_ckpt
    r = stand_in.boot(path, "cpu")
    try:
        assert r.hooks.steps.mode == "host"
        r.profile_run()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [stand_in.EOS, 9, 10]])
        for _ in range(6):
            r.eager_step([])
        r.eager_step([[1, 2]])
        assert r.check_ring(0, tables) == 2 * 8
    finally:
        r.shutdown()


def test_host_time_is_counted_only_where_a_stats_line_reads_it() -> None:
    """No stats line: the hooks count no host time (chosen once, at the start) and still
    check every step; with one, every step is one sample by hook (the line's own test:
    ``test_stats_lines_every_interval``)."""
    quiet = PleRunnerHooks(RecordingPlan(["a"]), rows_per_token=2)
    assert isinstance(quiet.host, NoHostTime) and type(quiet) is PleRunnerHooks
    for _ in range(3):
        with quiet.step(dummy=False):
            pass
        assert quiet.hand_out(lambda: "tokens") == "tokens"
    assert quiet.host.take() == [] and quiet.host.summary().endswith("not counted")
    # The runner's output of a step: under async scheduling checked when the engine takes
    # it, synchronous checked at once.
    out = SimpleNamespace(get_output=lambda: "tokens")
    assert quiet.step_output(out) is out and out.get_output() == "tokens"
    plan = RecordingPlan(["a"])
    quiet = PleRunnerHooks(plan, rows_per_token=2)
    late = quiet.step_output(SimpleNamespace(get_output=lambda: "tokens"))
    plan.poisoned = "a fill failed"
    with pytest.raises(PoisonedError):
        late.get_output()
    with pytest.raises(PoisonedError):
        quiet.step_output(SimpleNamespace())
    with pytest.raises(PoisonedError):
        quiet.hand_out(lambda: "tokens")
    counted = PleRunnerHooks(RecordingPlan(["a"]), rows_per_token=2, stats_every=3600.0)
    assert isinstance(counted, PleRunnerHooks) and isinstance(counted.host, HostTime)
    desc = Desc(FULL, 4)
    counted._wait_descs.add(desc)  # as a capture of this size would have
    for _ in range(3):
        with counted.step(dummy=False):
            counted.replay(desc, lambda: time.sleep(0.001))
        counted.hand_out(lambda: "tokens")
    samples = counted.host.take()  # the third step's results close no sample yet
    assert len(samples) == 3 and all(s["step"] > 0 and s["arm"] > 0 for s in samples)
    assert all(s["launch"] >= 1_000_000 for s in samples)
    out = counted.step_output(SimpleNamespace(get_output=lambda: "tokens"))
    assert out.get_output() == "tokens"
    counted.host.end_step()
    (check,) = counted.host.take()  # the output's wrapping and its check, counted
    assert check["check"] > 0 and check["results"] > 0


def test_a_steps_output_is_checked_and_the_engines_wait_for_it_timed() -> None:
    """``hand_out`` (async scheduling's ``get_output``): the engine's time in it is
    counted as ``results``, apart from our host time; a step whose rows failed is never
    handed out."""
    plan = RecordingPlan(["a"])
    hk = PleRunnerHooks(plan, rows_per_token=2, stats_every=3600.0)  # counted for the line
    calls: list[int] = []

    def get_output() -> str:
        calls.append(1)
        time.sleep(0.003)  # the step still running on the GPU
        return "tokens"

    assert hk.hand_out(get_output) == "tokens"
    hk.host.end_step()
    (step,) = hk.host.take()
    assert step["results"] >= 3_000_000
    assert sum(step[k] for k in HOST_KINDS) < 3_000_000  # not ours: the check alone
    assert step["check"] > 0
    plan.abort("a fill failed")
    with pytest.raises(PoisonedError, match="a fill failed"):
        hk.hand_out(get_output)
    assert len(calls) == 2  # the output was waited for, then withheld


def test_stats_lines_every_interval(
    stand_in_ckpt: tuple[Path, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    """``stats_every``: a ``ple-memops stats`` line once the interval passed, checked at
    each step, and a last one at shutdown; none in between."""
    path, _tables = stand_in_ckpt
    caplog.set_level(logging.INFO, logger="ple_memops")
    r = stand_in.boot(path, "cpu", stats_every=3600.0)
    try:
        r.profile_run()
        r.eager_step([[5, 6, 7, 8], [stand_in.EOS, 9, 10]])
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
        PleRunnerHooks(r.hooks.steps, rows_per_token=stand_in.H, stats_every=0)


# -- settings ------------------------------------------------------------------------------


def test_settings_from_the_environment() -> None:
    assert settings.Settings.from_env({}) == settings.Settings("default", 30.0)
    on = settings.Settings.from_env(
        {"PLE_MEMOPS_TABLE_BACKEND": " MMAP ", "PLE_MEMOPS_TIMEOUT": "120"}
    )
    assert on.mmap and on.timeout == 120.0
    assert not settings.Settings.from_env({"PLE_MEMOPS_TABLE_BACKEND": "default"}).mmap
    assert not settings.Settings.from_env({"PLE_MEMOPS_TABLE_BACKEND": ""}).mmap
    for bad in ("pinned", "uva", "1"):
        with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_TABLE_BACKEND must be"):
            settings.Settings.from_env({"PLE_MEMOPS_TABLE_BACKEND": bad})
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_TIMEOUT must be a positive"):
            settings.Settings.from_env({"PLE_MEMOPS_TIMEOUT": bad})
    assert settings.installed_by_env({"PLE_MEMOPS_TABLE_BACKEND": "mmap"})
    assert not settings.installed_by_env({})


def test_settings_per_engine() -> None:
    env = {"PLE_MEMOPS_TABLE_BACKEND": "mmap"}
    S = settings.Settings
    assert S.for_engine({}, env) == S("mmap", 30.0)
    assert S.for_engine(None, env) == S("mmap", 30.0)
    assert S.for_engine({"other": 1}, env) == S("mmap", 30.0)
    assert S.for_engine({"ple_memops": {"table_backend": "default"}}, env) == S("default", 30.0)
    assert S.for_engine({"ple_memops": {"timeout": 60}}, env) == S("mmap", 60.0)
    assert S.for_engine({"ple_memops": {"table_backend": "mmap"}}, {}) == S("mmap", 30.0)
    assert S.for_engine({"ple_memops": {"copy": "MEMOP"}}, env).copy == "memop"
    assert S.for_engine({}, env | {"PLE_MEMOPS_COPY": "kernel"}).copy == "kernel"
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_COPY must be one of auto"):
        S.for_engine({}, {"PLE_MEMOPS_COPY": "dma"})
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['timout'\]"):
        S.for_engine({"ple_memops": {"timout": 60}}, env)
    with pytest.raises(InvalidArgumentError, match=r"\['table_backend'\] must be 'mmap'"):
        S.for_engine({"ple_memops": {"table_backend": "uva"}}, env)
    with pytest.raises(InvalidArgumentError, match=r"\['timeout'\] must be a positive"):
        S.for_engine({"ple_memops": {"timeout": True}}, env)
    with pytest.raises(InvalidArgumentError, match="must be a mapping"):
        S.for_engine({"ple_memops": "mmap"}, env)


def test_settings_spin_and_stats_interval() -> None:
    S = settings.Settings
    assert S.from_env({}).spin is None and S.from_env({}).stats_every is None
    env = {"PLE_MEMOPS_SPIN": "0.05", "PLE_MEMOPS_STATS_EVERY": "10"}
    assert (S.from_env(env).spin, S.from_env(env).stats_every) == (0.05, 10.0)
    # 0 is the default (spin) and off (stats), as an empty value is.
    assert S.from_env({"PLE_MEMOPS_SPIN": "0", "PLE_MEMOPS_STATS_EVERY": ""}) == S()
    got = S.for_engine({"ple_memops": {"spin": 0.01, "stats_every": 30}}, env)
    assert (got.spin, got.stats_every) == (0.01, 30.0)
    assert S.for_engine({"ple_memops": {"stats_every": 0}}, env).stats_every is None
    assert S.for_engine({"ple_memops": {"timeout": 60}}, env).spin == 0.05  # env kept
    for bad in ("-1", "nan", "inf", "fast"):
        with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_SPIN must be a number"):
            S.from_env({"PLE_MEMOPS_SPIN": bad})
    for value in (True, -0.5, "soon", [1]):
        with pytest.raises(InvalidArgumentError, match=r"\['stats_every'\] must be a number"):
            S.for_engine({"ple_memops": {"stats_every": value}}, {})
    known = "known: 'table_backend', 'timeout', 'copy', 'spin', 'stats_every', 'first_layer"
    with pytest.raises(InvalidArgumentError, match=known):
        S.for_engine({"ple_memops": {"spinning": 1}}, {})


@pytest.mark.parametrize("name", ["expect_prefill", "expect_decode"])
def test_removed_settings_are_refused_when_on(name: str) -> None:
    """``expect_prefill`` and ``expect_decode`` were removed: switched on (or given a value
    that is not off) from either source, refused naming the setting and why; off, ignored."""
    S = settings.Settings
    var = f"PLE_MEMOPS_{name.upper()}"
    assert settings.REMOVED[name][0] == var and name not in settings.KEYS
    assert not hasattr(S(), name)
    for value in ("1", "on", "maybe"):
        with pytest.raises(InvalidArgumentError, match=f"{var}='{value}': {name} was removed"):
            S.from_env({var: value})
    with pytest.raises(InvalidArgumentError, match="measured not better"):
        S.from_env({var: "1"})
    with pytest.raises(InvalidArgumentError, match=rf"\['{name}'\]=True: {name} was removed"):
        S.for_engine({"ple_memops": {name: True}}, {})
    with pytest.raises(InvalidArgumentError, match=f"{name} was removed"):
        S.for_engine({"ple_memops": {name: 2}}, {})
    for off in ("", "0", "off"):
        assert S.from_env({var: off}) == S()
    assert S.for_engine({"ple_memops": {name: False, "timeout": 60}}, {}) == S(timeout=60.0)
    assert S.for_engine({"ple_memops": {name: None}}, {}) == S()


def test_settings_split_rows() -> None:
    S = settings.Settings
    assert S.from_env({}).split_rows and S().split_rows  # on by default
    env = {"PLE_MEMOPS_SPLIT_ROWS": "0"}
    assert not S.from_env(env).split_rows
    assert S.from_env({"PLE_MEMOPS_SPLIT_ROWS": "1"}).split_rows
    # Empty is the default, as for every setting: on here, off for the other switches.
    assert S.from_env({"PLE_MEMOPS_SPLIT_ROWS": " "}).split_rows
    assert not S.from_env({"PLE_MEMOPS_TIME_STALLS": ""}).time_stalls
    assert S.for_engine({"ple_memops": {"split_rows": None}}, env).split_rows
    assert not S.for_engine({"ple_memops": {"time_graphs": ""}}, {}).time_graphs
    assert not S.for_engine({"ple_memops": {"split_rows": False}}, {}).split_rows
    assert S.for_engine({"ple_memops": {"split_rows": "on"}}, env).split_rows
    assert not S.for_engine({"ple_memops": {"spin": 0.01}}, env).split_rows  # env kept
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_SPLIT_ROWS must be"):
        S.from_env({"PLE_MEMOPS_SPLIT_ROWS": "maybe"})
    with pytest.raises(InvalidArgumentError, match=r"\['split_rows'\] must be 1 or 0"):
        S.for_engine({"ple_memops": {"split_rows": 2}}, {})


def test_settings_read_in_order() -> None:
    S = settings.Settings
    assert S.from_env({}).read_in_order and S().read_in_order  # on by default
    assert not S.from_env({"PLE_MEMOPS_READ_IN_ORDER": "0"}).read_in_order
    assert S.from_env({"PLE_MEMOPS_READ_IN_ORDER": ""}).read_in_order
    off = S.for_engine({"ple_memops": {"read_in_order": False}}, {})
    assert not off.read_in_order and off == S(read_in_order=False)
    assert S.for_engine({"ple_memops": {"read_in_order": None}}, {}).read_in_order
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_READ_IN_ORDER must be"):
        S.from_env({"PLE_MEMOPS_READ_IN_ORDER": "maybe"})
    with pytest.raises(InvalidArgumentError, match=r"\['read_in_order'\] must be 1 or 0"):
        S.for_engine({"ple_memops": {"read_in_order": 2}}, {})


def test_settings_first_layer_threads() -> None:
    S = settings.Settings
    assert S.from_env({}).first_layer_threads is None
    env = {"PLE_MEMOPS_FIRST_LAYER_THREADS": "8"}
    assert S.from_env(env).first_layer_threads == 8
    # Unset (or empty): the model's default; 0: the shared pool for every table.
    assert S.from_env({"PLE_MEMOPS_FIRST_LAYER_THREADS": ""}) == S()
    assert S.from_env({"PLE_MEMOPS_FIRST_LAYER_THREADS": "0"}).first_layer_threads == 0
    assert S.for_engine({"ple_memops": {"first_layer_threads": 4}}, env).first_layer_threads == 4
    assert S.for_engine({"ple_memops": {"first_layer_threads": 0}}, env).first_layer_threads == 0
    assert S.for_engine({"ple_memops": {"first_layer_threads": None}}, env) == S()
    assert S.for_engine({"ple_memops": {"spin": 0.01}}, env).first_layer_threads == 8  # env kept
    for bad in ("1", "65", "-2", "4.5", "many"):
        with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_FIRST_LAYER_THREADS must be"):
            S.from_env({"PLE_MEMOPS_FIRST_LAYER_THREADS": bad})
    for value in (True, 1, 2.0, [4]):
        with pytest.raises(InvalidArgumentError, match=r"\['first_layer_threads'\] must be"):
            S.for_engine({"ple_memops": {"first_layer_threads": value}}, {})


def test_settings_predicted_ready() -> None:
    S = settings.Settings
    assert not S.from_env({}).predict_ready and not S().predict_ready
    env = {"PLE_MEMOPS_PREDICT_READY": "1"}
    assert S.from_env(env).predict_ready
    assert not S.for_engine({"ple_memops": {"predict_ready": False}}, env).predict_ready
    assert S.for_engine({"ple_memops": {"predict_ready": "on"}}, {}).predict_ready
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_PREDICT_READY must be 1 or 0"):
        S.from_env({"PLE_MEMOPS_PREDICT_READY": "soon"})
    with pytest.raises(InvalidArgumentError, match=r"\['predict_ready'\] must be 1 or 0"):
        S.for_engine({"ple_memops": {"predict_ready": 2}}, {})


def test_settings_stall_timing_and_the_gather_free_diagnostic() -> None:
    S = settings.Settings
    assert not S.from_env({}).time_stalls and not S.from_env({}).diag_skip_gather
    on = {"PLE_MEMOPS_TIME_STALLS": "1", "PLE_MEMOPS_DIAG_SKIP_GATHER": " On "}
    got = S.from_env(on)
    assert got.time_stalls and got.diag_skip_gather
    assert S.from_env({"PLE_MEMOPS_TIME_STALLS": "0"}) == S()
    assert not S.for_engine({"ple_memops": {"time_stalls": False}}, on).time_stalls
    assert S.for_engine({"ple_memops": {"diag_skip_gather": "true"}}, {}).diag_skip_gather
    assert S.for_engine({"ple_memops": {"time_stalls": 1}}, {}).time_stalls
    for bad in ("2", "maybe", "1.0"):
        with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_TIME_STALLS must be 1 or 0"):
            S.from_env({"PLE_MEMOPS_TIME_STALLS": bad})
    with pytest.raises(InvalidArgumentError, match=r"\['diag_skip_gather'\] must be 1 or 0"):
        S.for_engine({"ple_memops": {"diag_skip_gather": [1]}}, {})


def test_settings_the_early_join_diagnostic() -> None:
    S = settings.Settings
    assert not S.from_env({}).diag_early_join
    assert S.from_env({"PLE_MEMOPS_DIAG_EARLY_JOIN": "1"}).diag_early_join
    assert S.for_engine({"ple_memops": {"diag_early_join": True}}, {}).diag_early_join
    assert not S.for_engine(
        {"ple_memops": {"diag_early_join": 0}}, {"PLE_MEMOPS_DIAG_EARLY_JOIN": "1"}
    ).diag_early_join
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_DIAG_EARLY_JOIN must be 1 or 0"):
        S.from_env({"PLE_MEMOPS_DIAG_EARLY_JOIN": "late"})


def test_settings_graph_timing() -> None:
    S = settings.Settings
    assert not S.from_env({}).time_graphs and not S().time_graphs
    env = {"PLE_MEMOPS_TIME_GRAPHS": "1"}
    assert S.from_env(env).time_graphs and not S.from_env(env).mmap  # any backend
    assert not S.for_engine({"ple_memops": {"time_graphs": False}}, env).time_graphs
    assert S.for_engine({"ple_memops": {"time_graphs": True}}, {}).time_graphs
    assert "time_graphs" in settings.KEYS
    with pytest.raises(InvalidArgumentError, match="PLE_MEMOPS_TIME_GRAPHS must be 1 or 0"):
        S.from_env({"PLE_MEMOPS_TIME_GRAPHS": "always"})


def test_cli_check_without_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert cli(["check"]) == 2
        assert "vllm: not installed" in capsys.readouterr().out
    else:  # pragma: no cover - the vLLM environment tests this in test_vllm_real.py
        pytest.skip("vLLM is installed here: covered by test_vllm_real.py")


def test_docs_list_every_private_name_the_plugin_checks() -> None:
    """docs/vllm.md names every vLLM name ``_compat`` checks, with the counts it states."""
    import re

    from ple_memops.vllm import _compat

    docs = (Path(__file__).parent.parent / "docs" / "vllm.md").read_text()
    names = set()
    for req in _compat.REQUIREMENTS:
        found = re.match(r"[\w.]+:[\w.]+|MODELS_CONFIG_MAP\[[^]]+\]", req.what)
        assert found is not None, req.what
        names.add(found.group(0))
    missing = sorted(n for n in names if f"`{n}`" not in docs)
    assert not missing, f"docs/vllm.md does not list {missing}"
    stated = f"checks {len(_compat.REQUIREMENTS)} facts about {len(names)} names"
    assert stated in " ".join(docs.split()), stated
    assert f"all {len(_compat.REQUIREMENTS)} facts the plugin relies on hold" in docs


def test_docs_describe_every_environment_variable_the_code_reads() -> None:
    """Every ``PLE_MEMOPS_*`` variable the package or the Rust core reads is described in a
    table row of the docs (what it does), not only mentioned."""
    import re

    root = Path(__file__).parent.parent
    code = [*(root / "python" / "ple_memops").rglob("*.py"), *(root / "rust" / "src").rglob("*.rs")]
    names = {n for f in code for n in re.findall(r"PLE_MEMOPS_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    assert {"PLE_MEMOPS_TABLE_BACKEND", "PLE_MEMOPS_DISABLE_CUDA"} <= names
    rows = [ln for f in (root / "docs").glob("*.md") for ln in f.read_text().splitlines()
            if ln.startswith("|")]  # fmt: skip
    prose = " ".join(f.read_text() for f in (root / "docs").glob("*.md"))
    missing = sorted(n for n in names if not any(n in r for r in rows) and n not in prose)
    assert not missing, f"the docs do not describe {missing}"
    untabled = sorted(n for n in names if not any(n in r for r in rows))
    # Described in prose where no table fits: the transformers cache folder, and the removed
    # switches the settings refuse by name.
    assert set(untabled) <= {
        "PLE_MEMOPS_CACHE",
        "PLE_MEMOPS_EXPECT_PREFILL",
        "PLE_MEMOPS_EXPECT_DECODE",
    }, untabled
