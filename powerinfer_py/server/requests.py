"""A request's body -> the keyword arguments of Llama.create_completion or
create_chat_completion: what llama_cpp.server's prepare_request_resources does (logit bias,
grammar, min_tokens), the cancel hook, and the request shapes this server adds or refuses."""

from __future__ import annotations

import json
import threading
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

import anyio
from fastapi import Request
from pydantic import BaseModel

from .._core import CancelCheck
from .errors import APIError
from .types import SPECULATIVE_FIELDS, CreateChatCompletionRequest, CreateCompletionRequest

__all__ = ["GenerationCancelled", "prepare_kwargs", "completion_kwargs", "chat_kwargs", "draft_overrides",
           "run_until_disconnect"]


def prepare_kwargs(
    llama: Any,
    body: Union[CreateCompletionRequest, CreateChatCompletionRequest],
    kwargs: Dict[str, Any],
    cancelled: Optional[threading.Event] = None,
) -> None:
    """What llama_cpp.server's prepare_request_resources does: logit bias, grammar, min_tokens;
    and, given `cancelled`, a logits processor that stops the generation once it is set."""
    if isinstance(body, CreateCompletionRequest):
        _empty_prompt_as_bos(llama, kwargs)
    if body.logit_bias is not None:
        if body.logit_bias_type == "tokens":
            to_bias: Dict[str, float] = {}
            for token, score in body.logit_bias.items():
                for input_id in llama.tokenize(token.encode("utf-8"), add_bos=False, special=True):
                    to_bias[str(input_id)] = score
            kwargs["logit_bias"] = to_bias
        else:
            for key in body.logit_bias:
                if not key.lstrip("-").isdigit():
                    raise APIError(
                        400,
                        f"logit_bias keys must be token ids (got {key!r}); "
                        'use "logit_bias_type": "tokens" to bias by text',
                        param="logit_bias",
                    )
            kwargs["logit_bias"] = body.logit_bias
    if body.grammar is not None:
        from ..llama_grammar import LlamaGrammar

        kwargs["grammar"] = LlamaGrammar.from_string(body.grammar)
    elif isinstance(body, CreateChatCompletionRequest):
        grammar = _json_schema_grammar(body)
        if grammar is not None:
            kwargs["grammar"] = grammar
    processors: List[Callable[..., Any]] = []
    if body.min_tokens > 0:
        from ..llama import MinTokensLogitsProcessor

        processors.append(MinTokensLogitsProcessor(body.min_tokens, llama.token_eos()))
    if cancelled is not None:
        # Ends the generation at its next token once set: the one hook into the token loop
        # that create_completion and create_chat_completion both take (a slot's generation
        # sampled in the core runs it before handing over each token).
        processors.append(CancelCheck(cancelled, GenerationCancelled))
    if processors:
        from .. import LogitsProcessorList

        kwargs["logits_processor"] = LogitsProcessorList(processors)


def _empty_prompt_as_bos(llama: Any, kwargs: Dict[str, Any]) -> None:
    """An empty text prompt with logprobs becomes the prompt [BOS], which is what the model
    reads for "" anyway: Llama's own empty-prompt path puts that BOS among the completion's
    tokens, which misaligns the logprobs (and fails in a stream past its first token)."""
    if kwargs.get("prompt") != "" or kwargs.get("logprobs") is None or kwargs.get("suffix") is not None:
        return
    bos = llama.token_bos()
    if bos >= 0:
        kwargs["prompt"] = [bos]


def _json_schema_grammar(body: CreateChatCompletionRequest) -> Any:
    """The grammar of response_format {"type": "json_schema", ...}, made here so that a
    schema the converter cannot handle is the client's 400 (the converter fails on many
    shapes with TypeError, AttributeError, KeyError, ...); None for other formats."""
    response_format = body.response_format
    if response_format is None or response_format.type != "json_schema":
        return None
    from ..llama_grammar import JSON_GBNF, LlamaGrammar

    spec = response_format.json_schema
    schema = spec.schema_ if spec is not None else None
    if schema is None:
        return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    try:
        return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    except Exception as exc:
        raise APIError(
            400,
            f"response_format.json_schema.schema is not a JSON schema this server can follow: "
            f"{type(exc).__name__}: {exc}",
            param="response_format",
            code="invalid_value",
        ) from None


