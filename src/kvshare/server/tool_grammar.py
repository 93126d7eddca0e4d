"""Tool definitions checked, and the grammar that makes a DSML tool-call block follow each tool's schema.

`check_tools` (request validation): a tool is ``{type: "function", function: {name, description?,
parameters?, strict?}}``; the name matches ``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI's rule, so a name can be
written into the prompt and the grammar as it is), ``parameters`` is a valid JSON Schema (its own
draft's metaschema, 2020-12 when it names none) of an object whose property names hold no ``"``,
``<``, ``>`` or control character. Each failure is a `ToolSpecError` naming the field.

`tool_grammar` (a Lark grammar for llguidance) allows exactly the block format of `tool_calls.py`
and, per invoke, that function's parameters in its schema's ``properties`` order: the required
ones always, the others optional, each at most once, each value following its property schema:

* a plain string property (``{"type": "string"}``, optionally with ``minLength`` / ``maxLength``,
  which bound the text's characters) is raw text,
  ``string="true"``, ending at the parameter's closing tag (or a JSON string, ``string="false"``,
  which is how the prompt renders a string holding ``<``);
* a string enum (or const) is one of its values as raw text;
* anything else (numbers, booleans, arrays, nested objects, constrained strings, unions) is a JSON
  value, ``string="false"``, under llguidance's JSON-schema grammar with the root's ``$defs`` /
  ``definitions`` carried along (so ``#/$defs/...`` references resolve) and objects closed as
  `engine/json_schema.closed` says (unlisted properties only where the schema allows them).

Unlisted parameters are allowed only when ``additionalProperties`` allows them, or when the schema
lists no properties at all (``{"type": "object"}``: any object); their names differ from the listed
ones. A function without ``parameters`` takes none. Every tool is held to its schema whether or not
it says ``strict`` (kvshare's grammar is always strict).

Modes: a named ``tool_choice`` allows one invoke of that function; ``required`` one or more
invokes of any tool (exactly one with ``parallel_tool_calls: false``); ``auto`` any text without a
block marker, or such text followed by one block (so a call the model chooses to make still follows
its schema).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvshare.engine.json_schema import closed
from kvshare.server.tool_calls import BLOCK_END, BLOCK_START, DSML

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
PARAM_NAME_RE = re.compile(r'^[^"<>\x00-\x1f\x7f]{1,256}$')
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_PARAM_END = f"</{DSML}parameter>"
# a raw string value: any text, ended lazily by the parameter's closing tag (which the rule consumes)
_RAW_RULE = "raw_value{n}[suffix=" + json.dumps(_PARAM_END, ensure_ascii=False) + "]: /(?s:.{bounds})/"
# JSON values are written as the prompt renders them (json.dumps' separators) with no other whitespace:
# llguidance's default (flexible whitespace) lets a model pad a value without end
_JSON_FORMAT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}


class ToolSpecError(ValueError):
    """A tool definition that cannot be served; `field` names it (e.g. ``tools.0.function.name``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def check_tools(tools: list[Any]) -> None:
    """Raise ToolSpecError for the first tool that is not a valid function definition (module doc)."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or set(t) - {"type", "function"}:
            raise ToolSpecError(where, "a tool is {type: function, function: {name, description?, parameters?, "
                                       "strict?}}")
        extra = sorted(set(fn) - _FUNCTION_KEYS)
        if extra:
            raise ToolSpecError(f"{where}.function.{extra[0]}", "unknown field (a function has name, description, "
                                                                "parameters, strict)")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolSpecError(f"{where}.function.name", "must match ^[a-zA-Z0-9_-]{1,64}$")
        if name in seen:
            raise ToolSpecError(f"{where}.function.name", f"two tools are named {name!r}")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolSpecError(f"{where}.function.description", "must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolSpecError(f"{where}.function.strict", "must be a boolean")
        if "parameters" in fn and fn["parameters"] is not None:
            _check_parameters(fn["parameters"], f"{where}.function.parameters")


def _check_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolSpecError(where, f"must be a JSON Schema object, got {type(schema).__name__}")
    from jsonschema import Draft202012Validator, SchemaError, validators

    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        raise ToolSpecError(f"{where}.{path}" if path else where,
                            f"not a valid JSON Schema: {e.message.splitlines()[0][:200]}") from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolSpecError(f"{where}.type", f"the parameters of a function are an object, got {kind!r}")
    for key in (schema.get("properties") or {}):
        if not PARAM_NAME_RE.match(key):
            raise ToolSpecError(f"{where}.properties", f"parameter name {key!r} must be 1-256 characters without "
                                                       '", <, > or control characters')
    for key in schema.get("required") or []:
        if not PARAM_NAME_RE.match(key):
            raise ToolSpecError(f"{where}.required", f"parameter name {key!r} must be 1-256 characters without "
                                                     '", <, > or control characters')


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _is_plain_string(s: dict[str, Any]) -> bool:
    return s.get("type") == "string" and set(s) <= {"type", "minLength", "maxLength"} | _ANNOTATIONS \
        and all(isinstance(s.get(k, 0), int) and not isinstance(s.get(k, 0), bool) and 0 <= s.get(k, 0) <= 1 << 16
                for k in ("minLength", "maxLength"))


def _raw_rule(s: dict[str, Any], rules: dict[str, str]) -> str:
    """The name of the raw-text value rule for a plain string's length bounds (added to `rules`)."""
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    bounds = "*" if (lo, hi) == (0, None) else f"{{{lo},{'' if hi is None else hi}}}"
    key = f"raw:{bounds}"
    if key not in rules:
        rules[key] = _RAW_RULE.format(n="" if bounds == "*" else len(rules), bounds=bounds)
    return rules[key].split("[", 1)[0]


def _raw_choices(s: dict[str, Any]) -> list[str] | None:
    """The values of a string enum / const that can be written raw, else None."""
    values = s.get("enum") if "enum" in s else [s["const"]] if "const" in s else None
    if values is None or not values or set(s) - {"type", "enum", "const"} - _ANNOTATIONS:
        return None
    if s.get("type", "string") != "string" or not all(isinstance(v, str) and "</" not in v for v in values):
        return None
    return values


def _json_value(sub: Any, defs: dict[str, Any]) -> str:
    """A JSON value under `sub` and the parameter's closing tag."""
    schema = closed({**defs, **sub} if isinstance(sub, dict) else {} if sub is True else {"not": {}})
    return f"%json {json.dumps({**schema, **_JSON_FORMAT})} {_lit(_PARAM_END)}"


def _value(name: str, sub: Any, defs: dict[str, Any], shared: dict[str, str]) -> str:
    """The grammar of one parameter `name` (tags and value) with property schema `sub`; rules it needs
    are added to `shared`."""
    if isinstance(sub, dict) and _is_plain_string(sub):  # raw text, or a JSON string (how `<` is rendered)
        return (f"({_param_open(name, 'true')} {_raw_rule(sub, shared)} | "
                f"{_param_open(name, 'false')} {_json_value(sub, defs)})")
    choices = _raw_choices(sub) if isinstance(sub, dict) else None
    if choices is not None:
        return f"{_param_open(name, 'true')} (" + " | ".join(_lit(c) for c in choices) + f") {_lit(_PARAM_END)}"
    return f"{_param_open(name, 'false')} {_json_value(sub, defs)}"


def _param_open(name: str, string: str) -> str:
    return _lit(f'<{DSML}parameter name="{name}" string="{string}">')


def _invoke_rules(i: int, fn: dict[str, Any], shared: dict[str, str]) -> list[str]:
    """Rules `t{i}` (one invoke of `fn`) and its parameters (rules they share go to `shared`)."""
    schema = fn.get("parameters")
    schema = schema if isinstance(schema, dict) else {"type": "object", "properties": {}}
    props: dict[str, Any] = dict(schema.get("properties") or {})
    required = list(schema.get("required") or [])
    for r in required:
        props.setdefault(r, True)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    rules, seq = [], []
    for k, (pname, sub) in enumerate(props.items()):
        rules.append(f"t{i}p{k}: {_value(pname, sub, defs, shared)} {_lit(chr(10))}")
        seq.append(f"t{i}p{k}" + ("" if pname in required else "?"))
    extra = schema.get("additionalProperties", None if "properties" in schema else True)
    if extra is not None and extra is not False:
        rules += _extra_rules(i, list(props), extra, defs, shared)
        seq.append(f"t{i}x*")
    head = _lit(f'<{DSML}invoke name="{fn["name"]}">\n')
    rules.insert(0, f"t{i}: {head} {' '.join(seq)} {_lit(f'</{DSML}invoke>' + chr(10))}")
    return rules


def _extra_rules(i: int, listed: list[str], extra: Any, defs: dict[str, Any], shared: dict[str, str]) -> list[str]:
    """Rule `t{i}x`: one unlisted parameter (a name none of `listed` has), valued by `extra`'s schema."""
    name_rx = r"/[A-Za-z0-9_.\-]{1,64}/"
    if listed:
        name_rx += f" & ~/({'|'.join(re.escape(n).replace('/', chr(92) + '/') for n in listed)})/"
    head = _lit(f'<{DSML}parameter name="')
    sub = extra if isinstance(extra, dict) else {}
    json_value = _json_value(sub, defs)
    alts = [f'{_lit(chr(34) + " string=" + chr(34) + "false" + chr(34) + ">")} {json_value}']
    if not isinstance(extra, dict):
        alts.append(f'{_lit(chr(34) + " string=" + chr(34) + "true" + chr(34) + ">")} {_raw_rule({}, shared)}')
    return [f"t{i}x: {head} T{i}XNAME ({' | '.join(alts)}) {_lit(chr(10))}", f"T{i}XNAME: {name_rx}"]


def tool_grammar(tools: list[dict[str, Any]], name: str | None = None, *, parallel: bool = True,
                 auto: bool = False) -> str:
    """The Lark grammar of a tool-call output (module doc): `name` forces that function; `auto` lets the
    model write text instead, or before its block; `parallel` False allows one invoke."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules: list[str] = []
    shared: dict[str, str] = {}
    for i, fn in enumerate(fns):
        rules += _invoke_rules(i, fn, shared)
    rules += shared.values()
    rules.append("call: " + " | ".join(f"t{i}" for i in range(len(fns))))
    calls = "call" if (name is not None or not parallel) else "call+"
    if auto:
        open_rule = f"block_open[suffix={_lit(BLOCK_START + chr(10))}]: /(?s:.*)/"
        free = f"FREE_TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(BLOCK_START)}.*)/"
        rules = [f"start: FREE_TEXT | block_open {calls} {_lit(BLOCK_END)}", free, open_rule, *rules]
    else:
        rules.insert(0, f"start: {_lit(BLOCK_START + chr(10))} {calls} {_lit(BLOCK_END)}")
    return "\n".join(rules) + "\n"
