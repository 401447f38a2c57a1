"""The tool fields of a chat request (pydantic): ``tools``, ``tool_choice``,
and the calls an assistant message carries."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, StrictBool, StrictStr


class FunctionDef(BaseModel):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = StrictStr | NamedToolChoice  # "none" | "auto" | "required" (checked by the plan)


class CalledFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction
