"""--chat-template: the chat template that replaces the model's own, as vLLM takes it (a file's path
or the template's text), or the name of one shipped in server/assets/chat_templates.

Without the flag the default model (SmolLM2-135M-Instruct, whose own template cannot render tools)
gets the shipped `smollm2-tools`, so that tools work on it out of the box; any other model keeps
its tokenizer's template.
"""
from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).parent / "assets" / "chat_templates"
DEFAULT_MODEL_TEMPLATE = "smollm2-tools"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja"))


def resolve_chat_template(value: str | None, default_model: bool) -> str | None:
    """The template's text for --chat-template `value`, or None for the tokenizer's own; ValueError
    (one line, which server.config turns into a ConfigError) for a value that is neither a shipped name, a readable file nor template text."""
    if value is None:
        return (SHIPPED_DIR / f"{DEFAULT_MODEL_TEMPLATE}.jinja").read_text(encoding="utf-8") if default_model else None
    if value in shipped_names():
        return (SHIPPED_DIR / f"{value}.jinja").read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it ({e})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is not a file, a Jinja template or a shipped template name "
                      f"({', '.join(shipped_names())})")
