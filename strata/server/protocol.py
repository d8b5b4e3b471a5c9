"""Request bodies of the OpenAI and Anthropic APIs as pydantic models, and the one error type the server answers.

Validation is strict about what the server uses (types, ranges, roles: pydantic's strict mode, so "5" is no
integer and "yes" no boolean, as OpenAI and Anthropic answer) and ignores fields it does not know, the way
OpenAI-compatible servers do, so that newer clients keep working. Every rejection becomes a 400 with
OpenAI's error body; nothing a client sends may reach the engine unchecked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)


class APIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"type", "message", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def body(self, path: str = "") -> dict:
        return error_body(path, self.type, self.message, self.code)


# Anthropic names these error types differently (its error types: invalid_request_error, authentication_error,
# permission_error, not_found_error, request_too_large, rate_limit_error, api_error, overloaded_error)
_ANTHROPIC_TYPES = {"server_error": "api_error", "unavailable_error": "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, type_: str, message: str, code: str | None = None) -> dict:
    """The error body for a request to `path`: Anthropic's shape on its routes (what its clients parse:
    {"type": "error", "error": {"type", "message"}}), OpenAI's elsewhere ({"error": {"type", "message", "code",
    "param"}})."""
    if is_anthropic(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(type_, type_), "message": message}}
    return {"error": {"type": type_, "message": message, "code": code, "param": None}}


# the methods of a route that reads: HEAD is GET without the body (uvicorn leaves it out), what health checkers
# and `curl -I` send; FastAPI answers a route only on the methods it is declared with
GET_HEAD = ("GET", "HEAD")


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body, turning pydantic's errors into one readable 400 line."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = _relevant(e.errors())
        parts = []
        for err in errs:
            loc = ".".join(_shown(err.get("loc", ()))) or "body"
            part = f"{loc}: {err.get('msg', 'invalid')}"
            if part not in parts:
                parts.append(part)
        more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
        raise bad_request("; ".join(parts[:3]) + more) from None


def _is_branch(x) -> bool:
    """Whether an element of an error's location names a branch of a union (pydantic's `str`, `list[...]`,
    `tagged-union[...]`, a model's class name) rather than a field or an index."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x or x[:1].isupper())


def _shown(loc) -> list[str]:
    """An error's location as the client wrote the value: fields and indexes, no union branches, and no tag of a
    tagged union (the block's type, which follows the list index)."""
    out, tag_at = [], -1
    for i, x in enumerate(loc):
        if isinstance(x, str) and "tagged-union[" in x:
            tag_at = i + (2 if x.startswith("list[") else 1)
        elif i != tag_at and not _is_branch(x):
            out.append(str(x))
    return out


def _relevant(errs: list[dict]) -> list[dict]:
    """The errors worth reading: a union's branch that the value is not even the type of (content: a list is no
    "valid string") says nothing when another branch of that union got further into the value."""
    out = []
    for err in errs:
        loc = err.get("loc", ())
        if loc and _is_branch(loc[-1]) and err.get("type", "").endswith("_type") and any(
                len(o.get("loc", ())) > len(loc) and o["loc"][:len(loc) - 1] == loc[:-1] for o in errs):
            continue
        out.append(err)
    return out or errs


def _top_k_off(v: int | None) -> int | None:
    return v if v is None or v > 0 else 0  # the engine's "no top-k"


def _no_zero(v: int | None) -> int | None:
    if v == 0:  # (OpenAI refuses it too: a reply of no tokens is no reply)
        raise ValueError("must be at least 1, or -1 for as many as the context leaves")
    return v


TopK = Annotated[Union[int, None], AfterValidator(_top_k_off)]
MaxTokens = Annotated[Union[int, None], Field(ge=-1), AfterValidator(_no_zero)]


def no_limit(v: int | None) -> int | None:
    """A max_tokens as the server reads it: -1 (as many as the context leaves) is the same as none."""
    return None if v == -1 else v


class _M(BaseModel):
    # strict, as OpenAI and Anthropic are: "stream": "yes", "max_tokens": "5" or 5.0 and a prompt of [true] are
    # 400s, not read as what they might mean (pydantic's lax mode would take them). A float field takes an int
    model_config = ConfigDict(extra="ignore", strict=True)


Float = Union[float, int]

# ---------------------------------------------------------------------------------------------------------------
# OpenAI: chat completions


class TextPart(_M):
    type: Literal["text", "input_text"]
    text: str


class OtherPart(_M):
    """A content part the server cannot use (images, audio, files): rejected with a clear message."""

    type: Literal["image_url", "input_image", "input_audio", "file", "image"]


