"""Chat templates: the tokenizer's ``chat_template.jinja`` (transformers 5 writes it apart) or its config's
``chat_template`` (Jinja, rendered as HF transformers does), used by `specrt serve` (/v1/chat/completions)
and `specrt generate --chat`. Needs jinja2."""
from __future__ import annotations

import json
from pathlib import Path

# Used when the tokenizer config has no chat_template: one "role: content" line per message, then
# "assistant:" for the model to continue.
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class ChatTemplate:
    """The tokenizer config's ``chat_template`` (Jinja, rendered as HF transformers does), or the default."""

    def __init__(self, tokenizer_dir: Path | None):
        config = {}
        path = Path(tokenizer_dir) / "tokenizer_config.json" if tokenizer_dir else None
        if path is not None and path.is_file():
            config = json.loads(path.read_text())
        jinja = Path(tokenizer_dir) / "chat_template.jinja" if tokenizer_dir else None
        source = jinja.read_text() if jinja is not None and jinja.is_file() else config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]: use "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.is_default = not source  # no template in the tokenizer config
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self.template = env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role", "content"}] -> the prompt text, ending where the assistant's reply starts
        (``add_generation_prompt=False``: the conversation as it stands, e.g. training text).

        Raises ``TemplateInputError`` when the template's ``raise_exception`` rejects the messages."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


class TemplateInputError(ValueError):
    """The chat template rejected the messages (its ``raise_exception``)."""


def _raise_template_error(message: str):
    raise TemplateInputError(message)


def _token_text(token) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content", "")
    return token or ""
