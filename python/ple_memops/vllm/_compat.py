"""Every name of vLLM's the plugin relies on, checked against the installed vLLM before
anything is installed.

The plugin subclasses and wraps private parts of vLLM 0.33.0 (the Model Runner V2 runner,
its CUDA graph manager, the NVIDIA Qwen4Exp model and its PLE embedding, Gemma 4's text
and multimodal models, their config hooks, the default loader's file filter). A vLLM
whose names or signatures differ would run the plugin half-way, which is worse than not
at all: :func:`check` lists every difference and :func:`require` refuses to start with one
error naming the version and each of them. Signatures are compared by parameter names,
kinds and defaults (annotations vary with how a module was imported).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedError

__all__ = ["TESTED_VERSIONS", "Requirement", "check", "require"]

TESTED_VERSIONS = ("0.33.0",)


@dataclass(frozen=True)
class Requirement:
    """One fact about vLLM the plugin relies on: ``check`` returns ``None`` when it holds,
    else what differs."""

    what: str
    check: Callable[[], str | None]


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


def _signature(path: str, expected: str) -> Requirement:
    def check() -> str | None:
        try:
            got = _bare(_resolve(path))
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        except (TypeError, ValueError) as exc:  # pragma: no cover - not introspectable
            return f"no signature ({exc})"
        return None if got == expected else f"signature {got}, expected {expected}"

    return Requirement(f"{path}{expected}", check)


def _exists(path: str, kind: type | None = None) -> Requirement:
    def check() -> str | None:
        try:
            obj = _resolve(path)
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        if kind is not None and not isinstance(obj, kind):
            return f"is a {type(obj).__name__}, expected a {kind.__name__}"
        return None

    return Requirement(path, check)


def _source_has(path: str, needle: str, why: str) -> Requirement:
    def check() -> str | None:
        try:
            source = inspect.getsource(_resolve(path))
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        except (OSError, TypeError) as exc:  # pragma: no cover - no source shipped
            return f"source unavailable ({exc})"
        return None if needle in source else f"no longer contains {needle!r} ({why})"

    return Requirement(f"{path} {why}", check)


def _subclass(path: str, base: str) -> Requirement:
    def check() -> str | None:
        try:
            cls, parent = _resolve(path), _resolve(base)
        except (ImportError, AttributeError) as exc:
            return f"missing ({exc})"
        if not (isinstance(cls, type) and issubclass(cls, parent)):
            return f"is not a subclass of {base}"
        return None

    return Requirement(f"{path} subclasses {base}", check)


def _config_map_has(arch: str) -> Requirement:
    def check() -> str | None:
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
    # The runner: subclassed, and rebound where the worker imports it when it builds one.
    _signature(
        f"{_MR}:GPUModelRunner.load_model",
        "(self, load_dummy_weights=False, *args, model=None, **kwargs)",
    ),
    _signature(
        f"{_MR}:GPUModelRunner.initialize_kv_cache",
        "(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None)",
    ),
    _signature(f"{_MR}:GPUModelRunner.capture_model", "(self, *, profile_only=False)"),
    _signature(
        f"{_MR}:GPUModelRunner.execute_model",
        "(self, scheduler_output, intermediate_tensors=None, dummy_run=False, "
        "skip_attn_for_dummy_run=False, is_profile=False, context_len=0, "
        "valid_dummy_state_slots=False, randomize_inputs=False)",
    ),
    _signature(f"{_MR}:GPUModelRunner.shutdown", "(self)"),
    _source_has(
        "vllm.v1.worker.gpu_worker:Worker._make_model_runner",
        f"from {_MR} import",
        "imports the runner class when it builds one",
    ),
    _signature(f"{_MR}:GPUModelRunner.sample_tokens", "(self, grammar_output)"),
    _exists("vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output"),
    # expect_prefill: the new requests' tokens and each step's batch, on the host.
    _signature(f"{_MR}:GPUModelRunner.add_requests", "(self, scheduler_output)"),
    _signature(
        f"{_MR}:GPUModelRunner.prepare_inputs",
        "(self, scheduler_output, batch_req_state, batch_desc, num_active_loras)",
    ),
    _source_has(
        f"{_MR}:GPUModelRunner.add_requests",
        "all_token_ids=new_req_data.prefill_token_ids",
        "gives the request state each new request's prefill tokens",
    ),
    _source_has(
        f"{_MR}:BatchReqState",
        "num_computed_prefill_tokens_np",
        "holds each request's computed prefill tokens",
    ),
    _source_has(
        "vllm.models.qwen4_exp.nvidia.model_state",
        "context_end = req_states.num_computed_tokens.gpu[request_indices]",
        "builds the n-gram context from the tokens before the chunk",
    ),
    _source_has(
        f"{_MR}:GPUModelRunner.initialize_kv_cache",
        "self.cudagraph_manager = ModelCudaGraphManager(",
        "builds the CUDA graph manager",
    ),
    # The CUDA graph manager: its capture loop, FULL replays and release.
    _signature(
        f"{_CG}:CudaGraphManager.capture",
        "(self, create_forward_fn, progress_bar_desc='Capturing CUDA graphs')",
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


def check() -> tuple[str, list[str]]:
    """The installed vLLM's version and every requirement it does not meet (empty when
    the plugin can install)."""
    try:
        import vllm
    except ImportError as exc:
        return "none", [f"vLLM is not importable ({exc})"]
    version = str(getattr(vllm, "__version__", "unknown"))
    problems = []
    if version not in TESTED_VERSIONS:
        problems.append(
            f"vLLM {version} is not a tested version (tested: {', '.join(TESTED_VERSIONS)})"
        )
        return version, problems
    for req in REQUIREMENTS:
        why = req.check()
        if why is not None:
            problems.append(f"{req.what}: {why}")
    return version, problems


def require() -> str:
    """Raise :class:`~ple_memops.UnsupportedError` listing every difference unless the
    installed vLLM meets them all; returns its version."""
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
    return version
