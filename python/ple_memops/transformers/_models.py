"""Model adapters: find a model's PLE tables, check them against the checkpoint, swap the
embedding modules for served ones, and (Gemma 3n) move the rows' first consumer later."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._common import capturing
from ..errors import TableError
from ..table import MmapTable
from ._errors import TableMissingError, UnsupportedModelError
from ._serve import PleServer, ServedTable, TableSpec, _Ticket, is_served

__all__ = ["ServedModel", "serve"]

GEMMA3N_TABLE = "embed_tokens_per_layer"
# The real (multimodal) checkpoints first, then what Gemma3nForCausalLM.save_pretrained writes.
GEMMA3N_TENSORS = (
    "model.language_model.embed_tokens_per_layer.weight",
    "model.embed_tokens_per_layer.weight",
)
QWEN4EXP_PREFIXES = ("model.language_model.layers", "model.layers")
QWEN4EXP_SHARDS = "{prefix}.{i}.ple.ple_embedding.ngram_embedding.shard_{{}}.weight"
QWEN4EXP_TENSOR = "{prefix}.{i}.ple.ple_embedding.ngram_embedding.weight"


@dataclass
class ServedModel:
    """A model whose PLE tables are served from its checkpoint (see :func:`serve`)."""

    model: Any
    kind: str
    """``"gemma3n"`` or ``"qwen4exp"``."""
    server: PleServer
    modules: dict[str, Any]
    """Table name -> the module that replaced the embedding (``ServedTable``)."""
    owners: dict[str, tuple[Any, str]]
    """Table name -> (parent module, attribute) where the embedding lives."""
    text_model: Any
    placement: str = "early"
    _late: Any = field(default=None, repr=False)

    @property
    def tables(self) -> dict[str, MmapTable]:
        return self.server.tables

    def prepare(self, max_tokens: int, **kwargs: Any) -> Any:
        """Build the tables' steps for captured steps of up to ``max_tokens`` tokens; see
        :meth:`PleServer.prepare`."""
        return self.server.prepare(max_tokens, **kwargs)

    def install(self, name: str, module: Any) -> Any:
        """Put ``module`` where table ``name``'s embedding lives (benchmarks swap the stock
        module back in); returns the module it replaced."""
        parent, attr = self.owners[name]
        old = getattr(parent, attr)
        setattr(parent, attr, module)
        return old

    def restore(self) -> None:
        """Put the served modules back."""
        for name, mod in self.modules.items():
            self.install(name, mod)

    def set_placement(self, placement: str) -> None:
        """``"early"``: the stock position (Gemma 3n: right after the token embedding);
        ``"late"`` (Gemma 3n only): at the end of layer 0, where the rows are first used
        mathematically, so layer 0's attention, MLP and AltUp run before the GPU waits."""
        if placement not in ("early", "late"):
            raise UnsupportedModelError(f"placement must be 'early' or 'late', got {placement!r}")
        if placement == "late" and self.kind != "gemma3n":
            raise UnsupportedModelError(f"the late placement is for Gemma 3n, not {self.kind}")
        if self._late is not None:
            self._late.remove()
            self._late = None
        if placement == "late":
            self._late = _Gemma3nLateConsumer(self)
        self.placement = placement

    def close(self) -> None:
        if self._late is not None:
            self._late.remove()
            self._late = None
        self.server.close()


def _text_model(model: Any) -> tuple[str, Any]:
    name = type(model).__name__
    inner = model
    for _ in range(3):
        cls = type(inner).__name__
        if cls == "Gemma3nTextModel":
            return "gemma3n", inner
        if cls == "Qwen4ExpTextModel":
            return "qwen4exp", inner
        nxt = getattr(inner, "language_model", None) or getattr(inner, "model", None)
        if nxt is None:
            break
        inner = nxt
    raise UnsupportedModelError(
        f"{name} is not a supported PLE model: expected Gemma 3n (Gemma3nForCausalLM, "
        "Gemma3nTextModel, Gemma3nForConditionalGeneration) or Qwen4Exp (Qwen4ExpForCausalLM, "
        "Qwen4ExpTextModel, Qwen4ExpForConditionalGeneration)"
    )


