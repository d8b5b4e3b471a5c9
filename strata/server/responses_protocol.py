"""Request bodies of OpenAI's Responses API (POST /v1/responses) as pydantic models, strict as the others
(strata.server.protocol).

Input items and content parts are told apart by their `type`; one the server cannot use (an image, an
item_reference, a hosted tool's call) is parsed as an "other" and refused by name where the input is read
(strata.server.responses_api), rather than as pydantic's list of every type it expected.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from strata.server.protocol import Float, _M


class RText(_M):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RRefusal(_M):
    type: Literal["refusal"]
    refusal: str


class ROtherPart(_M):
    type: str


def _part_tag(v) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "text" if t in ("input_text", "output_text", "text") else "refusal" if t == "refusal" else "other"


Part = Annotated[Union[Annotated[RText, Tag("text")], Annotated[RRefusal, Tag("refusal")],
                       Annotated[ROtherPart, Tag("other")]], Discriminator(_part_tag)]


class RMessage(_M):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Part]]


class RFunctionCall(_M):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"
    id: str | None = None


class RFunctionCallOutput(_M):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[Part]]


class RReasoning(_M):
    """A reasoning item of an earlier turn: dropped (templates leave earlier turns' thinking out)."""

    type: Literal["reasoning"]


class ROtherItem(_M):
    type: str


_ITEMS = {"message", "function_call", "function_call_output", "reasoning"}


def _item_tag(v) -> str:
    # a message may leave its type out ({"role": "user", "content": "Hi"}: the SDK's EasyInputMessage)
    t = (v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None))
    return t if t in _ITEMS else "other"


Item = Annotated[Union[Annotated[RMessage, Tag("message")], Annotated[RFunctionCall, Tag("function_call")],
                       Annotated[RFunctionCallOutput, Tag("function_call_output")],
                       Annotated[RReasoning, Tag("reasoning")], Annotated[ROtherItem, Tag("other")]],
             Discriminator(_item_tag)]


class RTool(_M):
    type: str
    name: str | None = Field(default=None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class RToolChoice(_M):
    type: str
    name: str | None = None


class RFormat(_M):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class RTextConfig(_M):
    format: RFormat | None = None


class RReasoningConfig(_M):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(_M):
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    tools: list[RTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], RToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None  # accepted; this server keeps no responses
    previous_response_id: str | None = None
    text: RTextConfig | None = None
    reasoning: RReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
