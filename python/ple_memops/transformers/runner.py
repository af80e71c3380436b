"""A greedy decode runner for Gemma 3n with a static cache and FULL CUDA-graph decode steps,
and the variants it compares.

Every variant decodes the same prompt for the same number of steps from the same captured
step function; only where the PLE rows come from differs:

================  ==============================================================================
variant           rows of a step
================  ==============================================================================
gpu-table         the stock module, table in GPU memory (the reference)
pinned-uva        the stock module, table pinned in host memory and read by the GPU over PCIe
sync-gather       mmap gather into a pinned buffer + copy to a GPU buffer *before* the launch
                  (vLLM PR #54129); under async scheduling the ids must first reach the host
deferred-host     deferred rows; the host hands the ids it knows to the gather worker, which
                  fills while the graph runs
deferred-device   deferred rows; the graph publishes the ids it computed, a native worker fills
fallback          the library with the probe forced off (``deferred=False``): fill before launch
================  ==============================================================================

Scheduling styles: ``sync`` (the host reads each step's tokens before launching the next)
and ``async`` (the host launches step N+1 before it reads step N; the tokens the graph
samples feed the next step on the GPU).

Correctness: the reference runs twice; its first run records every step's logits on the
GPU, and every timed run (the reference's second one included) compares its logits bit for
bit (as integers) and its tokens with that record. The reference is also checked against the
stock model run eagerly for the first steps. Every run also checks the state its steps start
from against the recording's, right after its prefill: the KV cache (all of it, the unused
positions too), the cache counters, the first token and position, the prefill's logits, the
memoised constants and the weights (exact integer checksums; ``RunResult.state_diff`` names
what differs), so a run that differs says whether it started from a different state.

Host-known ids (``deferred-host``) go to the table's gather worker
(:meth:`~ple_memops.plan.RowsPlan.publish_host`): before the launch under ``sync``
scheduling, from a publisher thread under ``async``. The launching thread never fills: at
E2B shapes a launch does not return before the GPU has passed the rows' wait (measured;
BENCHMARKS.md), so a fill it had to make after ``graph.replay()`` would come too late.

Timing: a CUDA event after each step; a step's time is the interval between consecutive
events, so it counts GPU work, any GPU wait at the rows' consumer and any gap where the GPU
had nothing queued (the host was late). Median and p99 over the steps after the first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, PleMemopsError, StateError
from ._capture import _PATCHED, capture_scope, device_query_offset, make_capturable
from ._models import GEMMA3N_TABLE, ServedModel

__all__ = [
    "ALL_VARIANTS",
    "DEFERRED_VARIANTS",
    "Decoder",
    "GemmaBench",
    "RunResult",
]

# In the order they run (the ones the targets compare first, in case a deadline cuts a run).
ALL_VARIANTS = (
    "gpu-table",
    "sync-gather",
    "deferred-device",
    "deferred-host",
    "pinned-uva",
    "fallback",
)
DEFERRED_VARIANTS = ("deferred-host", "deferred-device")
STYLES = ("sync", "async")
ATTENTIONS = ("math", "default")
WARMUPS = 2


@dataclass
class RunResult:
    """One (variant, batch, style, placement) run."""

    variant: str
    batch: int
    style: str
    placement: str
    steps: int
    step_us: list[float]
    captured: bool
    tokens_identical: bool | None = None
    logits_identical: bool | None = None
    first_mismatch: int | None = None
    host_gather_us: float | None = None
    """Mean host time per step to gather the rows (and, for the synchronous paths, copy)."""
    gpu_waited: int | None = None
    """Steps whose fill found the GPU already waiting at the consumer (when counted)."""
    gpu_bytes: int | None = None
    """GPU memory allocated with this variant's model installed (before capture)."""
    pinned_bytes: int | None = None
    """Pinned host memory the variant holds for its rows (table copy or slots)."""
    mode: str | None = None
    """The rows plan's mode (deferred / sync / host), where one is used."""
    state_diff: list[str] | None = None
    """What of the state after the prefill differs from the recording's (empty: nothing;
    ``None``: not checked, the recording itself)."""
    launch_us_max: float | None = None
    """Longest host time of one launch (``graph.replay()`` and the step's event record)."""
    note: str = ""
    tokens: Any = field(default=None, repr=False)

    @property
    def median_us(self) -> float:
        return float(np.median(self._body())) if self.step_us else float("nan")

    @property
    def p99_us(self) -> float:
        return float(np.percentile(self._body(), 99)) if self.step_us else float("nan")

    def _body(self) -> list[float]:
        return self.step_us[1:] if len(self.step_us) > 1 else self.step_us


def _cache_kwarg(model: Any) -> str:
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cuda(device: Any) -> bool:
    return getattr(device, "type", str(device)).startswith("cuda")


