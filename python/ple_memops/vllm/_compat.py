"""Every name of vLLM's the plugin relies on, checked against the installed vLLM before
anything is installed.

The plugin subclasses and wraps private parts of vLLM (the Model Runner V2 runner, its
CUDA graph manager, the NVIDIA Qwen4Exp model and its PLE embedding, Gemma 4's and
Gemma 3n's text and multimodal models, their config hooks, the default loader's file
filter). A vLLM whose names or signatures differ would run the plugin half-way, which is
worse than not at all: :func:`check` lists every difference and :func:`require` refuses to
start with one error naming the version and each of them.

The facts are kept per release: most hold on every release in :data:`TESTED_VERSIONS`; one
that differs says what it is on each. A release not in that list is refused, naming every
fact that fails; with :data:`UNTESTED_ENV` set to ``1`` it starts when every fact holds
(a fact that differs between releases holds in any known release's form), with a warning.
Signatures are compared by parameter names, kinds and defaults (annotations vary with how
a module was imported).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedError

__all__ = [
    "TESTED_VERSIONS",
    "UNTESTED_ENV",
    "Report",
    "Requirement",
    "check",
    "problems",
    "report",
    "require",
]

logger = logging.getLogger("ple_memops")

TESTED_VERSIONS = ("0.33.0", "0.34.0")
"""The vLLM releases the plugin is tested with, oldest first."""

UNTESTED_ENV = "PLE_MEMOPS_VLLM_UNTESTED"
"""``1``: start on a vLLM release not in :data:`TESTED_VERSIONS` when every fact holds."""


@dataclass(frozen=True)
class Requirement:
    """One fact about vLLM the plugin relies on: ``check(version)`` returns ``None`` when
    it holds on that release, else what differs."""

    what: str
    check: Callable[[str], str | None]


def _resolve(path: str) -> Any:
    """``"pkg.module:Attr.attr"`` -> the object (raises on a missing name)."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attrs.split(".") if attrs else []:
        obj = getattr(obj, part)
    return obj


def _bare(fn: Any) -> str:
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(inspect.Signature(params))


def _expected_on(expected: str | Mapping[str, str], version: str) -> list[str]:
    """The forms a fact may take on ``version``: its own where known, else any release's."""
    if isinstance(expected, str):
        return [expected]
    if version in expected:
        return [expected[version]]
    return list(dict.fromkeys(expected.values()))


def _signature(path: str, expected: str | Mapping[str, str]) -> Requirement:
    """``path``'s signature is ``expected``: one string for every release, or a mapping
    from release to its signature."""

    def check(version: str) -> str | None:
        try:
            got = _bare(_resolve(path))
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        except (TypeError, ValueError) as exc:  # pragma: no cover - not introspectable
            return f"no signature ({exc})"
        forms = _expected_on(expected, version)
        return None if got in forms else f"signature {got}, expected {' or '.join(forms)}"

    if isinstance(expected, str):
        return Requirement(f"{path}{expected}", check)
    per_release = "; ".join(f"{v}: {sig}" for v, sig in expected.items())
    return Requirement(f"{path} ({per_release})", check)


def _exists(path: str, kind: type | None = None) -> Requirement:
    def check(version: str) -> str | None:
        try:
            obj = _resolve(path)
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        if kind is not None and not isinstance(obj, kind):
            return f"is a {type(obj).__name__}, expected a {kind.__name__}"
        return None

    return Requirement(path, check)


def _source_has(path: str, needle: str, why: str) -> Requirement:
    def check(version: str) -> str | None:
        try:
            source = inspect.getsource(_resolve(path))
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        except (OSError, TypeError) as exc:  # pragma: no cover - no source shipped
            return f"source unavailable ({exc})"
        return None if needle in source else f"no longer contains {needle!r} ({why})"

    return Requirement(f"{path} {why}", check)


def _subclass(path: str, base: str) -> Requirement:
    def check(version: str) -> str | None:
        try:
            cls, parent = _resolve(path), _resolve(base)
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        if not (isinstance(cls, type) and issubclass(cls, parent)):
            return f"is not a subclass of {base}"
        return None

    return Requirement(f"{path} subclasses {base}", check)


