"""Request bodies of the server's routes, as pydantic models.

They follow `llama_cpp.server.types` 0.3.36 field for field (names, defaults, bounds), so
a request that upstream accepts is accepted here and one it rejects is rejected. Fields
of the OpenAI API that neither server uses are ignored, as pydantic ignores unknown keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

# Counts and token ids reach the C core as 32-bit ints: larger values are rejected here
# (400) instead of overflowing on the way (llama_cpp.server answers those with a 500).
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Alternatives listed per generated token: OpenAI allows at most 5 (completions) and 20
# (chat). Unbounded (llama_cpp.server), up to the whole vocabulary is detokenized at every
# position, ~0.2 s per token for SmolLM2's 49152 and after the generation, where a
# client's disconnect cannot stop it: a request that holds the model for minutes.
MAX_LOGPROBS = 20

model_field = Field(description="The model to use for generating completions.", default=None)

# Speculative decoding per request, under llama.cpp server's names (a server without a draft
# ignores them, as llama.cpp's does).
speculative_n_max_field = Field(default=None, ge=1, le=INT32_MAX, alias="speculative.n_max",
                                description="Tokens drafted per step (the server's --draft_max by default).")
speculative_n_min_field = Field(default=None, ge=0, le=INT32_MAX, alias="speculative.n_min",
                                description="Fewer drafted tokens are not checked (--draft_min by default).")
speculative_p_min_field = Field(default=None, ge=0.0, le=1.0, alias="speculative.p_min",
                                description="A draft model stops below this probability (--draft_p_min by default).")
# The fields above, which are not Llama arguments.
SPECULATIVE_FIELDS = {"speculative_n_max", "speculative_n_min", "speculative_p_min"}

min_tokens_field = Field(
    default=0,
    ge=0,
    le=INT32_MAX,
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
top_k_field = Field(default=40, ge=0, le=INT32_MAX, description="Sample from the K most probable tokens.")
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
    prompt: Union[str, List[str], List[TokenId]] = Field(
        default="", description="The prompt to generate completions for."
    )
    suffix: Optional[str] = Field(
        default=None, description="A suffix to append to the generated text (infill)."
    )
    max_tokens: Optional[int] = Field(
        default=16,
        ge=0,
        le=INT32_MAX,
        description="The maximum number of tokens to generate; 0 or null: until the context is full.",
    )
    min_tokens: int = min_tokens_field
    temperature: float = temperature_field
    top_p: float = top_p_field
    min_p: float = min_p_field
    echo: bool = Field(default=False, description="Whether to echo the prompt in the generated text.")
    stop: Optional[Union[str, List[str]]] = stop_field
    stream: bool = stream_field
    logprobs: Optional[int] = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="The number of logprobs to generate. If None, none."
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
    speculative_n_max: Optional[int] = speculative_n_max_field
    speculative_n_min: Optional[int] = speculative_n_min_field
    speculative_p_min: Optional[float] = speculative_p_min_field

    model_config = {
        "populate_by_name": True,
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


class ChatCompletionJSONSchema(BaseModel):
    """OpenAI's response_format.json_schema: the schema the reply must follow, and its name."""

    model_config = ConfigDict(extra="allow")

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ChatCompletionResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    json_schema: Optional[ChatCompletionJSONSchema] = None


# Tools and functions: the shapes the chat handlers read (llama_cpp.server's TypedDicts),
# so a malformed one is a 400 here, not a KeyError in the handler. Other keys pass through.


class ChatCompletionFunction(BaseModel):
    """A function the model may call: a tool's `function`, or an entry of legacy `functions`."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: Optional[str] = None
    # OpenAI makes it optional; llama_cpp.server requires it. Absent: no arguments.
    parameters: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: ChatCompletionFunction


class ChatCompletionFunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str


class ChatCompletionNamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: ChatCompletionFunctionName


class CreateChatCompletionRequest(BaseModel):
    model: Optional[str] = model_field
    messages: List[ChatCompletionRequestMessage] = Field(
        default=[], description="A list of messages to generate completions for."
    )
    functions: Optional[List[ChatCompletionFunction]] = Field(
        default=None, description="A list of functions to apply to the generated completions."
    )
    function_call: Optional[Union[Literal["none", "auto"], ChatCompletionFunctionName]] = Field(
        default=None, description="A function to apply to the generated completions."
    )
    tools: Optional[List[ChatCompletionTool]] = Field(
        default=None, description="A list of tools to apply to the generated completions."
    )
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoice]] = Field(
        default=None, description="A tool to apply to the generated completions."
    )
    max_tokens: Optional[int] = Field(
        default=None,
        ge=0,
        le=INT32_MAX,
        description="The maximum number of tokens to generate; 0 or null (the default): until the context is full.",
    )
    # OpenAI's newer name for max_tokens; used when max_tokens is not given.
    max_completion_tokens: Optional[int] = Field(default=None, ge=0, le=INT32_MAX)
    min_tokens: int = min_tokens_field
    logprobs: Optional[bool] = Field(default=False, description="Whether to output the logprobs or not.")
    top_logprobs: Optional[int] = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="The number of logprobs to generate (needs logprobs=true)."
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
    speculative_n_max: Optional[int] = speculative_n_max_field
    speculative_n_min: Optional[int] = speculative_n_min_field
    speculative_p_min: Optional[float] = speculative_p_min_field

    model_config = {
        "populate_by_name": True,
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
    tokens: List[TokenId] = Field(description="A list of tokens to detokenize.")


class DetokenizeInputResponse(BaseModel):
    text: str = Field(description="The detokenized text.")


# ---------------------------------------------------------------------------- responses
#
# Documentation of what the routes answer (the OpenAPI schema at /openapi.json): the routes
# build their JSON themselves, so these models are never used to serialize. Keys the
# models do not name may appear (they allow extra keys), as in OpenAI's API.


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description='"invalid_request_error" (4xx) or "internal_server_error" (5xx).')
    param: Optional[str] = Field(description="The request field at fault, when one is.")
    code: Optional[str] = Field(description='A machine-readable reason, e.g. "context_length_exceeded".')


class ErrorResponse(BaseModel):
    """Every error answer, OpenAI's shape."""

    error: ErrorDetail


