"""Tool calls in `specrt serve`: which grammar a chat request's ``tools`` / ``tool_choice`` constrain its output
to, and the parser that turns that output, piece by piece, into OpenAI's ``tool_calls``.

Two layouts of a call, chosen by the model's chat template:

    tagged  the template defines Hermes/Qwen-style calls (its text contains ``<tool_call>``): the model writes
            ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (one or more); with
            tool_choice "auto" free text is allowed instead (a Lark grammar: text OR calls)
    json    any other template: "required" -> one ``{"name", "arguments"}`` object (an array of them with
            parallel_tool_calls), a named function -> its arguments object alone ("arguments" layout)

``plan_tools(tools, tool_choice, parallel, tagged)`` returns a ``ToolPlan`` (the constraint and the
layout), or raises ``ToolChoiceError``; ``ToolCallParser(plan)`` then reads the text::

    parser = ToolCallParser(ToolPlan("named", "arguments", spec, name="get_weather"))
    parser.feed('{"city": ')   # [{"tool_calls": [{"index": 0, "id": "call_..", "type": "function",
                               #    "function": {"name": "get_weather", "arguments": ""}}]},
                               #  {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}]
    parser.feed('"Oslo"}')     # [{"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}]
    parser.flush(); parser.calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..constraints import JSON_OPTIONS, ConstraintSpec
from .structured import StrictSchemaError, strict_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination specrt cannot answer; ``param`` names the field."""

    def __init__(self, message: str, param: str = "tool_choice"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools shape its output: the grammar it is constrained to and how to read it."""

    choice: str  # "auto" | "required" | "named"
    layout: str  # "tagged" | "json" | "arguments" (ToolCallParser reads each)
    constraint: ConstraintSpec  # the output's grammar
    name: str | None = None  # the named function ("named")


def plan_tools(tools: list[dict], choice: str, parallel: bool, tagged: bool,
               text_schema: dict | None = None) -> ToolPlan | None:
    """The ToolPlan of ``tools`` ([{"type": "function", "function": {name, parameters, strict}}]) under
    ``choice`` ("none" | "auto" | "required" | a function name), or None when the output is unconstrained
    by tools. ``tagged``: the chat template writes Hermes-style calls (``ChatTemplate.writes_tool_calls``);
    ``text_schema``: with "auto", a JSON schema the text alternative must follow (response_format), None =
    free text."""
    if choice == "none" or (not tools and choice == "auto"):
        return None
    if not tools:
        raise ToolChoiceError(f"tool_choice {choice!r} needs tools: the request has none")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolChoiceError(f"tool names must be unique, got {names}", param="tools")
    if choice not in ("auto", "required") and choice not in names:
        raise ToolChoiceError(f"tool_choice names the function {choice!r}, which is not among the request's "
                              f"tools ({', '.join(names)})")
    named = choice not in ("auto", "required")
    if not tagged:
        if choice == "auto":
            raise ToolChoiceError('tool_choice "auto" needs a chat template that defines a tool-call format (as '
                                  "Hermes / Qwen templates do with <tool_call>); this model's template defines "
                                  'none: send tool_choice "required" or {"type": "function", "function": '
                                  '{"name": ...}}')
        if named:
            schema = arguments_schema(next(t for t in tools if t["function"]["name"] == choice))
            return ToolPlan("named", "arguments", ConstraintSpec("json_schema", schema), choice)
        one = call_schema(tools)
        schema = {"type": "array", "minItems": 1, "items": one} if parallel else one
        return ToolPlan("required", "json", ConstraintSpec("json_schema", schema))
    chosen = [t for t in tools if t["function"]["name"] == choice] if named else tools
    lark = tagged_grammar(call_schema(chosen), many=parallel and not named, text=choice == "auto",
                          text_schema=text_schema)
    return ToolPlan("named" if named else choice, "tagged", ConstraintSpec("grammar", lark), choice if named else None)


# ---- grammars ---------------------------------------------------------------------------------
def arguments_schema(tool: dict) -> dict:
    """A function's ``parameters`` (OpenAI's strict semantics when ``strict`` is true; none: no arguments)."""
    function = tool["function"]
    params = function.get("parameters")
    if params is None:
        return dict(NO_ARGUMENTS)
    if not function.get("strict"):
        return params
    try:
        return strict_schema(params)
    except StrictSchemaError as e:
        raise ToolChoiceError(f"invalid parameters of function {function['name']!r}: {e}", param="tools") from None


def call_schema(tools: list[dict]) -> dict:
    """One call object: ``{"name": <a tool's name>, "arguments": <its parameters>}`` (anyOf over the tools);
    each tool's own ``$ref``s keep working: a schema with refs moves to ``$defs/<tool name>``."""
    defs, calls = {}, []
    for tool in tools:
        name, args = tool["function"]["name"], arguments_schema(tool)
        if _has_ref(args):
            defs[name] = _rebase_refs(args, f"#/$defs/{name}")
            args = {"$ref": f"#/$defs/{name}"}
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs} if defs else schema