def _config_map_has(arch: str) -> Requirement:
    def check(version: str) -> str | None:
        try:
            mapping = _resolve("vllm.model_executor.models.config:MODELS_CONFIG_MAP")
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        return None if arch in mapping else f"has no entry for {arch}"

    return Requirement(f"MODELS_CONFIG_MAP[{arch!r}]", check)


_MR = "vllm.v1.worker.gpu.model_runner"
_CG = "vllm.v1.worker.gpu.cudagraph_utils"
_NE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
_CE = "vllm.models.qwen4_exp.common.ngram_embedding"
_NM = "vllm.models.qwen4_exp.nvidia.model"
_MC = "vllm.model_executor.models.config"
_G4 = "vllm.model_executor.models.gemma4"
_G4M = "vllm.model_executor.models.gemma4_mm"
_G3N = "vllm.model_executor.models.gemma3n"
_G3NM = "vllm.model_executor.models.gemma3n_mm"

REQUIREMENTS: tuple[Requirement, ...] = (
    # The worker, named in ParallelConfig.worker_cls, builds the runner; the runner is
    # subclassed.
    _signature("vllm.v1.worker.gpu_worker:Worker._make_model_runner", "(self)"),
    _signature(f"{_MR}:GPUModelRunner.__init__", "(self, vllm_config, device)"),
    _signature(
        f"{_MR}:GPUModelRunner.load_model",
        "(self, load_dummy_weights=False, *args, model=None, **kwargs)",
    ),
    _signature(
        f"{_MR}:GPUModelRunner.initialize_kv_cache",
        {
            "0.33.0": "(self, kv_cache_config, is_profiling=False, "
            "kv_cache_allocation_context=None)",
            "0.34.0": "(self, kv_cache_config, is_profiling=False, "
            "kv_cache_allocation_context=None, extensible=False)",
        },
    ),
    _signature(f"{_MR}:GPUModelRunner.capture_model", "(self, *, profile_only=False)"),
    _signature(
        f"{_MR}:GPUModelRunner.execute_model",
        "(self, scheduler_output, intermediate_tensors=None, dummy_run=False, "
        "skip_attn_for_dummy_run=False, is_profile=False, context_len=0, "
        "valid_dummy_state_slots=False, randomize_inputs=False)",
    ),
    _signature(f"{_MR}:GPUModelRunner.shutdown", "(self)"),
    _signature(f"{_MR}:GPUModelRunner.sample_tokens", "(self, grammar_output)"),
    _exists("vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output"),
    _source_has(
        f"{_MR}:GPUModelRunner.initialize_kv_cache",
        "self.cudagraph_manager = ModelCudaGraphManager(",
        "builds the CUDA graph manager",
    ),
    # The CUDA graph manager: its capture loop, FULL replays and release.
    _signature(
        f"{_CG}:CudaGraphManager.capture",
        {
            "0.33.0": "(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs')",
            "0.34.0": "(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs', "
            "stream=None)",
        },
    ),
    _signature(f"{_CG}:CudaGraphManager.run_fullgraph", "(self, desc)"),
    _signature(f"{_CG}:CudaGraphManager.release_graphs", "(self)"),
    _subclass(f"{_CG}:ModelCudaGraphManager", f"{_CG}:CudaGraphManager"),
    _source_has(
        f"{_CG}:ModelCudaGraphManager.capture",
        "super().capture(",
        "hands its forward factory to CudaGraphManager.capture",
    ),
    # The NVIDIA Qwen4Exp model and its PLE embedding.
    _exists(f"{_NE}:Qwen4ExpPLEDeviceEmbedding", type),
    _exists(f"{_NE}:Qwen4ExpPLEPinnedHostEmbedding", type),
    _source_has(
        f"{_NE}:Qwen4ExpNGramEmbedding.__init__",
        "embedding_cls = (",
        "chooses the table class by module-level name",
    ),
    _source_has(
        f"{_NE}:Qwen4ExpNGramEmbedding.__init__",
        "self.use_reduce_scatter = (",
        "decides the vocabulary reduce-scatter",
    ),
    _signature(
        f"{_NE}:Qwen4ExpNGramEmbedding.compute_ngram_ids",
        "(self, input_ids, query_start_loc, ngram_context, output=None)",
    ),
    _source_has(
        f"{_NE}:Qwen4ExpNGramEmbedding.start_prefetch",
        "output=self._prefetch_ids[: input_ids.numel()]",
        "computes its ids into a persistent buffer",
    ),
    _signature(
        f"{_CE}:Qwen4ExpPLEEmbedding.__init__",
        "(self, num_embeddings, embedding_dim, *, params_dtype, padding_size, prefix, "
        "embedding_method, num_ngram_heads=1, max_total_tokens=0, data_parallel_rank=0, "
        "reduce_results=True)",
    ),
    _signature(
        f"{_CE}:Qwen4ExpPLEEmbedding.allocate_embedding_weight",
        "(self, num_embeddings, embedding_dim, dtype)",
    ),
    _signature(f"{_CE}:Qwen4ExpPLEEmbedding.start_prefetch", "(self, ngram_ids)"),
    _signature(f"{_CE}:Qwen4ExpPLEEmbedding.finalize_prefetch", "(self, total_tokens)"),
    _exists(f"{_CE}:Qwen4ExpPLENvFp4EmbeddingMethod", type),
    _signature(
        f"{_NM}:Qwen4ExpModel._start_layer_ple_prefetch",
        "(layer, input_ids, query_start_loc, ngram_context)",
    ),
    _source_has(
        f"{_NM}:Qwen4ExpModel.forward",
        "self._start_layer_ple_prefetch(",
        "starts each PLE layer's lookup",
    ),
    _signature(f"{_NM}:Qwen4ExpForCausalLM.__init__", "(self, *, vllm_config, prefix='')"),
    _signature(
        f"{_NM}:Qwen4ExpForConditionalGeneration.__init__",
        "(self, *, vllm_config, prefix='model')",
    ),
    # Config time: the Qwen4Exp hooks the plugin extends with its refusals.
    _config_map_has("Qwen4ExpForCausalLM"),
    _config_map_has("Qwen4ExpForConditionalGeneration"),
    _signature(f"{_MC}:Qwen4ExpForCausalLMConfig.verify_and_update_config", "(vllm_config)"),
    _signature(
        f"{_MC}:Qwen4ExpForConditionalGenerationConfig.verify_and_update_config",
        "(vllm_config)",
    ),
    # Gemma 4: its per-layer table built by a module-level name, the lookup and the
    # combination the plugin's self-decoder splits around the rows, the multimodal class's
    # eager rows and its forward.
    _signature(f"{_G4}:Gemma4ForCausalLM.__init__", "(self, *, vllm_config, prefix='')"),
    # Both Gemmas: a quantized per-layer table is refused, asked of vLLM's own class.
    _signature(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
        "(self, num_embeddings, embedding_dim, params_dtype=None, org_num_embeddings=None, "
        "padding_size=64, quant_config=None, prefix='', *, disable_tp=False, "
        "reduce_results=True, quant_method=None, parallel_group=None)",
    ),
    _exists("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod", type),
    _exists(f"{_G4}:VocabParallelEmbedding", type),
    _source_has(
        f"{_G4}:Gemma4Model",
        "self.embed_tokens_per_layer = VocabParallelEmbedding(",
        "builds the per-layer table with the module-level class",
    ),
    _source_has(
        f"{_G4}:Gemma4Model",
        "self.self_decoder = Gemma4SelfDecoderLayers(",
        "owns the lookup and projection in its self-decoder",
    ),
    _source_has(
        f"{_G4}:Gemma4Model.forward",
        "per_layer_embeds = self.get_per_layer_inputs(input_ids)",
        "looks the rows up before projecting",
    ),
    _signature(f"{_G4}:Gemma4SelfDecoderLayers.get_per_layer_inputs", "(self, input_ids)"),
    _source_has(
        f"{_G4}:Gemma4SelfDecoderLayers.get_per_layer_inputs",
        "per_layer_embeds = per_layer_embeds * self.embed_scale_per_layer",
        "scales the rows right after the lookup",
    ),
    _signature(
        f"{_G4}:Gemma4SelfDecoderLayers.project_per_layer_inputs",
        "(self, inputs_embeds, per_layer_inputs)",
    ),
    _source_has(
        f"{_G4}:Gemma4SelfDecoderLayers.project_per_layer_inputs",
        "return (per_layer_projection + per_layer_inputs) * self.per_layer_input_scale",
        "adds the rows to the normalised projection, then scales",
    ),
    _signature(
        f"{_G4M}:Gemma4ForConditionalGeneration.__init__", "(self, *, vllm_config, prefix='')"
    ),
    _source_has(
        f"{_G4M}:Gemma4ForConditionalGeneration.__init__",
        "self.per_layer_embeddings = torch.zeros(",
        "keeps the step's rows in a buffer",
    ),
    _signature(
        f"{_G4M}:Gemma4ForConditionalGeneration.embed_input_ids",
        "(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None)",
    ),
    _signature(
        f"{_G4M}:Gemma4ForConditionalGeneration.forward",
        "(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs)",
    ),
    _source_has(
        f"{_G4M}:Gemma4ForConditionalGeneration.forward",
        "self._clear_mm_prefix_for_full_attn_layers()",
        "clears the multimodal prefix ranges before the language model",
    ),
    _config_map_has("Gemma4ForCausalLM"),
    _config_map_has("Gemma4ForConditionalGeneration"),
    # Gemma 3n: the multimodal class builds the table through its language model's
    # self-decoder with a module-level name, looks the rows up eagerly into a buffer and
    # hands the forward's slice to the self-decoder, which adds it to the projection.
    _exists(f"{_G3N}:VocabParallelEmbedding", type),
    _source_has(
        f"{_G3N}:Gemma3nSelfDecoder",
        "self.embed_tokens_per_layer = VocabParallelEmbedding(",
        "builds the per-layer table with the module-level class",
    ),
    _source_has(
        f"{_G3N}:Gemma3nSelfDecoder",
        'prefix=f"{prefix}.per_layer_embed_tokens"',
        "names the per-layer table's module per_layer_embed_tokens",
    ),
    _signature(f"{_G3N}:Gemma3nSelfDecoder.get_per_layer_input_embeddings", "(self, input_ids)"),
    _source_has(
        f"{_G3N}:Gemma3nSelfDecoder.get_per_layer_input_embeddings",
        "* self.embed_scale_per_layer",
        "scales the rows right after the lookup",
    ),
    _signature(
        f"{_G3N}:Gemma3nSelfDecoder.get_per_layer_inputs",
        "(self, hidden_states_0, per_layer_inputs)",
    ),
    _source_has(
        f"{_G3N}:Gemma3nSelfDecoder.get_per_layer_inputs",
        "per_layer_inputs = per_layer_projection + per_layer_inputs",
        "adds the rows to the normalised projection",
    ),
    _source_has(
        f"{_G3N}:Gemma3nSelfDecoder.get_per_layer_inputs",
        "per_layer_inputs *= self.per_layer_input_scale",
        "then scales the sum",
    ),
    _signature(
        f"{_G3NM}:Gemma3nForConditionalGeneration.__init__", "(self, *, vllm_config, prefix='')"
    ),
    _source_has(
        f"{_G3NM}:Gemma3nForConditionalGeneration.__init__",
        'architectures=["Gemma3nForCausalLM"]',
        "builds its language model as vLLM's Gemma3nForCausalLM",
    ),
    _source_has(
        f"{_G3NM}:Gemma3nForConditionalGeneration.__init__",
        "self.per_layer_embeddings = torch.zeros(",
        "keeps the step's rows in a buffer",
    ),
    _signature(
        f"{_G3NM}:Gemma3nForConditionalGeneration.embed_input_ids",
        "(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None)",
    ),
    _signature(
        f"{_G3NM}:Gemma3nForConditionalGeneration.forward",
        "(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs)",
    ),
    _source_has(
        f"{_G3NM}:Gemma3nForConditionalGeneration.forward",
        "per_layer_inputs = self.per_layer_embeddings[:num_tokens]",
        "reads the step's rows from its buffer",
    ),
    _exists(f"{_MC}:VerifyAndUpdateConfig", type),
    # Load time: where the checkpoint is, and the per-file filter of unused weights.
    _signature(
        "vllm.model_executor.model_loader.default_loader:DefaultModelLoader._prepare_weights",
        "(self, model_name_or_path, subfolder, revision, fall_back_to_pt, "
        "allow_patterns_overrides)",
    ),
    _source_has(
        "vllm.model_executor.model_loader.default_loader:DefaultModelLoader",
        "is_unused_checkpoint_weight",
        "asks the model which checkpoint weights it does not use",
    ),
    _exists("vllm.model_executor.models:ModelRegistry.register_model"),
    _exists("vllm.forward_context:get_forward_context"),
)


