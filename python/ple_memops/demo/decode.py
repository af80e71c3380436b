"""The decode step the runner times: :class:`Decoder` (static-cache greedy decode of one
batch size, its step captured into one CUDA graph), the variants' names and the record of
a run (:class:`RunResult`, the reference's :class:`Record`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .capture import capture_scope, device_query_offset, make_capturable

__all__ = [
    "ALL_VARIANTS",
    "ATTENTIONS",
    "DEFERRED_VARIANTS",
    "GEMMA3N_TABLE",
    "STYLES",
    "WARMUPS",
    "Decoder",
    "Record",
    "RunResult",
    "bits",
    "cache_kwarg",
    "in_table",
    "is_cuda",
]

GEMMA3N_TABLE = "embed_tokens_per_layer"
"""The name a served Gemma 3n model's PLE table has in ``ServedModel.tables``."""

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
    """The steps' mode (deferred / sync / host), where one is used."""
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


def cache_kwarg(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` where the
    signature has it, else ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def is_cuda(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its name) is a CUDA device."""
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
        self.cache_kw = cache_kwarg(model)
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


class Record:
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


def bits(t: Any) -> Any:
    """``t`` viewed as integers of its own width: equal views mean equal bits."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def in_table(ids: Any, rows: int) -> np.ndarray[Any, Any]:
    """``ids`` as a flat int64 array with those outside ``[0, rows)`` mapped to row 0, as
    the served Gemma 3n table reads them (stock semantics)."""
    a = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    return np.where((a >= 0) & (a < rows), a, 0)
