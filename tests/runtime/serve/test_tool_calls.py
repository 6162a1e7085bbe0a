"""Tool calls and structured-output requests without a server (runtime/serve/tools.py, structured.py, chat.py,
openai_api.py): the grammar a request's tools give (walked with llguidance over the demo tokenizer), the
streaming parser (any split of the text gives the same calls), OpenAI's strict rule, the new request fields."""
import json
import random

import pytest

from specrt.runtime.constraints import ConstraintSpec, GrammarCompiler
from specrt.runtime.serve.chat import ChatTemplate
from specrt.runtime.serve.openai_api import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from specrt.runtime.serve.structured import StrictSchemaError, output_constraint, strict_schema
from specrt.runtime.serve.tools import ToolCallParser, ToolChoiceError, ToolPlan, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty arguments object
TOOLS = [WEATHER, CLOCK]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'


@pytest.fixture(scope="module")
def compiler():
    from tokenizers import Tokenizer

    from specrt.tools.demo_engines import DEMO_MODELS

    return GrammarCompiler(Tokenizer.from_file(str(DEMO_MODELS / "target" / "tokenizer.json")), 4096, {0})


def accepts(compiler, spec: ConstraintSpec, text: str) -> bool:
    """Whether ``text`` (then EOS) is a complete output under ``spec``."""
    tokenizer = compiler.space.lltokenizer
    matcher = compiler.compile(spec).matcher()
    for token in tokenizer.tokenize_str(text):
        allowed = matcher.allowed(())
        if allowed is not None and not allowed[token]:
            return False
        matcher.advance([token])
    allowed = matcher.allowed(())
    return allowed is None or bool(allowed[0])


# ---- the grammar of each tool_choice ---------------------------------------------------------------------
def test_required_without_a_template_format_is_json(compiler):
    one = plan_tools(TOOLS, "required", parallel=False, tagged=False)
    assert (one.layout, one.choice) == ("json", "required")
    assert accepts(compiler, one.constraint, CALL)
    assert accepts(compiler, one.constraint, '{"name": "get_time", "arguments": {}}')
    assert not accepts(compiler, one.constraint, '{"name": "get_time", "arguments": {"x": 1}}')
    assert not accepts(compiler, one.constraint, '{"name": "nope", "arguments": {}}')
    assert not accepts(compiler, one.constraint, f"[{CALL}]")
    many = plan_tools(TOOLS, "required", parallel=True, tagged=False)
    assert accepts(compiler, many.constraint, f'[{CALL}, {{"name": "get_time", "arguments": {{}}}}]')
    assert not accepts(compiler, many.constraint, "[]")


def test_named_without_a_template_format_is_the_arguments(compiler):
    plan = plan_tools(TOOLS, "get_weather", parallel=True, tagged=False)
    assert (plan.layout, plan.name) == ("arguments", "get_weather")
    assert accepts(compiler, plan.constraint, '{"city": "Oslo"}')
    assert not accepts(compiler, plan.constraint, '{"days": 2}')  # city is required


def test_tagged_calls(compiler):
    tagged = f"<tool_call>\n{CALL}\n</tool_call>"
    auto = plan_tools(TOOLS, "auto", parallel=True, tagged=True)
    assert accepts(compiler, auto.constraint, "Just text, no call.")
    assert accepts(compiler, auto.constraint, "Let me check. " + tagged + "\n" + tagged)
    assert not accepts(compiler, auto.constraint, '<tool_call>\n{"name": "get_weather"}\n</tool_call>')
    single = plan_tools(TOOLS, "auto", parallel=False, tagged=True)
    assert accepts(compiler, single.constraint, tagged) and not accepts(compiler, single.constraint, tagged * 2)
    required = plan_tools(TOOLS, "required", parallel=True, tagged=True)
    assert accepts(compiler, required.constraint, tagged) and not accepts(compiler, required.constraint, "text")
    named = plan_tools(TOOLS, "get_time", parallel=True, tagged=True)
    assert accepts(compiler, named.constraint, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, named.constraint, tagged)
    answer = plan_tools(TOOLS, "auto", True, True, text_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(compiler, answer.constraint, '{"a": 1}') and accepts(compiler, answer.constraint, tagged)
    assert not accepts(compiler, answer.constraint, "free text")


def test_refs_inside_a_tools_parameters_still_resolve(compiler):
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}},
                            "required": ["x"], "additionalProperties": False}}}}}
    plan = plan_tools([tool, CLOCK], "required", parallel=False, tagged=False)
    assert accepts(compiler, plan.constraint, '{"name": "move", "arguments": {"to": {"x": 3}}}')
    assert not accepts(compiler, plan.constraint, '{"name": "move", "arguments": {"to": {"x": -3}}}')


@pytest.mark.parametrize("tools,choice,tagged,message,param", [
    (TOOLS, "auto", False, "defines none", "tool_choice"),
    (TOOLS, "get_date", False, "not among the request's tools", "tool_choice"),
    ([], "required", False, "needs tools", "tool_choice"),
    ([WEATHER, WEATHER], "required", False, "unique", "tools"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "additionalProperties": True}}}], "required", False, "additionalProperties", "tools"),
])
def test_refusals(tools, choice, tagged, message, param):
    with pytest.raises(ToolChoiceError, match=message) as e:
        plan_tools(tools, choice, True, tagged)
    assert e.value.param == param


