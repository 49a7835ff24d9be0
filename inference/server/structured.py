"""The one structured-output constraint a request asks for, from whichever of its fields
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and older ``guided_*``)."""

from __future__ import annotations

from typing import Any

from inference.sampling_params import StructuredOutputsParams
from inference.server.errors import APIError
from inference.server.protocol import _SamplingFields

_GUIDED_FIELDS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # fmt: skip


def requested_structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint a request asks for through ``response_format``,
    ``structured_outputs`` or a ``guided_*`` field (400 if more than one, or malformed).
    Whether the schema or grammar itself is valid, the engine decides (also a 400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400, "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        fields = {
            "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": so.json_object, "disable_any_whitespace": so.disable_any_whitespace,
        }  # fmt: skip
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(
            400, f"give at most one structured-output constraint; got {names}",
            param=found[1][0],
        )
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from exc
