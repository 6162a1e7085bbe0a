"""Structured outputs in `specrt serve`: a request's ``response_format`` / ``structured_outputs`` as a
``ConstraintSpec``, OpenAI's strict-schema rule, and grammar compilation off the event loop within a budget.

    output_constraint(req)                 -> (ConstraintSpec, the field it came from) or None
    await compile_constraint(server, spec, param)   -> Grammar, or ApiError 400 naming ``param``

e.g. ``{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema":
{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}`` -> ConstraintSpec("json_schema",
{... "additionalProperties": false}) from "response_format".
"""
from __future__ import annotations

import asyncio
import json

from ..constraints import ConstraintError, ConstraintSpec
from .openai_api import ApiError

COMPILE_GRACE = 1.0  # seconds past the budget before the server stops waiting for a compiler that overran it
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
SCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems")  # one schema (items may be a list: draft 4)


class StrictSchemaError(ValueError):
    """A schema that cannot be strict under OpenAI's rule."""


def strict_schema(schema: dict, path: str = "") -> dict:
    """OpenAI's ``strict: true``: every object admits only the properties it lists (``additionalProperties``
    false where the schema does not say; an explicit true or a schema is a StrictSchemaError, as OpenAI refuses
    it). Properties missing from ``required`` stay optional (OpenAI refuses such a schema under strict;
    specrt constrains it as written). Returns a copy.

        strict_schema({"type": "object", "properties": {"a": {"type": "object"}}})
        == {"type": "object", "properties": {"a": {"type": "object", "additionalProperties": False}},
            "additionalProperties": False}
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: strict_schema(v, f"{path}/{key}/{k}") for k, v in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [strict_schema(v, f"{path}/{key}/{i}") for i, v in enumerate(schema[key])]
    for key in SCHEMA_ONE:
        value = schema.get(key)
        if isinstance(value, list):
            out[key] = [strict_schema(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        elif isinstance(value, dict):
            out[key] = strict_schema(value, f"{path}/{key}")
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object:
        extra = schema.get("additionalProperties", False)
        if extra is not False:
            raise StrictSchemaError(f"strict: additionalProperties must be false, got {json.dumps(extra)} at "
                                    f"'{path or '/'}' (or send strict: false)")
        out["additionalProperties"] = False
    return out


def output_constraint(req) -> tuple[ConstraintSpec, str] | None:
    """The constraint a request's ``response_format`` or ``structured_outputs`` asks for, with the field's
    name (the ``param`` of any error), or None. (The schemas allow at most one of them.) ApiError 400 for
    a value no constraint can be made of (an empty regex, an empty choice)."""
    try:
        return _output_constraint(req)
    except ConstraintError as e:
        raise ApiError(400, str(e), param="structured_outputs", code="invalid_value") from None


def _output_constraint(req) -> tuple[ConstraintSpec, str] | None:
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        return response_format_spec(fmt), "response_format"
    so = getattr(req, "structured_outputs", None)
    if so is None:
        return None
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ApiError(400, f"structured_outputs.json is not valid JSON: {e}",
                               param="structured_outputs.json", code="invalid_value") from None
        return ConstraintSpec("json_schema", schema), "structured_outputs.json"
    for kind in ("regex", "choice", "grammar"):
        value = getattr(so, kind)
        if value is not None:
            return ConstraintSpec(kind, value), f"structured_outputs.{kind}"
    return ConstraintSpec("json_object", None), "structured_outputs.json_object"


def response_format_spec(fmt) -> ConstraintSpec:
    """response_format json_object / json_schema (strict applied) -> its ConstraintSpec."""
    if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
        return ConstraintSpec("json_object", None)
    schema = fmt.json_schema.schema_
    if fmt.json_schema.strict:
        try:
            schema = strict_schema(schema)
        except StrictSchemaError as e:
            raise ApiError(400, f"invalid schema for response_format {fmt.json_schema.name!r}: {e}",
                           param="response_format", code="invalid_value") from None
    return ConstraintSpec("json_schema", schema)


async def compile_constraint(server, spec: ConstraintSpec, param: str):
    """``spec`` compiled for this engine's tokenizer on a worker thread (the event loop and every other
    stream keep going), within ``server.config.grammar_timeout`` seconds. A spec the engine cannot compile,
    or one over the budget, is ApiError 400 naming ``param``."""
    budget = server.config.grammar_timeout
    runtime = server.runtime
    compiler = await asyncio.to_thread(lambda: runtime.grammar_compiler)  # built once (the tokenizer's trie)
    try:
        return await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec, max_seconds=budget),
                                      budget + COMPILE_GRACE)
    except TimeoutError:
        raise ApiError(400, f"{param}: the grammar did not compile within {budget:g} s (the server's "
                       "--grammar-timeout); simplify it", param=param, code="grammar_too_complex") from None
    except ConstraintError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