def _open_first(
    ckpt: str, names: list[tuple[str | None, str | None]], what: str
) -> tuple[MmapTable, str | None, str | None]:
    tried: list[str] = []
    for tensor, pattern in names:
        try:
            return MmapTable.open(ckpt, tensor, pattern=pattern), tensor, pattern
        except TableError as e:
            msg = str(e)
            # Only "not there" moves on; a malformed or inconsistent file is the answer.
            if "no tensor" in msg:
                tried.append(tensor or str(pattern))
                continue
            raise
    raise TableMissingError(f"{what}: none of {tried} is in the checkpoint {ckpt!r}")


def serve(
    model: Any,
    checkpoint: str | os.PathLike[str],
    *,
    placement: str = "early",
    prewarm: bool = False,
) -> ServedModel:
    """Serve ``model``'s PLE tables from ``checkpoint`` instead of holding them.

    ``model``: a loaded Gemma 3n or Qwen4Exp model (transformers), still on the CPU (call
    before ``model.to("cuda")``: the tables' parameters are dropped here, so they never
    reach the GPU). ``checkpoint``: the directory (or ``.safetensors`` file / index) it was
    loaded from. Each table is memory-mapped read-only (never copied to the GPU, never
    pinned) and checked against the model: dtype, row width and row count. ``prewarm``
    faults every table page in now (a warm page cache from the first step);
    ``placement``: see :meth:`ServedModel.set_placement`.

    Eager forwards then gather synchronously; a decode step captured with
    ``torch.cuda.graph`` publishes the ids the model computes on the GPU and consumes the
    rows deferred, after :meth:`ServedModel.prepare` built the steps.

    Raises:
        UnsupportedModelError: not a Gemma 3n / Qwen4Exp model (or no PLE layer).
        TableMissingError: a table is not in the checkpoint.
        TableMismatchError: dtype, width or row count disagree.
        TableError: the checkpoint is malformed.
    """
    kind, tm = _text_model(model)
    ckpt = str(Path(checkpoint))
    specs: list[TableSpec] = []
    tables: dict[str, MmapTable] = {}
    owners: dict[str, tuple[Any, str]] = {}
    scales: dict[str, float | None] = {}
    try:
        if kind == "gemma3n":
            emb = tm.embed_tokens_per_layer
            if is_served(emb):
                raise UnsupportedModelError("this model's PLE table is already served")
            cfg = tm.config
            spec = TableSpec(
                name=GEMMA3N_TABLE,
                tensor=None,
                pattern=None,
                rows=int(cfg.vocab_size_per_layer_input),
                cols=int(cfg.num_hidden_layers * cfg.hidden_size_per_layer_input),
                dtype=emb.weight.dtype,
                ids_per_token=1,
            )
            table, tensor, _ = _open_first(
                ckpt, [(t, None) for t in GEMMA3N_TENSORS], "Gemma 3n embed_tokens_per_layer"
            )
            spec = TableSpec(**{**spec.__dict__, "tensor": tensor})
            specs.append(spec)
            tables[spec.name] = table
            owners[spec.name] = (tm, "embed_tokens_per_layer")
            scales[spec.name] = float(emb.scalar_embed_scale)
        else:
            for i, layer in enumerate(tm.layers):
                ple = getattr(layer, "ple", None)
                if ple is None:
                    continue
                ng = ple.ple_embedding
                emb = ng.ngram_embedding
                if is_served(emb):
                    raise UnsupportedModelError("this model's PLE tables are already served")
                name = f"layers.{i}"
                candidates: list[tuple[str | None, str | None]] = []
                for prefix in QWEN4EXP_PREFIXES:
                    candidates.append((None, QWEN4EXP_SHARDS.format(prefix=prefix, i=i)))
                    candidates.append((QWEN4EXP_TENSOR.format(prefix=prefix, i=i), None))
                table, tensor, pattern = _open_first(ckpt, candidates, f"Qwen4Exp layer {i} PLE")
                spec = TableSpec(
                    name=name,
                    tensor=tensor,
                    pattern=pattern,
                    rows=int(emb.num_embeddings),
                    cols=int(emb.embedding_dim),
                    dtype=emb.weight.dtype,
                    ids_per_token=int(ng.ngram_heads),
                )
                specs.append(spec)
                tables[name] = table
                owners[name] = (ng, "ngram_embedding")
                scales[name] = None
            if not specs:
                raise UnsupportedModelError("this Qwen4Exp model has no PLE layer")
        for spec in specs:
            PleServer.check_table(spec, tables[spec.name])
        if prewarm:
            for t in tables.values():
                t.prewarm()
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    server = PleServer(ckpt, specs, tables)
    modules: dict[str, Any] = {}
    for spec in specs:
        parent, attr = owners[spec.name]
        old = getattr(parent, attr)
        modules[spec.name] = ServedTable(
            server,
            spec,
            scale=scales[spec.name],
            map_out_of_table=(kind == "gemma3n"),
            device=old.weight.device,
        )
        setattr(parent, attr, modules[spec.name])  # the Parameter goes with the old module
    served = ServedModel(
        model=model, kind=kind, server=server, modules=modules, owners=owners, text_model=tm
    )
    served.set_placement(placement)
    return served