class GenerationCancelled(Exception):
    """Raised inside the model's sampling loop to stop a generation nobody waits for."""


async def run_until_disconnect(request: Request, cancelled: threading.Event,
                               run: Callable[[Callable[[], Any]], Awaitable[Any]], fn: Callable[[], Any]) -> Any:
    """await run(fn) (ServerState.run_generation), with `cancelled` set if the client
    disconnects meanwhile: the generation's CancelCheck then stops it at its next prompt slice
    or token."""
    error: Optional[Exception] = None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_set_on_disconnect, request, cancelled)
        try:
            result = await run(fn)
        except Exception as exc:  # raised below, not as an ExceptionGroup of the task group
            error = exc
        tasks.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def _set_on_disconnect(request: Request, event: threading.Event) -> None:
    """Set `event` when the client disconnects (the body is read: what the server
    receives next is the disconnect); cancelled when the response is ready first."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            event.set()
            return


def _null_penalties_as_default(kwargs: Dict[str, Any]) -> None:
    # The schema allows null (OpenAI's "use the default"); Llama wants a number.
    for name in ("presence_penalty", "frequency_penalty"):
        if kwargs.get(name) is None:
            kwargs[name] = 0.0


def completion_kwargs(body: CreateCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(exclude={"n", "best_of", "logit_bias_type", "user", "min_tokens", *SPECULATIVE_FIELDS})
    _null_penalties_as_default(kwargs)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) > 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        kwargs["prompt"] = prompt[0]
    elif isinstance(prompt, list) and not prompt:
        kwargs["prompt"] = ""
    if body.echo:
        if isinstance(kwargs["prompt"], list):
            # Token-id prompts are this server's addition; Llama echoes only text.
            raise APIError(400, "echo needs a text prompt, not token ids", param="echo")
        if kwargs["prompt"] == "":
            # Nothing to echo; Llama's echo path fails on an empty prompt with logprobs.
            kwargs["echo"] = False
    return kwargs


_TOOL_FIELDS = ("functions", "function_call", "tools", "tool_choice")


def chat_kwargs(body: CreateChatCompletionRequest) -> Dict[str, Any]:
    kwargs = body.model_dump(
        exclude={"n", "logit_bias_type", "user", "min_tokens", "max_completion_tokens", "response_format", *_TOOL_FIELDS,
                 *SPECULATIVE_FIELDS}
    )
    for name in _TOOL_FIELDS:  # as sent, without the nulls of optional keys left out
        value = getattr(body, name)
        if isinstance(value, list):
            kwargs[name] = [item.model_dump(exclude_none=True) for item in value]
        elif isinstance(value, BaseModel):
            kwargs[name] = value.model_dump(exclude_none=True)
        else:
            kwargs[name] = value
    _null_penalties_as_default(kwargs)
    if body.max_tokens is None and body.max_completion_tokens is not None:
        kwargs["max_tokens"] = body.max_completion_tokens
    kwargs["response_format"] = (
        body.response_format.model_dump(by_alias=True, exclude_none=True)
        if body.response_format is not None
        else None
    )
    return kwargs




def draft_overrides(body: Union[CreateCompletionRequest, CreateChatCompletionRequest]) -> Dict[str, Any]:
    """The request's speculative.n_max / n_min / p_min (llama.cpp server's names), as Llama's
    draft_max / draft_min / draft_p_min; 400 when they contradict each other. Each value's
    range is the schema's (400 too)."""
    out = {name: value for name, value in (("draft_max", body.speculative_n_max), ("draft_min", body.speculative_n_min),
                                           ("draft_p_min", body.speculative_p_min)) if value is not None}
    if "draft_max" in out and "draft_min" in out and out["draft_min"] > out["draft_max"]:
        raise APIError(400, f"speculative.n_min ({out['draft_min']}) must not exceed speculative.n_max "
                            f"({out['draft_max']})", param="speculative.n_min")
    return out
