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

Host-known ids (``deferred-host``) go to the table's gather worker through the server's
steps (:meth:`~ple_memops.steps.Steps.publish_host`): before the launch under
``sync`` scheduling, from their publisher thread under ``async``. The launching
thread never fills: at E2B shapes a launch does not return before the GPU has passed the
rows' wait (measured; BENCHMARKS.md), so a fill it had to make after ``graph.replay()``
would come too late.

Timing: a CUDA event after each step; a step's time is the interval between consecutive
events, so it counts GPU work, any GPU wait at the rows' consumer and any gap where the GPU
had nothing queued (the host was late). Median and p99 over the steps after the first.

The jobs live in their own modules, the names a caller needs stay importable here: the
decode step and a run's record (``decode``), each variant's host side (``variants``), the
timing loop (``timing``) and the state checks (``state``); this module runs them side by
side.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import InvalidArgumentError
from ..transformers import ServedModel
from .decode import ALL_VARIANTS as ALL_VARIANTS
from .decode import ATTENTIONS as ATTENTIONS
from .decode import DEFERRED_VARIANTS as DEFERRED_VARIANTS
from .decode import GEMMA3N_TABLE, bits, in_table, is_cuda
from .decode import STYLES as STYLES
from .decode import WARMUPS as WARMUPS
from .decode import Decoder as Decoder
from .decode import Record as Record
from .decode import RunResult as RunResult
from .state import check_state, state_digest
from .timing import loop
from .variants import Ops as Ops
from .variants import deferred_ops, fallback_ops, installed, sync_gather_ops

__all__ = [
    "ALL_VARIANTS",
    "ATTENTIONS",
    "DEFERRED_VARIANTS",
    "STYLES",
    "WARMUPS",
    "Decoder",
    "GemmaBench",
    "Ops",
    "Record",
    "RunResult",
    "reference_name",
]

log = logging.getLogger("ple_memops.demo")


def reference_name(cuda: bool) -> str:
    """What the reference (the ``gpu-table`` variant: the stock module, its table in the
    model's device memory) is called in what the harness prints: ``gpu-table`` on a GPU,
    ``in-memory table`` on the CPU, where the table is in host memory."""
    return "gpu-table" if cuda else "in-memory table"


