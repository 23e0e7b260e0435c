"""Request bodies of the server's routes, as pydantic models.

They follow `llama_cpp.server.types` 0.3.36 field for field (names, defaults, bounds), so
a request that upstream accepts is accepted here and one it rejects is rejected. Fields
of the OpenAI API that neither server uses are ignored, as pydantic ignores unknown keys.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

model_field = Field(description="The model to use for generating completions.", default=None)

min_tokens_field = Field(
    default=0,
    ge=0,
    description="The minimum number of tokens to generate. It may return fewer tokens if another condition is met (e.g. max_tokens, stop).",
)
temperature_field = Field(
    default=0.8,
    description="Adjust the randomness of the generated text. 0: always pick the most likely token.",
)
top_p_field = Field(
    default=0.95,
    ge=0.0,
    le=1.0,
    description="Sample from the smallest set of tokens whose cumulative probability exceeds top_p.",
)
min_p_field = Field(
    default=0.05,
    ge=0.0,
    le=1.0,
    description="Drop tokens whose probability is below min_p times that of the most likely token.",
)
stop_field = Field(
    default=None,
    description="A list of tokens at which to stop generation. If None, no stop tokens are used.",
)
stream_field = Field(
    default=False,
    description="Whether to stream the results as they are generated (server-sent events).",
)
top_k_field = Field(default=40, ge=0, description="Sample from the K most probable tokens.")
repeat_penalty_field = Field(
    default=1.1, ge=0.0, description="A penalty applied to each token that is already generated."
)
presence_penalty_field = Field(
    default=0.0,
    ge=-2.0,
    le=2.0,
    description="Positive values penalize tokens that already appear in the text so far.",
)
frequency_penalty_field = Field(
    default=0.0,
    ge=-2.0,
    le=2.0,
    description="Positive values penalize tokens by how often they appear in the text so far.",
)
mirostat_mode_field = Field(
    default=0, ge=0, le=2, description="Mirostat version (1 or 2; 0 = disabled)."
)
mirostat_tau_field = Field(default=5.0, ge=0.0, le=10.0, description="Mirostat target entropy.")
mirostat_eta_field = Field(default=0.1, ge=0.001, le=1.0, description="Mirostat learning rate.")
n_field = Field(
    default=1,
    ge=1,
    le=1,
    description="Number of choices to generate; only 1 is supported (llama_cpp.server ignores other values).",
)


class CreateCompletionRequest(BaseModel):
    model: Optional[str] = model_field
    # Token-id prompts are an addition to llama_cpp.server, which takes only strings.
    prompt: Union[str, List[str], List[int]] = Field(
        default="", description="The prompt to generate completions for."
    )
    suffix: Optional[str] = Field(
        default=None, description="A suffix to append to the generated text (infill)."
    )
    max_tokens: Optional[int] = Field(
        default=16, ge=0, description="The maximum number of tokens to generate."
    )
    min_tokens: int = min_tokens_field
    temperature: float = temperature_field
    top_p: float = top_p_field
    min_p: float = min_p_field
    echo: bool = Field(default=False, description="Whether to echo the prompt in the generated text.")
    stop: Optional[Union[str, List[str]]] = stop_field
    stream: bool = stream_field
    logprobs: Optional[int] = Field(
        default=None, ge=0, description="The number of logprobs to generate. If None, none."
    )
    presence_penalty: Optional[float] = presence_penalty_field
    frequency_penalty: Optional[float] = frequency_penalty_field
    logit_bias: Optional[Dict[str, float]] = Field(None)
    seed: Optional[int] = Field(None)

    # ignored or currently unsupported
    n: Optional[int] = n_field
    best_of: Optional[int] = 1
    user: Optional[str] = Field(default=None)

    # llama.cpp specific parameters
    top_k: int = top_k_field
    repeat_penalty: float = repeat_penalty_field
    logit_bias_type: Optional[Literal["input_ids", "tokens"]] = Field(None)
    mirostat_mode: int = mirostat_mode_field
    mirostat_tau: float = mirostat_tau_field
    mirostat_eta: float = mirostat_eta_field
    grammar: Optional[str] = None

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "prompt": "\n\n### Instructions:\nWhat is the capital of France?\n\n### Response:\n",
                    "stop": ["\n", "###"],
                }
            ]
        }
    }


class CreateEmbeddingRequest(BaseModel):
    model: Optional[str] = model_field
    input: Union[str, List[str]] = Field(description="The input to embed.")
    # OpenAI's field; the official client asks for base64 unless told otherwise.
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="float: lists of numbers; base64: little-endian float32."
    )
    user: Optional[str] = Field(default=None)

    model_config = {
        "json_schema_extra": {"examples": [{"input": "The food was delicious and the waiter..."}]}
    }


class ChatCompletionRequestMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_calls, tool_call_id, ...)
    are passed on to the chat handler as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="The role of the message author."
    )
    content: Optional[Union[str, List[Dict[str, Any]]]] = Field(
        default=None, description="The content of the message."
    )


class ChatCompletionResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    json_schema: Optional[Dict[str, Any]] = None


class CreateChatCompletionRequest(BaseModel):
    model: Optional[str] = model_field
    messages: List[ChatCompletionRequestMessage] = Field(
        default=[], description="A list of messages to generate completions for."
    )
    functions: Optional[List[Dict[str, Any]]] = Field(
        default=None, description="A list of functions to apply to the generated completions."
    )
    function_call: Optional[Union[str, Dict[str, Any]]] = Field(
        default=None, description="A function to apply to the generated completions."
    )
    tools: Optional[List[Dict[str, Any]]] = Field(
        default=None, description="A list of tools to apply to the generated completions."
    )
    tool_choice: Optional[Union[str, Dict[str, Any]]] = Field(
        default=None, description="A tool to apply to the generated completions."
    )
    max_tokens: Optional[int] = Field(
        default=None, ge=0, description="The maximum number of tokens to generate. Defaults to inf"
    )
    # OpenAI's newer name for max_tokens; used when max_tokens is not given.
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    min_tokens: int = min_tokens_field
    logprobs: Optional[bool] = Field(default=False, description="Whether to output the logprobs or not.")
    top_logprobs: Optional[int] = Field(
        default=None, ge=0, description="The number of logprobs to generate (needs logprobs=true)."
    )
    temperature: float = temperature_field
    top_p: float = top_p_field
    min_p: float = min_p_field
    stop: Optional[Union[str, List[str]]] = stop_field
    stream: bool = stream_field
    presence_penalty: Optional[float] = presence_penalty_field
    frequency_penalty: Optional[float] = frequency_penalty_field
    logit_bias: Optional[Dict[str, float]] = Field(None)
    seed: Optional[int] = Field(None)
    response_format: Optional[ChatCompletionResponseFormat] = Field(default=None)

    # ignored or currently unsupported
    n: Optional[int] = n_field
    user: Optional[str] = Field(None)

    # llama.cpp specific parameters
    top_k: int = top_k_field
    repeat_penalty: float = repeat_penalty_field
    logit_bias_type: Optional[Literal["input_ids", "tokens"]] = Field(None)
    mirostat_mode: int = mirostat_mode_field
    mirostat_tau: float = mirostat_tau_field
    mirostat_eta: float = mirostat_eta_field
    grammar: Optional[str] = None

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "messages": [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is the capital of France?"},
                    ]
                }
            ]
        }
    }


class TokenizeInputRequest(BaseModel):
    model: Optional[str] = model_field
    input: str = Field(description="The input to tokenize.")


class TokenizeInputResponse(BaseModel):
    tokens: List[int] = Field(description="A list of tokens.")


class TokenizeInputCountResponse(BaseModel):
    count: int = Field(description="The number of tokens in the input.")


class DetokenizeInputRequest(BaseModel):
    model: Optional[str] = model_field
    tokens: List[int] = Field(description="A list of tokens to detokenize.")


class DetokenizeInputResponse(BaseModel):
    text: str = Field(description="The detokenized text.")