@dataclass
class Report:
    """What :func:`report` found: the installed vLLM's version, whether it is a tested
    release, and every fact that does not hold there."""

    version: str
    tested: bool
    failing: list[str] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        """Every fact holds on a tested release."""
        return self.tested and not self.failing

    @property
    def untested_allowed(self) -> bool:
        """Every fact holds on an untested release, and :data:`UNTESTED_ENV` opts in."""
        return not self.tested and not self.failing and _opted_in()


def _opted_in() -> bool:
    value = os.environ.get(UNTESTED_ENV, "").strip()
    if value not in ("", "0", "1"):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"{UNTESTED_ENV} must be 1, 0 or empty, got {value!r}")
    return value == "1"


def report() -> Report:
    """Every fact checked against the installed vLLM (the facts of its release where it
    is a tested one)."""
    try:
        import vllm
    except ImportError as exc:
        return Report("none", False, [f"vLLM is not importable ({exc})"])
    version = str(getattr(vllm, "__version__", "unknown"))
    failing = []
    for req in REQUIREMENTS:
        why = req.check(version)
        if why is not None:
            failing.append(f"{req.what}: {why}")
    return Report(version, version in TESTED_VERSIONS, failing)


def check() -> tuple[str, list[str]]:
    """The installed vLLM's version and every reason the plugin would not start on it
    (empty when it can install)."""
    found = report()
    return found.version, problems(found)