def _has_ref(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebase_refs(node, base: str):
    """A copy of ``node`` whose local refs ("#", "#/...") point into ``base`` (where the schema will live)."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase_refs(v, base) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def tagged_grammar(call: dict, many: bool, text: bool, text_schema: dict | None = None) -> str:
    """The Lark grammar (llguidance's, ``%json`` inside) of Hermes-style calls: ``<tool_call>`` + a call object
    + ``</tool_call>`` (a newline allowed inside each tag and between calls, no other whitespace: a small
    model cannot loop on it), one or (``many``) several; with ``text``, free text instead, or free text
    first (``text_schema``: a JSON answer instead, and no text before a call)."""
    calls = "call_body (NL? OPEN call_body)*" if many else "call_body"
    lines = ["%llguidance {}"]
    if not text:
        lines.append(f"start: OPEN {calls}")
    elif text_schema is not None:
        lines += [f"start: answer | OPEN {calls}", f"answer: %json {_json_rule(text_schema)}"]
    else:
        lines += [f"start: TEXT | pre {calls}", r"TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/",
                  r"pre[lazy]: /(.|\n)*<tool_call>/"]  # text, ending at the first <tool_call>
    lines += ["call_body: NL? call NL? CLOSE", f"call: %json {_json_rule(call)}", r'NL: "\n"',
              'OPEN: "<tool_call>"', 'CLOSE: "</tool_call>"']
    return "\n".join(lines) + "\n"


def _json_rule(schema: dict) -> str:
    """A schema for Lark's ``%json``, with the JSON layout of response_format's (constraints.JSON_OPTIONS)."""
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema})


# ---- reading the output -------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Reads a tool-constrained completion as it streams: ``feed(text)`` returns chat deltas
    (``{"content": ...}`` and ``{"tool_calls": [...]}`` in OpenAI's streaming shape), ``flush()`` the held-back
    rest at the end. ``content`` and ``calls`` hold the whole answer (the deltas' concatenation)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.content = ""  # text outside calls ("tagged" layout)
        self.calls: list[dict] = []  # [{"id", "type": "function", "function": {"name", "arguments"}}]
        self.mode = "text" if plan.choice == "auto" else "between"  # tagged: text | between | call | close
        self.pending = ""  # text held back: maybe the start of a tag
        self.scanner: _CallScanner | None = None
        if plan.layout == "json":
            self.scanner = _CallScanner(None)
        elif plan.layout == "arguments":
            self.started = False

    # ---- deltas -----------------------------------------------------------------------------------
    def _content(self, text: str) -> list[dict]:
        self.content += text
        return [{"content": text}] if text else []

    def _scanned(self, events: list[tuple]) -> list[dict]:
        """Scanner events -> deltas: a call's header once its name is known, then its argument text (text
        that came before the name, out of schema order, follows the header)."""
        out = []
        for kind, value in events:
            if kind == "call":
                self.calls.append({"id": new_call_id(), "type": "function", "function": {"name": None, "arguments": ""}})
                continue
            index, function = len(self.calls) - 1, self.calls[-1]["function"]
            if kind == "name":
                function["name"] = value
                out.append(_header(index, self.calls[-1]))
                value = function["arguments"]  # arguments that came first
            else:
                function["arguments"] += value
            if value and function["name"] is not None:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": value}}]})
        return out

    # ---- feeding ----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        layout = self.plan.layout
        if layout == "arguments":
            return self._feed_arguments(text)
        if layout == "json":
            return self._scanned(self.scanner.feed(text))
        return self._feed_tagged(text)

    def _feed_arguments(self, text: str) -> list[dict]:
        out = []
        if not self.started:
            text = text.lstrip()
            if not text:
                return []
            self.started = True
            self.calls.append({"id": new_call_id(), "type": "function",
                               "function": {"name": self.plan.name, "arguments": ""}})
            out.append(_header(0, self.calls[0]))
        self.calls[0]["function"]["arguments"] += text
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _feed_tagged(self, text: str) -> list[dict]:
        out, rest = [], self.pending + text
        self.pending = ""
        while rest:
            if self.mode == "call":
                events, rest = self.scanner.feed_until_closed(rest)
                out += self._scanned(events)
                if self.scanner.closed:
                    self.mode, self.scanner = "close", None
            elif self.mode == "close":  # after a call object: whitespace and </tool_call>
                at = rest.find(CLOSE)
                if at < 0:
                    self.pending = rest
                    return out
                self.mode, rest = "between", rest[at + len(CLOSE):]
            else:  # "text" (content before the first call) or "between" (whitespace between calls)
                at = rest.find(OPEN)
                if at < 0:
                    keep = _tag_prefix(rest)
                    if self.mode == "text":
                        out += self._content(rest[: len(rest) - keep])
                    self.pending = rest[len(rest) - keep:]
                    return out
                if self.mode == "text":
                    out += self._content(rest[:at])
                self.mode, self.scanner, rest = "call", _CallScanner(1), rest[at + len(OPEN):]
        return out

    def flush(self) -> list[dict]:
        """The end of the text: held-back text that never became a tag is content ("auto")."""
        rest, self.pending = self.pending, ""
        return self._content(rest) if self.mode == "text" else []


def _header(index: int, call: dict) -> dict:
    return {"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""}}]}


def _tag_prefix(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>`` (held back until known)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class _CallScanner:
    """Finds call objects ``{"name": ..., "arguments": ...}`` in JSON text fed piece by piece: a bare object
    (depth 1), an array of them (depth 2; ``call_depth`` None: decided by the first character) or, in tagged
    calls, one object (``feed_until_closed``). Emits ("call", None) at each call object's start,
    ("name", str) once its name string is complete and ("args", raw text) for its arguments value."""

    def __init__(self, call_depth: int | None):
        self.depth = call_depth
        self.stack: list[str] = []  # open containers
        self.in_string = self.escape = False
        self.key = None  # the last key read at call level
        self.expect_key = False  # at call level: the next string is a key
        self.token = None  # raw text of a string being read at call level (a key or the name)
        self.capture = None  # "container" | "string" | "scalar" while inside the arguments value
        self.closed = False  # the call object has ended (depth 1)

    def feed(self, text: str) -> list[tuple]:
        return self.feed_until_closed(text)[0]

    def feed_until_closed(self, text: str) -> tuple[list[tuple], str]:
        """Events of ``text``, and the text after the call object ends (tagged layout; else "")."""
        events, args = [], []
        for i, ch in enumerate(text):
            if self.closed:
                _flush_args(events, args)
                return events, text[i:]
            if self.depth is None:
                if ch.isspace():
                    continue
                self.depth = 2 if ch == "[" else 1
            self._char(ch, events, args)
        _flush_args(events, args)
        return events, ""

    def _char(self, ch: str, events: list, args: list) -> None:
        if self.capture == "scalar" and ch in ",}] \t\r\n":
            self.capture = None  # a number / true / false / null ends before its delimiter
        if self.capture is not None:  # inside the arguments value
            args.append(ch)
            self._lex(ch)
            if (self.capture == "string" and not self.in_string) or \
                    (self.capture == "container" and len(self.stack) == self.depth):
                self.capture = None
            return
        at_call = len(self.stack) == self.depth and self.stack[-1] == "{"  # directly inside a call object
        if self.in_string:
            self._lex(ch)
            if self.token is not None:
                self.token += ch
                if not self.in_string:  # a call-level string ended: a key, or the name's value
                    value, self.token = json.loads(self.token), None
                    if self.expect_key:
                        self.key = value
                    elif self.key == "name":
                        _flush_args(events, args)
                        events.append(("name", value))
            return
        if at_call and not self.expect_key and self.key == "arguments" and ch not in ": \t\r\n,}":
            self.capture = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            args.append(ch)
            self._lex(ch)
            return
        self._lex(ch)
        if ch == '"' and at_call:
            self.token = ch
        elif ch == "{" and len(self.stack) == self.depth:
            _flush_args(events, args)
            events.append(("call", None))
            self.key, self.expect_key = None, True
        elif ch == "}" and len(self.stack) == self.depth - 1:
            self.closed = self.depth == 1
        elif at_call and ch in ",:":
            self.expect_key = ch == ","

    def _lex(self, ch: str) -> None:
        """Strings (with escapes) and the stack of open containers."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.stack.append(ch)
        elif ch in "}]" and self.stack:  # (unbalanced text: only unconstrained output, e.g. a benchmark's)
            self.stack.pop()


def _flush_args(events: list, args: list) -> None:
    """Move the argument characters collected so far into an ("args", text) event (keeping event order)."""
    if args:
        events.append(("args", "".join(args)))
        args.clear()
