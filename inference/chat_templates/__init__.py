"""Chat templates: ``--chat-template`` (a file or the template itself, as vLLM takes it),
the tool-capable template shipped for the embedded model, and how message content is
handed to a template (``--chat-template-content-format``).

The embedded SmolLM2-135M-Instruct's own template drops ``tools``: the model would never
see them. ``smollm2_tools.jinja`` renders exactly the same text without tools and, with
them, a Hermes/Qwen-style ``<tools>`` block asking for ``<tool_call>`` answers, which the
``hermes`` tool-call parser reads.
"""

from __future__ import annotations

import re
from pathlib import Path

EMBEDDED_MODEL_TEMPLATE = Path(__file__).with_name("smollm2_tools.jinja")
CONTENT_FORMATS = ("auto", "string", "openai")
# A template that loops over a message's content expects OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)\b"
)


def load_chat_template(value: str | None) -> str | None:
    """The template text for ``--chat-template``: a file's contents, or the value itself
    when it is a template (holds ``{{``, ``{%`` or a newline); ValueError for a path that
    does not exist."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(marker in value for marker in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template")


def default_chat_template(model_folder: str | Path | None) -> str | None:
    """The template to use when none is given: the tool-capable one for the embedded
    model, else None (the tokenizer's own)."""
    from inference.model_files import default_model_dir

    if model_folder is None:
        return None
    try:
        embedded = Path(model_folder).resolve() == default_model_dir().resolve()
    except OSError:
        return None
    return EMBEDDED_MODEL_TEMPLATE.read_text() if embedded else None


def content_format(setting: str, template: str | None) -> str:
    """``string`` (text parts joined) or ``openai`` (the list of parts) for a template;
    ``auto`` picks ``openai`` for templates that loop over a message's content."""
    if setting != "auto":
        return setting
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"
