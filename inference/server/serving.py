"""What completions and chat completions share: model check, prompt preparation, limits,
SamplingParams, running a request against the async engine, logprob and usage shapes.

Prompts are tokenized here rather than in the engine so that the length limits are checked
(and a 400 naming them returned) before anything is queued, and so that usage counts are
known without waiting for the engine. Tokenizing (and rendering a chat template) costs time
in proportion to the body: a 10 MB prompt takes seconds. Bodies above ``INLINE_BODY_BYTES``
are therefore prepared in a small thread pool (the tokenizer releases the GIL while it
works), so one large request never stalls the event loop, other streams or ``/health``; the
pool's size bounds how many such requests tokenize at once, the rest wait their turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from starlette.requests import Request

from inference.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestAbortedError,
)
from inference.lora.request import LoRARequest
from inference.outputs import Logprob, OutputAccumulator, RequestOutput
from inference.sampling_params import SamplingParams, StructuredOutputsParams
from inference.server.errors import APIError
from inference.server.lora_modules import ServedAdapters
from inference.server.protocol import _SamplingFields
from inference.server.structured import requested_structured_outputs

T = TypeVar("T")
logger = logging.getLogger("inference.server.requests")

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this value.
MIN_LOGPROB = -9999.0
RETRY_AFTER_S = 1
# Bodies up to this size are tokenized on the event loop: a thread hop would cost more.
INLINE_BODY_BYTES = 16 * 1024
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, beyond the model's own limits."""

    # prompts x n: each is a sequence the engine runs (1,000 prompts x n=8 would hold it
    # for minutes while every other client waits).
    max_sequences_per_request: int = 1024


@dataclass(frozen=True)
class ServingOptions:
    """How requests are rendered and logged (vLLM's flags of the same names)."""

    response_role: str = "assistant"  # --response-role: the role of the reply
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # --max-log-len: prompt characters and ids logged
    chat_template: str | None = None  # --chat-template, resolved to its text
    chat_template_content_format: str = "auto"  # string | openai | auto
    reasoning_parser: str | None = None  # --reasoning-parser


# The name the CLI and README use for whatever model is served: accepted in "model".
DEFAULT_MODEL_ALIAS = "default"


