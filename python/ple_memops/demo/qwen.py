"""Qwen4Exp through transformers' own code: the stock model against the same model with its
n-gram PLE tables served from the checkpoint, decoding greedily, logits compared bit for
bit at every step.

The n-gram ids are hashed on the model's device from the token history by HF's
``Qwen4ExpTextNGramEmbedding``; only its ``nn.Embedding`` lookup is replaced. Decode runs
eagerly: HF's Qwen4Exp decode step does host-side work (cache-state branches, MoE
routing by data-dependent shapes, the sparse-attention indexer's ``nonzero``), so a whole
step does not capture into one graph; :func:`qwen_check` tries and reports what happened.
On a GPU that can defer, a third run takes the captured-step path eagerly: the ids the
model hashed on the GPU are published to the native worker (no host copy of the ids).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["QwenReport", "qwen_check"]


@dataclass
class QwenReport:
    batch: int
    steps: int
    tables: dict[str, tuple[int, int]]
    """Table -> (rows, row bytes)."""
    runs: dict[str, bool] = field(default_factory=dict)
    """Variant -> logits bit-identical to the stock model at every step (and tokens)."""
    capture: str = ""
    """What happened when a whole decode step was captured."""
    gpu_bytes: tuple[int | None, int | None] = (None, None)
    """GPU memory the stock model and the served model hold (their weights)."""
    notes: list[str] = field(default_factory=list)


def _decode(model: Any, prompt: Any, steps: int, on_step: Any = None) -> list[Any]:
    import torch

    from .decode import cache_kwarg

    kw = cache_kwarg(model)
    out: list[Any] = []
    with torch.no_grad():
        res = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        logits = res.logits[:, -1, :]
        out.append(logits.clone())
        for k in range(steps):
            tok = logits.argmax(-1, keepdim=True)
            if on_step is not None:
                on_step(k, "begin")
            res = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{kw: cache})
            if on_step is not None:
                on_step(k, "end")
            cache = res.past_key_values
            logits = res.logits[:, -1, :]
            out.append(logits.clone())
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    from .decode import bits

    return len(a) == len(b) and all(
        torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True)
    )


def qwen_check(
    checkpoint: str | os.PathLike[str],
    *,
    batch: int = 2,
    steps: int = 16,
    prompt_len: int = 8,
    device: Any = None,
    try_capture: bool = True,
) -> QwenReport:
    """Decode ``steps`` tokens with the stock Qwen4Exp model and with its PLE tables served
    from ``checkpoint``; report whether the logits are bit-identical at every step."""
    import torch
    import transformers

    from ..transformers import serve

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cls: Any = transformers.Qwen4ExpForCausalLM
    ref = cls.from_pretrained(checkpoint, dtype=torch.bfloat16)
    model = cls.from_pretrained(checkpoint, dtype=torch.bfloat16)
    served = serve(model, checkpoint)

    def held(m: Any) -> int | None:
        if dev.type != "cuda":
            return None
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        m.to(dev)
        return int(torch.cuda.memory_allocated(dev) - before)

    ref_bytes, served_bytes = held(ref), held(model)
    ref.to(dev).eval()
    model.to(dev).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=gen).to(dev)
    rep = QwenReport(
        batch=batch,
        steps=steps,
        tables={n: (t.rows, t.row_bytes) for n, t in served.tables.items()},
        gpu_bytes=(ref_bytes, served_bytes),
    )
    want = _decode(ref, prompt, steps)
    got = _decode(model, prompt, steps)
    rep.runs["mmap-eager"] = _same(want, got)
    if dev.type == "cuda":
        rep.runs.update(_deferred_eager(served, model, prompt, steps, want, batch))
        try:
            rep.runs.update(_piece_captured(served, model, prompt, steps, want, batch))
        except Exception as e:  # report: this is what HF's code allows, measured
            rep.notes.append(f"n-gram PLE piece capture failed: {type(e).__name__}: {e}"[:300])
        if try_capture:
            served.prepare(batch, deferred=True, source="device")
            try:
                rep.capture = _try_capture(model, prompt, dev)
            finally:
                served.server.close_steps()
        rep.notes.append(
            "decode steps ran eagerly, except (where it ran) each PLE layer's n-gram "
            "hashing + deferred row lookup, replayed from a CUDA graph"
        )
    else:
        rep.capture = "not tried: no CUDA device"
    served.close()
    return rep


def _deferred_eager(
    served: Any, model: Any, prompt: Any, steps: int, want: list[Any], batch: int
) -> dict[str, bool]:
    """Decode steps through the captured-step path, run eagerly: each PLE table's ids
    (hashed by HF on the GPU) are published to the worker, the rows consumed after the
    join. The prefill gathers synchronously."""
    server = served.server
    per_token = max(s.ids_per_token for s in server.specs.values())
    ready = served.prepare(batch, deferred=True, source="device")
    if ready.mode != "deferred":
        served.server.close_steps()
        return {}

    driver = server.live_steps()

    def on_step(k: int, when: str) -> None:
        if when == "begin":
            server.graph_path = True
            driver.arm(batch * per_token)
        else:
            server.graph_path = False
            driver.settle(driver.in_flight - 1)

    try:
        got = _decode(model, prompt, steps, on_step)
    finally:
        server.graph_path = False
        server.close_steps()
    return {"deferred-device (eager steps)": _same(want, got)}


class _CapturedPiece:
    """One ``Qwen4ExpTextNGramEmbedding`` whose decode-step forward (HF's n-gram hashing
    from the cached token history, the cache update, and the served row lookup: publish,
    join, rows) is captured into a CUDA graph on its first decode call and replayed after.
    The first call runs eagerly on the captured path (it is that step's result), then
    captures (a capture executes nothing, so no state advances twice)."""

    def __init__(self, module: Any, server: Any) -> None:
        self.module, self.server = module, server
        self.orig = module.forward
        self.graph: Any = None
        self.ids: Any = None
        self.out: Any = None
        self.captured = 0

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        if input_ids.shape[1] != 1:  # prefill: stock, eager, synchronous gather
            return self.orig(input_ids, *args, **kwargs)
        if self.graph is None:
            self.server.graph_path = True
            try:
                first = self.orig(input_ids, *args, **kwargs)
            finally:
                self.server.graph_path = False
            self.ids = input_ids.clone()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = self.orig(self.ids, *args, **kwargs)
            self.captured += 1
            return first
        self.ids.copy_(input_ids)
        self.graph.replay()
        return self.out.clone()

    def remove(self) -> None:
        self.module.forward = self.orig


def _piece_captured(
    served: Any, model: Any, prompt: Any, steps: int, want: list[Any], batch: int
) -> dict[str, bool]:
    server = served.server
    per_token = max(s.ids_per_token for s in server.specs.values())
    ready = served.prepare(batch, deferred=True, source="device")
    if ready.mode != "deferred":
        server.close_steps()
        return {}
    pieces = []
    for parent, _attr in served.owners.values():
        piece = _CapturedPiece(parent, server)
        parent.forward = piece
        pieces.append(piece)

    driver = server.live_steps()

    def on_step(k: int, when: str) -> None:
        if when == "begin":
            driver.arm(batch * per_token)
        else:
            driver.settle(driver.in_flight - 1)

    try:
        got = _decode(model, prompt, steps, on_step)
    finally:
        for piece in pieces:
            piece.remove()
        server.close_steps()
    if not all(p.captured == 1 for p in pieces):
        return {}
    return {"deferred-device (n-gram PLE piece captured, rest eager)": _same(want, got)}


def _try_capture(model: Any, prompt: Any, dev: Any) -> str:
    """Capture one whole decode step with ``torch.cuda.graph`` (the served tables' steps
    prepared, so what stops it is HF's code); say what happened."""
    import torch

    from .decode import cache_kwarg

    kw = cache_kwarg(model)
    try:
        with torch.no_grad():
            res = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            cache = res.past_key_values
            tok = res.logits[:, -1, :].argmax(-1, keepdim=True)
            side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                model(input_ids=tok, use_cache=True, logits_to_keep=1, **{kw: cache})
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                model(input_ids=tok, use_cache=True, logits_to_keep=1, **{kw: cache})
        del graph
        return "a whole decode step captured (not replayed: HF's cache advances host state)"
    except Exception as e:  # report, do not fail: this documents what HF allows
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        msg = f"a whole decode step does not capture: {type(e).__name__}: {first[:200]}"
        try:
            torch.cuda.synchronize(dev)
        except Exception as after:  # a failed capture may leave the context unusable
            msg += f" (and the device then failed: {type(after).__name__})"
        return msg