class GemmaBench:
    """Runs the variants of one served Gemma 3n model side by side.

    ``served``: the model from :func:`ple_memops.transformers.serve`, moved to its device.
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
        self.cuda = is_cuda(self.device)
        self.progress = progress or (lambda s: None)
        self.watchdog = watchdog
        self.eager_check_steps = eager_check_steps
        self.track_arrival = track_arrival
        self.table = served.tables[GEMMA3N_TABLE]
        self.eager_check: dict[int, bool] = {}
        self.uva: Any = None
        """The ``pinned-uva`` variant's (module, pinned table, bytes), made on first use."""
        self.cpu_graph_path = False
        """The CPU path's eager steps take the captured step's code path (rows from the
        steps' staging buffer), as the served variants' graphs would."""
        self.deadline: float | None = None
        """``time.perf_counter()`` past which no further variant starts (``None``: none)."""
        self.fallbacks_said: set[tuple[str, str]] = set()
        """The (mode, reason) of the steps that did not defer, logged once each."""
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

    installed = installed

    # -- what a batch runs ------------------------------------------------------------------

    def placements_of(self, variant: str, placements: list[str]) -> list[str]:
        """The consumer placements ``variant`` runs in, of those asked for."""
        if variant == "gpu-table":
            return ["-"]
        if variant == "pinned-uva":
            return ["early"]  # the stock module: the stock placement
        # The fallback fills before the launch, so where its consumer sits does not change
        # its time; the CPU path runs it in every placement (that is where the late
        # placement's code is checked without a GPU).
        both = (*DEFERRED_VARIANTS, "fallback") if not self.cuda else DEFERRED_VARIANTS
        return placements if variant in both else placements[:1]

    def planned_runs(self, variants: list[str], styles: list[str], placements: list[str]) -> int:
        """The progress steps :meth:`run_batch` reports for one batch with these arguments
        (a capture counts with the run that follows it): the reference's recording, its
        timed runs (twice on a GPU: before and after the others), and every other
        variant's runs in each of its placements."""
        ref_runs = len(styles) * (2 if self.cuda else 1)
        others = sum(
            len(self.placements_of(v, placements)) * len(styles)
            for v in variants
            if v != "gpu-table"
        )
        return 1 + ref_runs + others

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
                for placement in self.placements_of(variant, placements):
                    if self.deadline is not None and time.perf_counter() > self.deadline:
                        print(f"batch {batch}: {variant} ({placement}) skipped: past the deadline")
                        continue
                    results.extend(self.run_variant(dec, variant, placement, styles, ref, cold))
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
    ) -> tuple[Record, Callable[[], list[RunResult]]]:
        """Capture the stock model (table in GPU memory), record its logits, time it. The
        graph and the table stay on the GPU until ``stack`` closes, so the returned
        callable can time the reference again after the other variants (their modules
        are installed by then; the graph replays what it captured, and the eager prefill
        that precedes a run gives the same values through any variant)."""
        self.progress(f"batch {dec.batch}: {reference_name(self.cuda)} (reference) record")
        before = self._allocated()
        stack.enter_context(self.installed("gpu-table"))
        gpu_bytes = self.model_base + self._allocated() - before if self.cuda else None
        graph, logits = self.capture(dec)
        stack.callback(lambda: self.served.restore())
        record = Record(dec, self.cuda)
        self.loop(dec, graph, logits, "sync", Ops(), record, recording=True)
        self.eager_check[dec.batch] = self.check_eager(dec, record)

        def timed(placement: str) -> list[RunResult]:
            out = []
            for style in styles:
                self.progress(f"batch {dec.batch}: {reference_name(self.cuda)} {style}")
                r = self.loop(dec, graph, logits, style, Ops(), record)
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

    def check_eager(self, dec: Decoder, record: Record) -> bool:
        """The captured reference against the stock model run eagerly for the first steps."""
        import torch

        k = min(self.eager_check_steps, dec.steps)
        if k == 0:
            return True
        dec.prefill()
        ok = True
        for i in range(k):
            logits = dec.step()
            ok &= bool(torch.equal(bits(logits), bits(record.logits[i])))
        return ok

    def capture(self, dec: Decoder, ops: Ops | None = None) -> tuple[Any, Any]:
        """Capture ``dec``'s step with the module installed now: ``(graph, logits)``, or
        ``(None, None)`` on the CPU path. With ``ops``, the warm-up steps take the
        variant's protocol (arm, fill or publish, complete) eagerly first, so the path is
        loaded and checked before the capture; ``ops`` is finished and closed after."""
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
            ids = in_table(dec.tok.view(-1).cpu().numpy(), dec.vocab_rows)
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

    def run_variant(
        self,
        dec: Decoder,
        variant: str,
        placement: str,
        styles: list[str],
        ref: Record,
        cold: bool,
    ) -> list[RunResult]:
        """Install ``variant`` in ``placement``, capture its step and time it in every
        style against the reference's record ``ref`` (``cold``: drop the table's pages
        before each run); the served module and placement are put back after."""
        served = self.served
        server = served.server
        out: list[RunResult] = []
        before = self._allocated()
        with contextlib.ExitStack() as stack:
            pinned = stack.enter_context(self.installed(variant))
            served.set_placement(placement if variant != "gpu-table" else "early")
            stack.callback(served.set_placement, "early")
            mode = None
            ops_for: Callable[[str], Ops]
            n = dec.batch
            if variant in ("gpu-table", "pinned-uva"):

                def ops_for(style: str) -> Ops:
                    return Ops()

            elif variant == "sync-gather":
                ops_for, buffers, pinned = sync_gather_ops(self, dec)
                stack.enter_context(server.staging_buffers(buffers))
            else:
                deferred = variant != "fallback"
                source = "host" if variant == "deferred-host" else "device"
                ready = served.prepare(
                    n,
                    device=self.device,
                    deferred=deferred,
                    source=source,
                    watchdog=self.watchdog,
                    timeout=self.watchdog,
                    track_arrival=self.track_arrival and self.cuda,
                    log_fallback=False,
                )
                stack.callback(server.close_steps)
                mode = ready.mode
                self._say_fallback(ready)
                pinned = n * self.table.row_bytes
                if variant == "fallback" or ready.mode != "deferred":
                    ops_for = fallback_ops(self, dec)
                elif variant == "deferred-host":
                    ops_for = deferred_ops(self, dec, host=True)
                else:
                    ops_for = deferred_ops(self, dec, host=False)
            if not self.cuda:
                # No graphs here: run the captured step's code path eagerly, rows filled
                # before each step (the host steps), to check it against the reference.
                self.cpu_graph_path = variant not in ("gpu-table", "pinned-uva")
                stack.callback(setattr, self, "cpu_graph_path", False)
            gpu_bytes = self.model_base + self._allocated() - before if self.cuda else None
            self.progress(f"batch {dec.batch}: {variant} ({placement}) capture")
            graph, logits = self.capture(dec, ops_for("sync"))
            for style in styles:
                if cold:
                    self.table.drop_pages()
                self.progress(f"batch {dec.batch}: {variant} ({placement}) {style}")
                ops = ops_for(style)
                r = self.loop(dec, graph, logits, style, ops, ref)
                r.variant, r.placement = variant, placement
                r.gpu_bytes, r.pinned_bytes, r.mode = gpu_bytes, pinned, mode
                r.host_gather_us, r.gpu_waited = ops.stats()
                out.append(r)
            del graph
        return out

    def _say_fallback(self, steps: Any) -> None:
        """Log, once a run of the harness, each reason the steps do not defer (every
        variant and batch builds its own, for the same reason)."""
        if steps.reason is None or (steps.mode, steps.reason) in self.fallbacks_said:
            return
        self.fallbacks_said.add((steps.mode, steps.reason))
        log.warning(
            "ple_memops: PLE rows of %d table(s) use the %s path: %s",
            len(steps.names),
            steps.mode,
            steps.reason,
        )

    # -- the decode loop and the state checks (their own modules) ------------------------

    loop = loop
    check_state = check_state
    state_digest = state_digest

    def close(self) -> None:
        self.uva = None
