"""Offline API: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import gc
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch
from tqdm.auto import tqdm

from inference.chat_templates import default_chat_template
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
from inference.lora.request import LoRARequest
from inference.outputs import RequestOutput
from inference.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int]


class LLM:
    """Run a model over a batch of prompts with continuous batching.

    ``model`` is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or
    ``None``/``"default"`` for the embedded SmolLM2-135M-Instruct. Engine arguments use
    vLLM's names: tensor_parallel_size, gpu_memory_utilization, max_num_seqs,
    max_num_batched_tokens, block_size, max_model_len, enable_prefix_caching,
    enforce_eager, dtype, seed, device, num_kv_blocks.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine: LLMEngine | None = LLMEngine(
            EngineConfig.from_kwargs(model or "default", **engine_args)
        )
        self._request_counter = 0

    def shutdown(self) -> None:
        """Release the engine: its worker processes (tensor parallel), weights, KV cache
        and CUDA graphs, so that another ``LLM`` can use the memory; later calls raise
        RuntimeError. Also on ``with LLM(...)`` exit; safe to call more than once. An LLM
        that is garbage collected only lets go of its engine, which releases itself once
        nothing else holds it."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        self.engine = None
        engine.shutdown()
        del engine
        gc.collect()  # the runner and its graphs refer to each other
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @property
    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down; create a new LLM(...) to run more")
        return self.engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Only this LLM's reference goes: code may still hold ``llm.engine`` (the engine
        # releases itself once nothing does). ``shutdown()`` is the explicit release.
        self.engine = None

    def get_tokenizer(self):
        return self._engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a ``generate`` call that gives none: the model's
        generation-config defaults (``generation_config``), as vLLM."""
        return SamplingParams(**self._engine.generation_defaults)

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt is a string or a list of token
        ids; one SamplingParams applies to all, or give one per prompt. ``lora_request``:
        the LoRA adapter every prompt runs with, or one per prompt (None: the base model;
        the engine needs ``enable_lora=True``)."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(lora_list)} LoRA requests for {len(prompt_list)} prompts")
        request_ids = self._add_all(prompt_list, params_list, lora_list)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, else the embedded model's
        tool-capable one, else the tokenizer's) to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self._engine
        tokenizer = engine.tokenizer
        template = chat_template or default_chat_template(engine.model_path)
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        extra = dict(chat_template_kwargs or {})
        if template is not None:
            extra["chat_template"] = template
        if tools:
            extra["tools"] = tools
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    **extra,
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_all(
        self, prompts: list[PromptType], params: list[SamplingParams],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        request_ids: list[str] = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                request_id = f"offline-{self._request_counter}"
                self._request_counter += 1
                try:
                    # generate() returns finished outputs only; the caller's params stay
                    # as they are.
                    p = (p or SamplingParams()).clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                    self._engine.add_request(request_id, prompt, p, lora_request=lora)
                except ValueError as err:
                    raise ValueError(f"prompt {len(request_ids)}: {err}") from None
                request_ids.append(request_id)
        except ValueError:
            self._engine.abort_request(request_ids)  # all or nothing
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            engine.abort_request(list(engine.requests))
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]


def _normalize_prompts(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (
            isinstance(p, list) and all(isinstance(t, int) for t in p)
        ):
            raise ValueError(f"prompt {i} must be a string or a list of token ids")
    return prompts