class RefusalPart(_M):
    """OpenAI's refusal in an assistant message of the history: read as its text."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(_M):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_M):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# a content part is told by its type: an unknown type is one error naming it, not one per kind of part
Part = Annotated[Union[TextPart, RefusalPart, OtherPart], Field(discriminator="type")]


class ChatMessage(_M):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Part], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        # OpenAI leaves content out (or null) only in an assistant message that makes tool calls: anything else
        # without it is a mistake in the client, better refused than rendered as an empty turn
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may "
                             "leave it out)")
        return self


class FunctionDef(_M):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_M):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_M):
    name: str


class NamedToolChoice(_M):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaSpec(_M):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_M):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's shorthand


class StreamOptions(_M):
    include_usage: bool = False


class SamplingFields(_M):
    """Sampling fields shared by /v1/chat/completions and /v1/completions (OpenAI's plus llama.cpp's)."""

    model: str | None = None
    max_tokens: MaxTokens = None  # -1: up to the context (llama.cpp's n_predict -1)
    temperature: Float | None = Field(default=None, ge=0, le=100)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: TopK = None  # 0 or less: off (vLLM's -1, llama.cpp's 0)
    min_p: Float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(default=None, gt=0, le=10)
    repeat_penalty: Float | None = Field(default=None, gt=0, le=10)
    stop: Union[str, list[str], None] = None
    n: int | None = Field(default=None, ge=1)  # up to the server's slot count (checked against it)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None
    # constrained output: OpenAI's response_format, llama.cpp's json_schema and grammar (GBNF); one at a time
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = Field(default=None, min_length=1, max_length=100_000)
    cache_prompt: bool = True
    ignore_eos: bool = False  # llama.cpp's field: generate max_tokens even past end-of-turn (benchmarks)
    # llama.cpp's field: this request's most draft tokens per step (n-gram drafts; 0: none), past --draft-max
    speculative_n_max: int | None = Field(default=None, ge=0, le=64, alias="speculative.n_max")
    user: str | None = None

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, v: int | None) -> int | None:
        # llama.cpp's seed -1 (LLAMA_DEFAULT_SEED, 0xFFFFFFFF as its uint32) means "draw one": clients that send it
        # ask for varied text, not for one fixed seed. Other negative seeds stay fixed seeds, as there
        return None if v == -1 else v


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # llama.cpp's field: "none" leaves the reasoning (its <think> tags included) in content; "deepseek" and "auto"
    # (the default) split it into reasoning_content. (Its "deepseek-legacy", the tags kept in content as well, is not
    # served: refused with the others, as an unknown value)
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's fields. continue_final_message: the reply continues the last (assistant) message (a prefill);
    # add_generation_prompt false: the prompt ends after the last message with no assistant header. Unset,
    # add_generation_prompt is true unless continue_final_message is (vLLM would have it sent as false)
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None


class CompletionRequest(SamplingFields):
    # a text, its token ids, or a batch of either (the openai client types a batch of token-id prompts as a list
    # of lists); a batch holds one prompt here (checked where the prompt is read)
    prompt: Union[str, list[int], list[str], list[list[int]]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        # one line naming what a prompt may be, not one "valid integer / valid string" error per union branch
        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, str) for x in v) or all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                   for x in v)))
        if not ok:
            raise ValueError("must be a string, a list of token ids (integers), or a list of strings or of token-id "
                             "lists")
        return v
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy field: how many alternatives per token
    echo: bool = False
    suffix: str | None = None
    # OpenAI's: draw best_of, return the n likeliest. Nothing ranks choices here, so only best_of = n is served
    # (langchain sends best_of 1 by default), any other is refused, as vLLM's engine refuses best_of
    best_of: int | None = Field(default=None, ge=1)


# ---------------------------------------------------------------------------------------------------------------
# Anthropic: messages


class AText(_M):
    type: Literal["text"]
    text: str


class AThinking(_M):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ARedactedThinking(_M):
    type: Literal["redacted_thinking"]
    data: str = ""


class AToolUse(_M):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class AToolResult(_M):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[AText, "AOther"], Field(discriminator="type")]], None] = None
    is_error: bool | None = None


class AOther(_M):
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result"]


AToolResult.model_rebuild()

ABlock = Annotated[Union[AText, AThinking, ARedactedThinking, AToolUse, AToolResult, AOther],
                   Field(discriminator="type")]


class AMessage(_M):
    role: Literal["user", "assistant"]
    content: Union[str, list[ABlock]]


class ATool(_M):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class AToolChoice(_M):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinkingConfig(_M):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AOutputFormat(_M):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AOutputConfig(_M):
    # effort is a hint for Anthropic's models (how much to think): nothing here reads it
    format: AOutputFormat | None = None


class MessagesRequest(_M):
    model: str | None = None
    messages: list[AMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[AText], None] = None
    stop_sequences: list[str] | None = None
    temperature: Float | None = Field(default=None, ge=0, le=1)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: TopK = None
    stream: bool = False
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    output_config: AOutputConfig | None = None


class CountTokensRequest(_M):
    model: str | None = None
    messages: list[AMessage] = Field(min_length=1)
    system: Union[str, list[AText], None] = None
    tools: list[ATool] | None = None
    thinking: AThinkingConfig | None = None