def test_no_plan_without_a_call_to_make():
    assert plan_tools(TOOLS, "none", True, False) is None
    assert plan_tools([], "auto", True, False) is None


# ---- the parser -------------------------------------------------------------------------------------
def replay(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a streaming client rebuilds from the deltas: content, and calls by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for piece in d.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in piece:
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
                assert call["arguments"] == "", "a call's header comes before its arguments"
            call["arguments"] += piece["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("layout,choice,text,content,calls", [
    ("json", "required", CALL, "", [("get_weather", '{"city": "Oslo", "days": 2}')]),
    ("json", "required", '[{"name": "a", "arguments": {"s": "}\\"]{"}}, {"name": "b", "arguments": 7}]', "",
     [("a", '{"s": "}\\"]{"}'), ("b", "7")]),
    ("json", "required", '{"arguments": [1, "x"], "name": "late"}', "", [("late", '[1, "x"]')]),
    ("arguments", "named", '{"city": "Oslo"}', "", [("get_weather", '{"city": "Oslo"}')]),
    ("tagged", "auto", "no call <here>, just <tool text", "no call <here>, just <tool text", []),
    ("tagged", "auto", f'Sure. <tool_call>\n{{"name": "f", "arguments": {{"q": "</tool_call>"}}}}\n</tool_call>\n'
                       f"<tool_call>\n{CALL}\n</tool_call>\n", "Sure. ",
     [("f", '{"q": "</tool_call>"}'), ("get_weather", '{"city": "Oslo", "days": 2}')]),
    ("tagged", "required", f"<tool_call>{CALL}</tool_call>", "", [("get_weather", '{"city": "Oslo", "days": 2}')]),
])
def test_parser_any_split(layout, choice, text, content, calls):
    for seed in range(20):
        rng, parser, deltas, at = random.Random(seed), ToolCallParser(ToolPlan(choice, layout, None, "get_weather")), [], 0
        while at < len(text):
            n = 1 if seed == 0 else rng.randint(1, 12)
            deltas += parser.feed(text[at:at + n])
            at += n
        deltas += parser.flush()
        got_content, got_calls = replay(deltas)
        assert got_content == parser.content == content
        assert [(c["name"], c["arguments"]) for c in got_calls] == calls
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == calls
        assert [c["id"] for c in got_calls] == [c["id"] for c in parser.calls]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parser.calls)
        for c in parser.calls:
            json.loads(c["function"]["arguments"])


# ---- OpenAI's strict rule ---------------------------------------------------------------------------
def test_strict_schema_closes_every_object():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object"}},
                                               "d": {"anyOf": [{"$ref": "#/$defs/e"}, {"type": "null"}]}},
              "$defs": {"e": {"type": "object", "properties": {}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    with pytest.raises(StrictSchemaError, match="/properties/a"):
        strict_schema({"type": "object", "properties": {"a": {"type": "object", "additionalProperties": {}}}})


# ---- request fields ---------------------------------------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_request(json.dumps({**CHAT, **fields}).encode(), ChatCompletionRequest)


def test_response_format_and_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    spec, param = output_constraint(req)
    assert param == "response_format" and spec.value == {**schema, "additionalProperties": False}
    assert output_constraint(chat(response_format={"type": "json_object"}))[0] == ConstraintSpec("json_object")
    assert output_constraint(chat(response_format={"type": "text"})) is None
    assert output_constraint(chat(structured_outputs={"json": json.dumps(schema)}))[0].value == schema
    assert output_constraint(chat(structured_outputs={"regex": "[ab]+"})) == (ConstraintSpec("regex", "[ab]+"),
                                                                               "structured_outputs.regex")
    assert output_constraint(chat(guided_choice=["yes", "no"]))[0] == ConstraintSpec("choice", ("yes", "no"))
    completion = parse_request(json.dumps({"model": "m", "prompt": "p", "guided_grammar": "start: \"x\""}).encode(),
                               CompletionRequest)
    assert output_constraint(completion)[0].kind == "grammar"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"speculative": {"gamma": -1}}, "speculative.gamma"),
    ({"speculative": {"method": "ngram", "beta": 1}}, "speculative.beta"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0"),  # no tool_call_id
    ({"messages": [{"role": "user"}]}, "messages.0"),  # no content
])
def test_refused_fields(fields, param):
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_tool_conversation_renders_through_the_template():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = chat(messages=messages, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    assert req.tool_choice_name == "auto" and chat(tools=TOOLS).tool_choice_name == "auto"
    assert chat(tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_choice_name == "get_time"
    rendered = [m.for_template() for m in req.messages]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # HF templates' shape
    assert ChatTemplate(None).render(rendered) == ('user: weather?\nassistant: [{"name": "get_weather", "arguments": '
                                                   '{"city": "Oslo"}}]\ntool: sunny\nassistant:')


def test_hermes_template_sees_the_tools(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    template = ChatTemplate(tmp_path)
    assert template.writes_tool_calls and not ChatTemplate(None).writes_tool_calls
    text = template.render([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tool_call>" in text


# A Hermes / Qwen 2.5 style template (abridged from Qwen2.5's): tools in the system turn, calls in <tool_call>
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call write <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
