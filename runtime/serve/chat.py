"""Chat templates: the tokenizer's ``chat_template.jinja`` (transformers 5 writes it apart) or its config's
``chat_template`` (Jinja, rendered as HF transformers does), used by `specrt serve` (/v1/chat/completions)
and `specrt generate --chat`. Needs jinja2."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

# Used when the tokenizer config has no chat_template: one "role: content" line per message (an assistant
# message's tool calls as the JSON list of their {"name", "arguments"}), then "assistant:" for the model.
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] or '' }}"
                         "{% if message['tool_calls'] %}{{ message['tool_calls'] | map(attribute='function') | list "
                         "| tojson }}{% endif %}{{ '\\n' }}"
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
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson  # HF's: no HTML escaping (jinja's own writes < as \u003c)
        self.template = env.from_string(self.source)

    @property
    def writes_tool_calls(self) -> bool:
        """The template defines Hermes/Qwen-style tool calls (``<tool_call>{"name", "arguments"}</tool_call>``):
        tool_choice "auto" can tell a call from text (runtime/serve/tools.py)."""
        return "<tool_call>" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """messages: [{"role", "content"}] (HF's shape: also "tool_calls", "tool_call_id") -> the prompt text,
        ending where the assistant's reply starts (``add_generation_prompt=False``: the conversation as it
        stands, e.g. training text). ``tools``: OpenAI function tools, for templates that describe them.

        Raises ``TemplateInputError`` when the template's ``raise_exception`` rejects the messages."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    **self.special)

    def continue_final(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text that continues the final message, an assistant's partial reply (llama-server's prefill,
        vLLM's ``continue_final_message``): the conversation rendered as it stands, cut right after that message's
        content (what the template writes after it, an end of turn, is dropped), as HF transformers cuts it.

            continue_final([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}])
            # default template -> "user: hi\nassistant: Hello, I"

        TemplateInputError where the template does not write that content as given."""
        text = self.render(messages, add_generation_prompt=False, tools=tools)
        final = messages[-1]["content"] or ""
        at = text.rfind(final) if final.strip() else -1
        if at < 0:
            raise TemplateInputError("the chat template does not write the final assistant message's content as "
                                     "given, so it cannot be continued")
        return text[: at + len(final)]


class TemplateInputError(ValueError):
    """The chat template rejected the messages (its ``raise_exception``)."""


def _raise_template_error(message: str):
    raise TemplateInputError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content", "")
    return token or ""
