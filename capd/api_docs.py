"""``/docs``: the OpenAPI document rendered as one self-contained HTML page.

FastAPI's own ``/docs`` loads Swagger UI's script and styles from a CDN, so on a machine without
network (capd's normal case) it draws a blank page. This page needs nothing but the daemon: every
endpoint with its request body and answers, then every schema with its fields. ``/openapi.json``
stays the machine-readable contract.
"""

from __future__ import annotations

from html import escape
from typing import Any

_STYLE = """body{font:14px/1.45 system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;color:#222}
h2{margin-top:2em;border-bottom:1px solid #ddd}code{background:#f4f4f4;padding:0 .25em}
.op{margin:1em 0;padding:.5em 1em;border-left:4px solid #4a7}.m{font-weight:bold;margin-right:.5em}
table{border-collapse:collapse}td,th{text-align:left;padding:.15em .8em .15em 0;vertical-align:top}"""


def render(openapi: dict[str, Any]) -> str:
    info = openapi.get("info", {})
    parts = [f"<!doctype html><meta charset='utf-8'><title>{escape(str(info.get('title', 'API')))} API</title>",
             f"<style>{_STYLE}</style>",
             f"<h1>{escape(str(info.get('title', '')))} API v{escape(str(info.get('version', '')))}</h1>",
             f"<p>{escape(str(info.get('description', '')))} Machine-readable: <a href='/openapi.json'>"
             "/openapi.json</a>.</p>", "<h2>Endpoints</h2>"]
    for path, methods in openapi.get("paths", {}).items():
        for method, op in methods.items():
            parts.append(_operation(path, method, op))
    parts.append("<h2>Schemas</h2>")
    for name, schema in openapi.get("components", {}).get("schemas", {}).items():
        parts.append(_schema(name, schema))
    return "\n".join(parts)


def _type(schema: dict[str, Any]) -> str:
    """A short type for a schema: a referenced schema's name, ``list[...]``, a union, or the JSON type."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"<a href='#{escape(name)}'>{escape(name)}</a>"
    if "anyOf" in schema:
        return " | ".join(_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    if "enum" in schema:
        return " | ".join(escape(repr(v)) for v in schema["enum"])
    return escape(str(schema.get("type", "any")))


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    lines = [f"<div class='op'><span class='m'>{escape(method.upper())}</span><code>{escape(path)}</code>",
             "<p>" + escape(" — ".join(str(op[k]) for k in ("summary", "description") if op.get(k))) + "</p>"]
    params = list(op.get("parameters", []))
    if params:
        lines.append("<p>Parameters: " + ", ".join(
            f"<code>{escape(str(p['name']))}</code> ({escape(str(p.get('in')))}, {_type(p.get('schema', {}))})"
            for p in params) + "</p>")
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        lines.append(f"<p>Body: {_type(body)}</p>")
    answers = []
    for status, answer in op.get("responses", {}).items():
        schema = answer.get("content", {}).get("application/json", {}).get("schema")
        answers.append(f"<b>{escape(str(status))}</b> {escape(str(answer.get('description', '')))}"
                       + (f" ({_type(schema)})" if schema else ""))
    lines.append("<p>Answers: " + "; ".join(answers) + "</p></div>")
    return "\n".join(lines)


def _schema(name: str, schema: dict[str, Any]) -> str:
    required = set(schema.get("required", []))
    rows = "".join(f"<tr><td><code>{escape(field)}</code>{'' if field in required else '?'}</td><td>{_type(spec)}</td>"
                   f"<td>{escape(str(spec.get('description', '')))}</td></tr>"
                   for field, spec in schema.get("properties", {}).items())
    return (f"<h3 id='{escape(name)}'>{escape(name)}</h3><p>{escape(str(schema.get('description', '')))}</p>"
            f"<table>{rows}</table>")
