"""Offline API: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
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
        self.engine = LLMEngine(EngineConfig.from_kwargs(model or "default", **engine_args))
        self._request_counter = 0

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallel); also on ``with LLM(...)``
        exit, garbage collection and interpreter exit."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt is a string or a list of token
        ids; one SamplingParams applies to all, or give one per prompt."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        request_ids = self._add_all(prompt_list, params_list)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    **(chat_template_kwargs or {}),
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        request_ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"offline-{self._request_counter}"
                self._request_counter += 1
                try:
                    # generate() returns finished outputs only; the caller's params stay
                    # as they are.
                    p = (p or SamplingParams()).clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                    self.engine.add_request(request_id, prompt, p)
                except ValueError as err:
                    raise ValueError(f"prompt {len(request_ids)}: {err}") from None
                request_ids.append(request_id)
        except ValueError:
            self.engine.abort_request(request_ids)  # all or nothing
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            self.engine.abort_request(list(self.engine.requests))
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