class Decoder:
    """Static-cache greedy decode of one batch size for one (Gemma 3n) model.

    The step function runs the model on the static token buffer, samples greedily (over
    the token ids the PLE table covers: real checkpoints make the rest copies of the pad
    row, so stock greedy never picks them; random weights could) and writes the token and
    the position back on the device, so a captured step feeds the next one."""

    def __init__(
        self,
        model: Any,
        *,
        batch: int,
        steps: int,
        prompt_len: int = 8,
        seed: int = 0,
        device: Any,
    ) -> None:
        import torch
        from transformers import StaticCache

        make_capturable("gemma3n")
        self.model = model
        self.device = torch.device(device)
        self.batch, self.steps, self.prompt_len = int(batch), int(steps), int(prompt_len)
        cfg = model.config
        self.vocab_rows = int(getattr(cfg, "vocab_size_per_layer_input", cfg.vocab_size))
        need = self.prompt_len + self.steps + WARMUPS + 2
        window = getattr(cfg, "sliding_window", None)
        if window is not None and "sliding_attention" in (cfg.layer_types or []):
            if need > int(window):
                raise InvalidArgumentError(
                    f"prompt ({self.prompt_len}) + steps ({self.steps}) + {WARMUPS + 2} must fit "
                    f"the sliding window ({window}): past it the static cache changes phase, "
                    "which one captured graph cannot follow"
                )
        self.max_cache_len = need
        self.cache = device_query_offset(StaticCache(config=cfg, max_cache_len=need))
        self.cache_kw = _cache_kwarg(model)
        gen = torch.Generator().manual_seed(seed)
        # Ids 3.. avoid pad (0), eos (1) and bos (2).
        self.prompt = torch.randint(
            3, self.vocab_rows, (self.batch, self.prompt_len), generator=gen
        ).to(self.device)
        self.tok = torch.zeros((self.batch, 1), dtype=torch.int64, device=self.device)
        self.pos = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        self.first_tokens: np.ndarray[Any, Any] | None = None

    def _forward(self, ids: Any, pos: Any) -> Any:
        import torch

        with torch.no_grad(), capture_scope(self.device):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: self.cache},
            )
        return out.logits[:, -1, :]

    def prefill(self) -> Any:
        """Reset the cache, run the prompt eagerly, set the first decode token and
        position. Returns the prompt's last logits."""
        import torch

        self.cache.reset()
        pos = torch.arange(self.prompt_len, device=self.device).unsqueeze(0)
        logits = self._forward(self.prompt, pos)
        with torch.no_grad():
            self.tok.copy_(logits[:, : self.vocab_rows].argmax(-1, keepdim=True))
            self.pos.fill_(self.prompt_len)
        self.first_tokens = self.tok.view(-1).cpu().numpy().copy()
        return logits

    def step(self) -> Any:
        """One decode step (eager or under capture). Returns the step's logits [B, V]."""
        import torch

        logits = self._forward(self.tok, self.pos)
        with torch.no_grad():
            nxt = logits[:, : self.vocab_rows].argmax(-1, keepdim=True)
            self.tok.copy_(nxt)
            self.pos.add_(1)
        return logits

    def capture(self, warm: Callable[[Callable[[], Any]], Any] | None = None) -> tuple[Any, Any]:
        """Warm up on a side stream, capture one step, then reset and prefill again.
        ``warm(step)`` runs one warm-up step (default: ``step()``); a variant passes its
        own, which takes the captured step's path eagerly, rows and all, so every kernel
        is loaded and the path checked before the capture. Returns ``(graph, logits)``:
        the graph and its static logits output."""
        import torch

        self.prefill()
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                if warm is None:
                    self.step()
                else:
                    warm(self.step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (NCCL's watchdog under tensor
        # parallelism) must not invalidate this capture; the rows' workers make none.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self.step()
        torch.cuda.synchronize(self.device)
        self.prefill()
        return graph, logits


@dataclass
class _Ops:
    """What a variant does around each step's launch."""

    arm: Callable[[int], None] = lambda k: None
    """Before the launch (deferred: begin the step)."""
    before: Callable[[int, Any], None] = lambda k, ids: None
    """Before the launch, with the step's ids on the host (synchronous paths)."""
    after_launch: Callable[[int], None] = lambda k: None
    """After the launch (deferred: complete the oldest step beyond the scheduling
    depth)."""
    finish: Callable[[], None] = lambda: None
    launching: Callable[[int, Callable[[], Any]], None] | None = None
    """Right before the launch, with a callable that returns the step's ids (blocking
    until they are known): hands them to another thread (deferred-host, async)."""
    close: Callable[[], None] = lambda: None
    """Always called when the ops are done with, after a failure too."""
    needs_ids_before: bool = False
    host_ns: list[int] = field(default_factory=list)
    stats: Callable[[], tuple[float | None, int | None]] = lambda: (None, None)


class GemmaBench:
    """Runs the variants of one served Gemma 3n model side by side.

    ``served``: the model from :func:`~ple_memops.transformers.serve`, moved to its device.
    ``stock``: the model's original PLE module (with its table, on the CPU), which the
    ``gpu-table`` and ``pinned-uva`` variants put back in."""

    def __init__(
        self,
        served: ServedModel,
        stock: Any,
        *,
        device: Any,
        progress: Callable[[str], None] | None = None,
        watchdog: float = 30.0,
        eager_check_steps: int = 4,
        track_arrival: bool = False,
        attention: str = "math",
    ) -> None:
        import torch

        if served.kind != "gemma3n":
            raise InvalidArgumentError("GemmaBench runs Gemma 3n models")
        if attention not in ATTENTIONS:
            raise InvalidArgumentError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.attention = attention
        self.served = served
        self.stock = stock
        self.device = torch.device(device)
        self.cuda = _cuda(self.device)
        self.progress = progress or (lambda s: None)
        self.watchdog = watchdog
        self.eager_check_steps = eager_check_steps
        self.track_arrival = track_arrival
        self.table = served.tables[GEMMA3N_TABLE]
        self.eager_check: dict[int, bool] = {}
        self._uva: Any = None
        self._cpu_graph_path = False
        self.deadline: float | None = None
        """``time.perf_counter()`` past which no further variant starts (``None``: none)."""
        # GPU memory of the served model alone (no table), the base of every variant's figure.
        self.model_base = torch.cuda.memory_allocated(self.device) if self.cuda else 0

    @contextlib.contextmanager
    def attention_scope(self) -> Iterator[None]:
        """SDPA's backend for everything run inside (eager prefill, capture): ``math``
        pins the math backend, ``default`` leaves torch's choice. The H200 needs this for
        bit-for-bit comparisons: cuDNN's attention (torch's choice there) gives
        different logits from one replay of the same graph to the next (measured: the
        stock model's captured step first differs from its own recording at steps 67,
        170 or 208 of 256), while the math backend repeats exactly."""
        if self.attention == "default":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            yield

    # -- which variants can run here --------------------------------------------------------

    def available(self) -> tuple[list[str], dict[str, str]]:
        """The variants this machine can run, and why the others are skipped."""
        skipped: dict[str, str] = {}
        if not self.cuda:
            for v in ("pinned-uva", *DEFERRED_VARIANTS):
                skipped[v] = "needs a CUDA GPU (no graphs, no deferral on the CPU)"
            return ["gpu-table", "sync-gather", "fallback"], skipped
        from .. import probe

        cap = probe(self.device.index or 0)
        out = list(ALL_VARIANTS)
        if not cap.supported:
            for v in DEFERRED_VARIANTS:
                skipped[v] = f"the probe says this GPU cannot defer: {cap.reason}"
                out.remove(v)
        return out, skipped

    # -- installing a variant's module ----------------------------------------------------

    @contextlib.contextmanager
    def _installed(self, variant: str) -> Iterator[int | None]:
        """Install the module the variant reads its rows through; yields its pinned bytes."""
        import torch

        served = self.served
        if variant == "gpu-table":
            mod = self.stock.to(self.device)
            served.install(GEMMA3N_TABLE, mod)
            try:
                yield 0
            finally:
                served.restore()
                self.stock.to("cpu")
                if self.cuda:
                    torch.cuda.empty_cache()
        elif variant == "pinned-uva":
            mod, nbytes = self._uva_module()
            served.install(GEMMA3N_TABLE, mod)
            try:
                yield nbytes
            finally:
                served.restore()
        else:
            yield None

    def _uva_module(self) -> tuple[Any, int]:
        """The stock module whose weight is a CUDA view of a pinned host copy of the table:
        the embedding kernel reads the rows over PCIe (what vLLM 0.33 ships)."""
        import copy

        import torch

        if self._uva is None:
            # The stock (reference) module may already live on the GPU: pin a host copy.
            w = self.stock.weight.detach().to("cpu")
            pinned = w.view(torch.int16).pin_memory()
            view = torch.as_tensor(_CudaArray(pinned, self.device.index or 0), device=self.device)
            mod = copy.copy(self.stock)
            mod._parameters = dict(mod._parameters)
            mod._buffers = {k: v.to(self.device) for k, v in mod._buffers.items()}
            mod.weight = torch.nn.Parameter(view.view(w.dtype), requires_grad=False)
            self._uva = (mod, pinned, int(pinned.numel() * 2))
        return self._uva[0], self._uva[2]

    # -- one batch size ---------------------------------------------------------------------

    def run_batch(
        self,
        batch: int,
        steps: int,
        *,
        variants: list[str],
        styles: list[str],
        placements: list[str],
        cold: bool = False,
    ) -> list[RunResult]:
        """Run every variant at ``batch`` in every style (and, for the deferred variants,
        every consumer placement). The reference runs first."""
        for s in styles:
            if s not in STYLES:
                raise InvalidArgumentError(f"style must be one of {STYLES}, got {s!r}")
        dec = Decoder(self.served.model, batch=batch, steps=steps, device=self.device)
        results: list[RunResult] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.attention_scope())
            ref, again = self._reference(dec, styles, results, stack)
            for variant in variants:
                if variant == "gpu-table":
                    continue
                # The fallback fills before the launch, so where its consumer sits does not
                # change its time; the CPU path runs it in every placement (that is where
                # the late placement's code is checked without a GPU).
                both = (*DEFERRED_VARIANTS, "fallback") if not self.cuda else DEFERRED_VARIANTS
                if variant == "pinned-uva":
                    vplacements = ["early"]  # the stock module: the stock placement
                else:
                    vplacements = placements if variant in both else placements[:1]
                for placement in vplacements:
                    if self.deadline is not None and time.perf_counter() > self.deadline:
                        print(f"batch {batch}: {variant} ({placement}) skipped: past the deadline")
                        continue
                    results.extend(self._variant(dec, variant, placement, styles, ref, cold))
            # The reference once more, after the others: drift (clocks, heat, page cache)
            # shows as a difference between its two runs.
            results.extend(again())
        return results

    def _reference(
        self,
        dec: Decoder,
        styles: list[str],
        results: list[RunResult],
        stack: contextlib.ExitStack,
    ) -> tuple[_Record, Callable[[], list[RunResult]]]:
        """Capture the stock model (table in GPU memory), record its logits, time it. The
        graph and the table stay on the GPU until ``stack`` closes, so the returned
        callable can time the reference again after the other variants (their modules
        are installed by then; the graph replays what it captured, and the eager prefill
        that precedes a run gives the same values through any variant)."""
        self.progress(f"batch {dec.batch}: gpu-table (reference) record")
        before = self._allocated()
        stack.enter_context(self._installed("gpu-table"))
        gpu_bytes = self.model_base + self._allocated() - before if self.cuda else None
        graph, logits = self._capture(dec)
        stack.callback(lambda: self.served.restore())
        record = _Record(dec, self.cuda)
        self._loop(dec, graph, logits, "sync", _Ops(), record, recording=True)
        self.eager_check[dec.batch] = self._check_eager(dec, record)

        def timed(placement: str) -> list[RunResult]:
            out = []
            for style in styles:
                self.progress(f"batch {dec.batch}: gpu-table {style}")
                r = self._loop(dec, graph, logits, style, _Ops(), record)
                r.variant, r.placement, r.gpu_bytes, r.pinned_bytes = (
                    "gpu-table",
                    placement,
                    gpu_bytes,
                    0,
                )
                if not self.eager_check[dec.batch]:
                    r.note = "captured reference differs from the stock model run eagerly"
                out.append(r)
            return out

        results.extend(timed("-"))
        # Later variants install their own modules; this graph keeps the stock one's.
        self.served.restore()
        if not self.cuda:
            return record, lambda: []
        return record, lambda: timed("again")

    def _check_eager(self, dec: Decoder, record: _Record) -> bool:
        """The captured reference against the stock model run eagerly for the first steps."""
        import torch

        k = min(self.eager_check_steps, dec.steps)
        if k == 0:
            return True
        dec.prefill()
        ok = True
        for i in range(k):
            logits = dec.step()
            ok &= bool(torch.equal(_bits(logits), _bits(record.logits[i])))
        return ok

    def _capture(self, dec: Decoder, ops: _Ops | None = None) -> tuple[Any, Any]:
        if not self.cuda:
            return None, None
        if ops is None:
            return dec.capture()
        server = self.served.server
        k = 0

        def warm(step: Callable[[], Any]) -> Any:
            # One step of the variant's protocol, eagerly: in eager execution the rows
            # are filled before the step's consumer is enqueued (deferred-host fills
            # first; the worker fills from its own thread).
            nonlocal k
            ids = _in_table(dec.tok.view(-1).cpu().numpy(), dec.vocab_rows)
            ops.arm(k)
            ops.before(k, ids)
            server.graph_path = True
            try:
                out = step()
            finally:
                server.graph_path = False
            ops.after_launch(k)
            k += 1
            return out

        try:
            return dec.capture(warm)
        finally:
            try:
                ops.finish()
            finally:
                ops.close()

    def _allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else 0

    def _variant(
        self,
        dec: Decoder,
        variant: str,
        placement: str,
        styles: list[str],
        ref: _Record,
        cold: bool,
    ) -> list[RunResult]:

        served = self.served
        server = served.server
        out: list[RunResult] = []
        before = self._allocated()
        with contextlib.ExitStack() as stack:
            pinned = stack.enter_context(self._installed(variant))
            served.set_placement(placement if variant != "gpu-table" else "early")
            stack.callback(served.set_placement, "early")
            mode = None
            ops_for: Callable[[str], _Ops]
            n = dec.batch
            if variant in ("gpu-table", "pinned-uva"):

                def ops_for(style: str) -> _Ops:
                    return _Ops()

            elif variant == "sync-gather":
                ops_for, buffers, pinned = self._sync_gather(dec)
                stack.enter_context(server.staging_buffers(buffers))
            else:
                deferred = variant != "fallback"
                source = "host" if variant == "deferred-host" else "device"
                plan = served.prepare(
                    n,
                    device=self.device,
                    deferred=deferred,
                    source=source,
                    watchdog=self.watchdog,
                    track_arrival=self.track_arrival and self.cuda,
                )
                stack.callback(server.close_plan)
                mode = plan.mode
                pinned = n * self.table.row_bytes
                if variant == "fallback" or plan.mode != "deferred":
                    ops_for = self._fallback_ops(dec)
                elif variant == "deferred-host":
                    ops_for = self._deferred_host_ops(dec)
                else:
                    ops_for = self._deferred_device_ops(dec)
            if not self.cuda:
                # No graphs here: run the captured step's code path eagerly, rows filled
                # before each step (the host plan), to check it against the reference.
                self._cpu_graph_path = variant not in ("gpu-table", "pinned-uva")
                stack.callback(setattr, self, "_cpu_graph_path", False)
            gpu_bytes = self.model_base + self._allocated() - before if self.cuda else None
            self.progress(f"batch {dec.batch}: {variant} ({placement}) capture")
            graph, logits = self._capture(dec, ops_for("sync"))
            for style in styles:
                if cold:
                    self.table.drop_pages()
                self.progress(f"batch {dec.batch}: {variant} ({placement}) {style}")
                ops = ops_for(style)
                r = self._loop(dec, graph, logits, style, ops, ref)
                r.variant, r.placement = variant, placement
                r.gpu_bytes, r.pinned_bytes, r.mode = gpu_bytes, pinned, mode
                r.host_gather_us, r.gpu_waited = ops.stats()
                out.append(r)
            del graph
        return out

    # -- the variants' host side ------------------------------------------------------------

    def _sync_gather(self, dec: Decoder) -> tuple[Callable[[str], _Ops], dict[str, Any], int]:
        import torch

        table = self.table
        n = dec.batch
        staging = torch.zeros((n, table.row_bytes), dtype=torch.uint8, device=self.device)
        host = torch.zeros((n, table.row_bytes), dtype=torch.uint8)
        if self.cuda:
            host = host.pin_memory()

        def ops_for(style: str) -> _Ops:
            ops = _Ops(needs_ids_before=True)

            def before(k: int, ids: Any) -> None:
                t0 = time.perf_counter_ns()
                table.gather_into(ids, host)
                staging.copy_(host, non_blocking=True)
                ops.host_ns.append(time.perf_counter_ns() - t0)

            ops.before = before
            ops.stats = lambda: (_mean_us(ops.host_ns), None)
            return ops

        return ops_for, {GEMMA3N_TABLE: staging}, int(host.numel())

    def _fallback_ops(self, dec: Decoder) -> Callable[[str], _Ops]:
        server = self.served.server

        def ops_for(style: str) -> _Ops:
            ops = _Ops(needs_ids_before=True)

            def before(k: int, ids: Any) -> None:
                t0 = time.perf_counter_ns()
                server.fill_staging_from_host(ids, GEMMA3N_TABLE)
                ops.host_ns.append(time.perf_counter_ns() - t0)

            ops.before = before
            ops.stats = lambda: (_mean_us(ops.host_ns), None)
            return ops

        return ops_for

    def _deferred_host_ops(self, dec: Decoder) -> Callable[[str], _Ops]:
        """Host-known ids handed to the table's worker (:meth:`RowsPlan.publish_host`),
        which gathers and fills; the launching thread never fills. Under ``sync``
        scheduling the ids are known before the launch and published then, so the gather
        overlaps the launch. Under ``async`` the ids of step k are step k-1's tokens,
        which reach the host only after step k was launched: a publisher thread waits for
        them and publishes. (Filling on the launching thread after ``graph.replay()``
        stalls at E2B shapes: with the copy-engine consumer and thousands of nodes behind
        its wait, the launch itself does not return before the wait was passed.)"""
        plan = self.served.server.plan
        layer = plan.layers[GEMMA3N_TABLE]
        n = dec.batch
        bound = 2 * self.watchdog + 5.0

        def ops_for(style: str) -> _Ops:
            ops = _Ops()
            rbase = layer.rows.stats()
            base = layer.worker.stats() if layer.worker is not None else None
            pending: dict[int, concurrent.futures.Future[None]] = {}
            pool: list[concurrent.futures.ThreadPoolExecutor] = []

            def arm(k: int) -> None:
                plan.begin(n)

            def publish(k: int, ids: Any) -> None:
                plan.publish_host(GEMMA3N_TABLE, ids)

            def launching(k: int, ids_of: Callable[[], Any]) -> None:
                if not pool:
                    pool.append(
                        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-ids")
                    )
                pending[k] = pool[0].submit(lambda: publish(k, ids_of()))

            def published(k: int) -> None:
                fut = pending.pop(k, None)
                if fut is None:
                    return
                try:
                    fut.result(timeout=bound)  # bounded: the worker's waits are
                except concurrent.futures.TimeoutError:
                    plan.abort(f"deferred-host step {k}: the publisher thread did not return")
                    raise StateError(
                        f"deferred-host step {k}: the publisher thread did not return within "
                        f"{bound:.0f} s (the GPU was released)"
                    ) from None

            def after_launch(k: int) -> None:
                # sync: the step completes before the next launch; async: one step stays
                # armed ahead (depth 2) and the older one completes.
                limit = 1 if style == "async" else 0
                while plan.in_flight > limit:
                    published(k + 1 - plan.in_flight)
                    plan.complete(timeout=self.watchdog)

            def finish() -> None:
                for k in sorted(pending):
                    published(k)
                plan.drain(timeout=self.watchdog)

            def close() -> None:
                # No step pending after a clean run; after a failure a publish still under
                # way ends within its bounded wait (the plan is aborted by then).
                if pool:
                    pool[0].shutdown(wait=False, cancel_futures=True)
                    pool.clear()

            def stats() -> tuple[float | None, int | None]:
                waited = (layer.rows.stats().gpu_waited - rbase.gpu_waited) or None
                if layer.worker is None or base is None:
                    return None, waited
                s = layer.worker.stats()
                fills = s.fills - base.fills
                total = s.ready_to_filled_ns_total - base.ready_to_filled_ns_total
                return (total / 1e3 / fills if fills else None), waited

            ops.arm, ops.after_launch, ops.finish, ops.close = arm, after_launch, finish, close
            ops.stats = stats
            if style == "async":
                ops.launching = launching
            else:
                ops.before = publish
            return ops

        return ops_for

    def _deferred_device_ops(self, dec: Decoder) -> Callable[[str], _Ops]:
        plan = self.served.server.plan
        layer = plan.layers[GEMMA3N_TABLE]
        n = dec.batch

        def ops_for(style: str) -> _Ops:
            ops = _Ops()
            base = layer.worker.stats() if layer.worker is not None else None
            rbase = layer.rows.stats()

            def arm(k: int) -> None:
                plan.begin(n)

            def after_launch(k: int) -> None:
                # sync: the step completes before the next launch; async: keep one step
                # armed ahead (depth 2) and complete the older one.
                limit = 1 if style == "async" else 0
                while plan.in_flight > limit:
                    plan.complete(timeout=self.watchdog)

            def finish() -> None:
                plan.drain(timeout=self.watchdog)

            def stats() -> tuple[float | None, int | None]:
                waited = (layer.rows.stats().gpu_waited - rbase.gpu_waited) or None
                if layer.worker is None or base is None:
                    return None, waited
                s = layer.worker.stats()
                fills = s.fills - base.fills
                total = s.ready_to_filled_ns_total - base.ready_to_filled_ns_total
                return (total / 1e3 / fills if fills else None), waited

            ops.arm, ops.after_launch, ops.finish, ops.stats = arm, after_launch, finish, stats
            return ops

        return ops_for

    # -- the decode loop --------------------------------------------------------------------

    def _loop(
        self,
        dec: Decoder,
        graph: Any,
        logits: Any,
        style: str,
        ops: _Ops,
        record: _Record,
        *,
        recording: bool = False,
    ) -> RunResult:
        if self.cuda:
            return self._loop_cuda(dec, graph, logits, style, ops, record, recording)
        return self._loop_host(dec, style, ops, record, recording)

    def _loop_cuda(
        self,
        dec: Decoder,
        graph: Any,
        logits: Any,
        style: str,
        ops: _Ops,
        record: _Record,
        recording: bool,
    ) -> RunResult:
        import torch

        steps, b = dec.steps, dec.batch
        stream = torch.cuda.current_stream(self.device)
        first = dec.prefill()
        torch.cuda.synchronize(self.device)
        assert dec.first_tokens is not None
        ids_prev = _in_table(dec.first_tokens, dec.vocab_rows)
        toks = torch.empty((steps, b), dtype=torch.int64).pin_memory()
        tok_ev = [torch.cuda.Event() for _ in range(steps)]  # type: ignore[no-untyped-call]
        ends = [
            torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            for _ in range(steps + 1)
        ]
        mism = torch.zeros(steps, dtype=torch.bool, device=self.device)
        # Preallocated, so the loop allocates nothing while a step may wait for its rows.
        diff = torch.empty(_bits(logits).shape, dtype=torch.bool, device=self.device)
        state_diff = self._check_state(dec, first, record, recording)
        launch_max = 0.0

        def ids_of(k: int, prev: Any) -> Callable[[], Any]:
            def get() -> Any:
                if style == "async" and k > 0:
                    tok_ev[k - 1].synchronize()  # step k-1 only: never waits for step k
                    return _in_table(toks[k - 1].numpy(), dec.vocab_rows)
                return prev

            return get

        ends[0].record(stream)
        try:
            for k in range(steps):
                if ops.needs_ids_before and k > 0 and style == "async":
                    # The ids of step k are step k-1's tokens: they must reach the host
                    # first, which drains the device queue.
                    tok_ev[k - 1].synchronize()
                    ids_prev = _in_table(toks[k - 1].numpy(), dec.vocab_rows)
                ops.arm(k)
                ops.before(k, ids_prev)
                if ops.launching is not None:
                    ops.launching(k, ids_of(k, ids_prev))
                t0 = time.perf_counter()
                graph.replay()
                ends[k + 1].record(stream)
                launch_max = max(launch_max, time.perf_counter() - t0)
                toks[k].copy_(dec.tok.view(-1), non_blocking=True)
                tok_ev[k].record(stream)
                if recording:
                    record.logits[k].copy_(logits)
                else:
                    torch.ne(_bits(logits), _bits(record.logits[k]), out=diff)
                    torch.any(diff, out=mism[k])
                ops.after_launch(k)
                if style == "sync":
                    tok_ev[k].synchronize()
                    ids_prev = _in_table(toks[k].numpy(), dec.vocab_rows)
                elif k > 0:
                    tok_ev[k - 1].synchronize()  # the host reads step k-1's tokens
            ops.finish()
        except BaseException:
            with contextlib.suppress(PleMemopsError):
                self.served.server.close_plan()
            raise
        finally:
            ops.close()
        torch.cuda.synchronize(self.device)
        step_us = [ends[i].elapsed_time(ends[i + 1]) * 1e3 for i in range(steps)]
        tokens = toks.numpy().copy()
        r = RunResult("", b, style, "", steps, step_us, captured=True, tokens=tokens)
        r.state_diff, r.launch_us_max = state_diff, launch_max * 1e6
        if recording:
            record.tokens = tokens
        else:
            bad = mism.cpu().numpy()
            r.logits_identical = not bool(bad.any())
            r.first_mismatch = int(np.argmax(bad)) if bad.any() else None
            r.tokens_identical = bool(np.array_equal(tokens, record.tokens))
        return r

    def _loop_host(
        self, dec: Decoder, style: str, ops: _Ops, record: _Record, recording: bool
    ) -> RunResult:
        """The CPU path: the same step function, run eagerly, fills before each step."""
        import torch

        steps, b = dec.steps, dec.batch
        first = dec.prefill()
        assert dec.first_tokens is not None
        state_diff = self._check_state(dec, first, record, recording)
        ids = _in_table(dec.first_tokens, dec.vocab_rows)
        tokens = np.empty((steps, b), dtype=np.int64)
        step_us: list[float] = []
        mism = np.zeros(steps, dtype=bool)
        for k in range(steps):
            t0 = time.perf_counter()
            ops.arm(k)
            ops.before(k, ids)
            server = self.served.server
            server.graph_path = self._cpu_graph_path
            try:
                logits = dec.step()
            finally:
                server.graph_path = False
            ops.after_launch(k)
            tokens[k] = dec.tok.view(-1).numpy()
            ids = _in_table(tokens[k], dec.vocab_rows)
            step_us.append((time.perf_counter() - t0) * 1e6)
            if recording:
                record.logits[k].copy_(logits)
            else:
                mism[k] = not torch.equal(_bits(logits), _bits(record.logits[k]))
        ops.finish()
        ops.close()
        r = RunResult("", b, style, "", steps, step_us, captured=False, tokens=tokens)
        r.state_diff = state_diff
        if recording:
            record.tokens = tokens
        else:
            r.logits_identical = not bool(mism.any())
            r.first_mismatch = int(np.argmax(mism)) if mism.any() else None
            r.tokens_identical = bool(np.array_equal(tokens, record.tokens))
        return r

    def _check_state(
        self, dec: Decoder, prefill_logits: Any, record: _Record, recording: bool
    ) -> list[str] | None:
        """Checksums of the state a run's steps start from (see the module docs); the
        recording keeps its own, every other run returns what differs from them."""
        got = self.state_digest(dec, prefill_logits)
        if recording:
            record.state = got
            return None
        if record.state is None:
            return None
        diff: list[str] = []
        for k in sorted(set(got) | set(record.state)):
            const = k.startswith(_CONST)
            if const and (k not in got or k not in record.state):
                continue  # made since (another code path's first call): not a change
            name = _CONST if const else k
            if got.get(k) != record.state.get(k) and name not in diff:
                diff.append(name)
        return diff

    def state_digest(self, dec: Decoder, prefill_logits: Any = None) -> dict[str, tuple[int, int]]:
        """Exact checksums (integer sums of the bits and of their squares, order-free) of
        what a decode step reads besides its rows: per cache layer its keys and values and
        counters, the decode token and position, the given prefill logits, the memoised
        constants, and the weights (the model's without the PLE module in place, the stock
        PLE module's and the served one's buffers)."""
        out: dict[str, tuple[int, int]] = {}
        for i, layer in enumerate(dec.cache.layers):
            if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None:
                continue  # not written yet, or a KV-shared layer's placeholder
            out[f"kv-cache layer {i}"] = _checksum([layer.keys, layer.values])
            counters = [layer.cumulative_length]
            host = getattr(layer, "cumulative_length_int", None)
            out[f"cache counters layer {i}"] = _add(_checksum(counters), (host or 0, 0))
        out["decode token/position"] = _checksum([dec.tok, dec.pos])
        if prefill_logits is not None:
            out["prefill logits"] = _checksum([prefill_logits])
        for m in _PATCHED.values():
            for key, t in vars(m)["torch"]._memo.items():
                out[f"{_CONST} {key}"] = _checksum([t])
        served = self.served
        slots = {id(getattr(parent, attr)) for parent, attr in served.owners.values()}
        seen: set[tuple[int, int]] = set()
        weights: list[Any] = []

        def take(mod: Any, skip: set[int]) -> None:
            for sub in mod.modules():
                if id(sub) in skip:
                    continue
                for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
                    key = (t.data_ptr(), t.numel())
                    if key not in seen:
                        seen.add(key)
                        weights.append(t)

        take(served.model, _submodules(served.model, slots))
        take(self.stock, set())
        for mod in served.modules.values():
            take(mod, set())
        out["weights"] = _checksum(weights)
        return out

    def close(self) -> None:
        self._uva = None


_CONST = "memoised constants"


def _submodules(root: Any, ids: set[int]) -> set[int]:
    """Ids of the modules in ``ids`` and of everything under them, within ``root``."""
    out: set[int] = set()
    for mod in root.modules():
        if id(mod) in ids:
            out.update(id(m) for m in mod.modules())
    return out


def _checksum(tensors: list[Any]) -> tuple[int, int]:
    """(sum of the elements' bits, sum of their squares), as int64 with wraparound: exact
    and independent of the reduction's order, so equal data always gives equal sums."""
    import torch

    chunk = 1 << 25
    accs: dict[Any, Any] = {}
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        flat = flat.view(torch.uint8) if flat.element_size() == 1 else _bits(flat)
        acc = accs.get(flat.device)
        if acc is None:
            acc = accs[flat.device] = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for i in range(0, flat.numel(), chunk):
            part = flat[i : i + chunk].to(torch.int64)
            acc[0] += part.sum()
            acc[1] += (part * part).sum()
    out = (0, 0)
    for acc in accs.values():
        a, b = acc.tolist()
        out = _add(out, (a, b))
    return out


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    wrap = 1 << 64
    return (a[0] + b[0]) % wrap, (a[1] + b[1]) % wrap


class _Record:
    """The reference's logits (on the model's device) and tokens of every step."""

    def __init__(self, dec: Decoder, cuda: bool) -> None:
        import torch

        cfg = dec.model.config
        self.logits = torch.empty(
            (dec.steps, dec.batch, int(cfg.vocab_size)),
            dtype=dec.model.dtype,
            device=dec.device,
        )
        self.tokens: Any = None
        self.state: dict[str, tuple[int, int]] | None = None


class _CudaArray:
    """``__cuda_array_interface__`` over pinned host memory: on a UVA system the host
    address is the device address, so torch can wrap it as a CUDA tensor."""

    def __init__(self, pinned: Any, device: int) -> None:
        self._keep = pinned
        self.__cuda_array_interface__ = {
            "shape": tuple(pinned.shape),
            "typestr": "<i2",
            "data": (int(pinned.data_ptr()), False),
            "version": 3,
            "strides": None,
        }


def _bits(t: Any) -> Any:
    """``t`` viewed as integers of its own width: equal views mean equal bits."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _in_table(ids: Any, rows: int) -> np.ndarray[Any, Any]:
    a = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    return np.where((a >= 0) & (a < rows), a, 0)


def _mean_us(ns: list[int]) -> float | None:
    return float(np.mean(ns)) / 1e3 if ns else None