class _Gemma3nLateConsumer:
    """Gemma 3n's rows are first *used* at the end of layer 0 (``per_layer_input *
    act(gate(x))``), but stock code combines them with the projection right after the
    token embedding. In a captured step this moves the combine (and so the wait for the
    rows) into a forward hook on layer 0's ``per_layer_input_gate``: the projection is
    computed where stock computes it, the combined buffer written just before the layer
    reads its slice. Values are bit-identical: the same elementwise ``(proj + rows) *
    rsqrt(2)`` runs, only later. Eager calls stay stock."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        tm = served.text_model
        self.tm = tm
        self.orig_project = tm.project_per_layer_inputs
        self.pending: dict[str, Any] = {}
        tm.project_per_layer_inputs = self._project
        self.handle = tm.layers[0].per_layer_input_gate.register_forward_hook(self._hook)
        served.server.consume_later(GEMMA3N_TABLE, self._take)

    def _active(self) -> bool:
        return self.served.server.graph_path or capturing()

    def _take(self, ticket: _Ticket) -> None:
        self.pending["ticket"] = ticket

    def _project(self, inputs_embeds: Any, per_layer_inputs: Any = None) -> Any:
        import torch

        if not self._active() or "ticket" not in self.pending:
            self.pending.clear()
            return self.orig_project(inputs_embeds, per_layer_inputs)
        proj = self.orig_project(inputs_embeds, None)
        buf = torch.empty_like(proj)
        self.pending["proj"], self.pending["buf"] = proj, buf
        self.pending["shape"] = inputs_embeds.shape[:-1]
        self.pending["dtype"] = inputs_embeds.dtype
        return buf

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if not self._active() or "buf" not in self.pending:
            return
        p, self.pending = self.pending, {}
        ticket: _Ticket = p["ticket"]
        served_mod = self.served.modules[GEMMA3N_TABLE]
        rows = served_mod.decode(ticket.consume(), p["shape"])
        cfg = self.tm.config
        ple = rows.reshape(*p["shape"], -1, cfg.hidden_size_per_layer_input)
        proj = p["proj"]
        if proj.shape != ple.shape:
            ple = ple[..., : cfg.num_hidden_layers, :]
        scale = self.tm.per_layer_input_scale.to(dtype=p["dtype"], device=proj.device)
        p["buf"].copy_((proj + ple) * scale)

    def remove(self) -> None:
        self.handle.remove()
        if self.tm.__dict__.get("project_per_layer_inputs") == self._project:
            del self.tm.project_per_layer_inputs
        self.served.server.consume_later(GEMMA3N_TABLE, None)
        self.pending.clear()