class TokenizerPool:
    """Runs request preparation (chat template, tokenizer) off the event loop for large
    bodies; at most ``num_threads`` at a time."""

    def __init__(self, num_threads: int = TOKENIZER_THREADS) -> None:
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")

    async def run(self, raw: Request, fn: Callable[..., T], *args: Any) -> T:
        length = raw.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) <= INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class PreparedPrompt:
    text: str | None  # the prompt as text, for echo; None if the client sent token ids
    token_ids: list[int]
    warnings: list[str] = field(default_factory=list)  # for the response's Warning header


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        *,
        limits: RequestLimits | None = None,
        tokenizer_pool: TokenizerPool | None = None,
        options: ServingOptions | None = None,
        adapters: ServedAdapters | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.adapters = adapters or ServedAdapters(served_model_names)
        self.limits = limits or RequestLimits()
        self.tokenizer_pool = tokenizer_pool or TokenizerPool()
        self.options = options or ServingOptions()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        try:
            return self.engine.tokenizer
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc)) from exc

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.max_model_len)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a model this
        server does not serve."""
        if model == DEFAULT_MODEL_ALIAS:
            return None
        lora = self.adapters.get(model)
        if lora is not None:
            return lora
        if model and model not in self.served_model_names:
            served = [*self.served_model_names, *self.adapters.adapters]
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(served)}.",
                param="model",
                code="model_not_found",
            )

    def check_ready(self) -> None:
        if not self.engine.ready:
            raise APIError(
                503,
                "the model is not ready (loading, warming up or draining)",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def check_batch(self, num_prompts: int, n: int) -> None:
        """A request's size against the server's limits, before anything is tokenized."""
        limits = self.limits
        max_queue_len = self.engine.max_queue_len
        if num_prompts * n > limits.max_sequences_per_request:
            raise APIError(
                400,
                f"the request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                f"sequences; this server takes at most {limits.max_sequences_per_request} per "
                "request (--max-sequences-per-request): split it into smaller requests",
                param="prompt" if num_prompts > 1 else "n",
            )
        # Each prompt is one engine request: a batch longer than the queue never fits.
        if max_queue_len is not None and num_prompts > max_queue_len:
            raise APIError(
                400,
                f"the request holds {num_prompts} prompts, more than the server's queue "
                f"(--max-queue-len {max_queue_len}) can ever hold: split it",
                param="prompt",
            )

    # ----- prompts and limits -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.vocab_size
        bad = [t for t in token_ids if t >= vocab_size]
        if bad:
            raise APIError(
                400, f"{param} has token ids outside [0, {vocab_size}): {bad[:5]}", param=param
            )

    @property
    def vocab_size(self) -> int:
        try:
            info = self.engine.engine
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc)) from exc
        return int(info.vocab_size or len(info.tokenizer))

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation config (--generation-config)."""
        try:
            return self.engine.engine.generation_defaults
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc)) from exc

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for output.",
                param="prompt",
                code="context_length_exceeded",
            )
        # The generation config's max_new_tokens caps every request, as in vLLM.
        default = self.generation_defaults.get("max_tokens")
        if max_tokens is None:
            room = limit - num_prompt_tokens
            return room if default is None else min(room, default)
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for max_tokens). Please reduce the prompt or "
                "max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens if default is None else min(max_tokens, default)

    def logit_bias(self, req: _SamplingFields) -> dict[int, float] | None:
        if not req.logit_bias:
            return None
        bias = {int(token_id): value for token_id, value in req.logit_bias.items()}
        self.check_token_ids(list(bias), "logit_bias")
        return bias

    def sampling_params(
        self,
        req: _SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; ``structured``: a constraint of the caller's
        (tool calls) instead of the request's structured-output fields."""
        if req.n > self.engine.config.max_num_seqs:
            raise APIError(
                400,
                f"n={req.n} exceeds max_num_seqs={self.engine.config.max_num_seqs}",
                param="n",
            )
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if structured is None:
            structured = requested_structured_outputs(req)
        self.check_logprobs(logprobs)
        sampling = self.sampling_defaults(req)
        top_k = sampling["top_k"]
        if top_k >= self.vocab_size:
            top_k = 0  # keeping every token is the same as no top-k
        try:
            return SamplingParams(
                n=req.n,
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=top_k,
                min_p=sampling["min_p"],
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=sampling["repetition_penalty"],
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=self.logit_bias(req),
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def sampling_defaults(self, req: _SamplingFields) -> dict[str, Any]:
        """The request's sampling values; those it leaves out come from the generation
        config's defaults, else the engine's (as vLLM)."""
        defaults = self.generation_defaults
        values = {}
        for name, fallback in _SAMPLING_FALLBACKS.items():
            given = getattr(req, name)
            values[name] = given if given is not None else defaults.get(name, fallback)
        values["top_k"] = values["top_k"] or 0
        return values

    def check_logprobs(self, logprobs: int | None) -> None:
        limit = int(self.engine.config.max_logprobs)
        if logprobs is not None and 0 <= limit < logprobs:
            param = self.logprobs_param
            raise APIError(
                400,
                f"{param}={logprobs} exceeds this server's limit of {limit} (--max-logprobs)",
                param=param,
            )

    logprobs_param = "logprobs"  # the request field that asks for logprobs

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        """A logprob entry's token: its text, or ``token_id:N`` with
        --return-tokens-as-token-ids (as vLLM, for tokens that are not valid UTF-8 alone)."""
        if self.options.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return token_text(self.tokenizer, token_id, logprob)

    # ----- running requests -------------------------------------------------------------

    def new_request_id(self, prefix: str, raw: Request) -> str:
        """``prefix-<X-Request-Id>``: the client's id when it sent one (the middleware
        sets a fresh one otherwise), as vLLM does."""
        return f"{prefix}-{raw.state.request_id}"

    def generate(
        self, prompts: list[PreparedPrompt], params: SamplingParams, request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Per-step deltas of all prompts as ``(prompt_index, output)``, interleaved as
        produced: each output holds only what is new (``AsyncLLMEngine.generate(delta=True)``)."""
        arrival = time.time()
        if self.options.log_requests:
            self.log_request(request_id, prompts, params)
        generate = self.engine.generate
        if lora_request is not None:
            generate = partial(generate, lora_request=lora_request)
        if len(prompts) == 1:
            return _tag(generate(prompts[0].token_ids, params, request_id, arrival, delta=True))
        streams = [
            generate(p.token_ids, params, f"{request_id}-{i}", arrival, delta=True)
            for i, p in enumerate(prompts)
        ]
        return _merge(streams)

    def log_request(
        self, request_id: str, prompts: list[PreparedPrompt], params: SamplingParams
    ) -> None:
        """One line per request (--enable-log-requests): its prompt text and token ids,
        each cut to --max-log-len, and its sampling parameters."""
        limit = self.options.max_log_len
        for i, prompt in enumerate(prompts):
            text, ids = prompt.text, prompt.token_ids
            if limit is not None:
                text = text[:limit] if text is not None else None
                ids = ids[:limit]
            suffix = f"-{i}" if len(prompts) > 1 else ""
            logger.info(
                "received request %s%s: prompt: %r, prompt_token_ids: %s, params: %s",
                request_id, suffix, text, ids, params,
            )

    async def first_output(
        self, raw: Request, stream: AsyncIterator[tuple[int, RequestOutput]]
    ) -> tuple[int, RequestOutput]:
        """Wait for the first output, so that admission errors (queue full, bad prompt)
        become a proper HTTP status instead of an error inside a started stream."""
        try:
            return await until_disconnected(raw, anext(stream))
        except StopAsyncIteration as exc:
            raise APIError(500, "the request produced no output") from exc
        except BaseException:
            await stream.aclose()
            raise


# What a request's sampling field is when neither it nor the generation config sets it.
_SAMPLING_FALLBACKS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}  # fmt: skip

async def _tag(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for output in stream:
            yield 0, output
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(raw: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it (which aborts its
    engine requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def engine_error(exc: BaseException) -> APIError | None:
    """The API error for an exception raised by the async engine, or None if unexpected."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestAbortedError):
        return APIError(503, str(exc) or "the request was aborted")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return None


async def collect(
    first: tuple[int, RequestOutput], stream: AsyncIterator[tuple[int, RequestOutput]]
) -> dict[int, RequestOutput]:
    """Every prompt's cumulative final output, from the per-step deltas."""
    accumulators: dict[int, OutputAccumulator] = {}

    def add(index: int, delta: RequestOutput) -> None:
        accumulator = accumulators.get(index)
        if accumulator is None:
            accumulator = accumulators[index] = OutputAccumulator(delta.request_id)
        accumulator.add(delta)

    add(*first)
    async for index, delta in stream:
        add(index, delta)
    return {index: accumulator.output() for index, accumulator in accumulators.items()}


def usage(prompts: list[PreparedPrompt], outputs: dict[int, RequestOutput]) -> dict[str, int]:
    completion_tokens = sum(len(c.token_ids) for output in outputs.values() for c in output.outputs)
    return usage_counts(prompts, completion_tokens)


def usage_counts(prompts: list[PreparedPrompt], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def token_text(tokenizer: Any, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def top_logprobs(entry: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    """The ``limit`` most likely tokens of one position, best first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return ranked[:limit]