class CompletionUsage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    model_config = ConfigDict(extra="allow")

    text_offset: List[int]
    token_logprobs: List[Optional[float]]
    tokens: List[str]
    top_logprobs: List[Optional[Dict[str, float]]]


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str
    index: int
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]


class CreateCompletionResponse(BaseModel):
    """A completion; with stream=true each server-sent event carries one of these (without usage)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[CompletionUsage] = None


class ChatCompletionResponseMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    message: ChatCompletionResponseMessage
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str]


class CreateChatCompletionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatCompletionChoice]
    usage: CompletionUsage


class ChatCompletionChunkChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    delta: Dict[str, Any]
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str]


class CreateChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: List[ChatCompletionChunkChoice]


class Embedding(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: Literal["embedding"]
    index: int
    # One vector, or one per token (pooling none); base64: little-endian float32 bytes.
    embedding: Union[List[float], List[List[float]], str, List[str]]


class EmbeddingUsage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: Literal["list"]
    model: str
    data: List[Embedding]
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["model"]
    owned_by: str


class ModelList(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: Literal["list"]
    data: List[ModelCard]


class PropsResponse(BaseModel):
    """GET /props, as llama.cpp's server answers it (the fields clients read)."""

    total_slots: int = Field(description="Requests served at once (--n_parallel)")
    model_path: str
    model_alias: Optional[str] = None
    chat_template: str = ""
    default_generation_settings: Dict[str, Any]
    engine: Optional[str] = None
    sparse_mode: Optional[str] = None
    sparse_kernels: Optional[str] = Field(None, description='ISA level of the sparse kernels on this CPU ("avx512", "avx2", ...)')
    build_info: str


class HealthResponse(BaseModel):
    status: str = Field(
        description='"ok", "no model loaded" while a model swap failed; with HTTP 503 "loading model" '
        "until the model is loaded"
    )
    engine: Optional[str]
    requests_waiting: int


# ---- OpenAI's Responses API, Anthropic's Messages API, llama-server's slots (documentation)


class ResponseObject(BaseModel):
    """POST /v1/responses: a Response (OpenAI's Responses API); with stream=true, its events."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: str = Field(description='"completed", or "incomplete" when max_output_tokens ended it')
    model: str
    output: List[Dict[str, Any]] = Field(description="A message item and/or function_call items")
    usage: Optional[Dict[str, Any]] = None


class AnthropicMessageResponse(BaseModel):
    """POST /v1/messages: a Message (Anthropic's Messages API); with stream=true, its events."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: List[Dict[str, Any]] = Field(description="text and tool_use blocks")
    stop_reason: Optional[str] = Field(description="end_turn, max_tokens, stop_sequence or tool_use")
    stop_sequence: Optional[str] = None
    usage: Dict[str, int]


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description='"invalid_request_error", "authentication_error", "not_found_error", "api_error", ...')
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error answer of /v1/messages, Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class SlotState(BaseModel):
    """One slot of GET /slots (llama-server's fields; n_past: tokens its cache holds)."""

    model_config = ConfigDict(extra="allow")

    id: int
    id_task: int
    n_ctx: int
    speculative: bool
    is_processing: bool
    params: Dict[str, Any]
    next_token: Dict[str, Any]
    n_past: int


class SlotsResponse(RootModel[List[SlotState]]):
    """GET /slots: every slot, by id."""


class SlotActionResponse(BaseModel):
    """POST /slots/{id_slot}?action=save (n_saved, n_written), restore (n_restored, n_read) or
    erase (n_erased), llama-server's fields."""

    model_config = ConfigDict(extra="allow")

    id_slot: int
    filename: Optional[str] = None
    n_saved: Optional[int] = None
    n_written: Optional[int] = None
    n_restored: Optional[int] = None
    n_read: Optional[int] = None
    n_erased: Optional[int] = None
    timings: Optional[Dict[str, float]] = None