def problems(found: Report) -> list[str]:
    """Every reason the plugin would not start on the release ``found`` describes."""
    problems = list(found.failing)
    if not found.tested and not found.untested_allowed:
        problems.insert(
            0,
            f"vLLM {found.version} is not a tested release (tested: "
            f"{', '.join(TESTED_VERSIONS)}); "
            + (
                f"every fact holds: set {UNTESTED_ENV}=1 to start on it"
                if not found.failing
                else "the facts below do not hold"
            ),
        )
    return problems


def require() -> str:
    """Raise :class:`~ple_memops.UnsupportedError` listing every difference unless the
    installed vLLM meets them all; returns its version. On an untested release that
    meets them, started only under :data:`UNTESTED_ENV`, with a warning."""
    version, problems = check()
    if problems:
        raise UnsupportedError(
            f"ple-memops cannot serve mmap PLE tables with the installed vLLM {version}; "
            "nothing was installed. What differs:\n  - "
            + "\n  - ".join(problems)
            + "\nInstall vllm=="
            + " or ".join(TESTED_VERSIONS)
            + ", or unset PLE_MEMOPS_TABLE_BACKEND."
        )
    if version not in TESTED_VERSIONS:
        logger.warning(
            "ple-memops: vLLM %s is not a tested release (tested: %s); starting because "
            "%s=1 and every one of the plugin's %d facts holds",
            version,
            ", ".join(TESTED_VERSIONS),
            UNTESTED_ENV,
            len(REQUIREMENTS),
        )
    return version
