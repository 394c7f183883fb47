"""Llama 3.x's JSON format (vLLM's `llama3_json`): the output is the call, one JSON object
{"name": ..., "parameters": {...}} ("arguments" is taken too), several separated by `;`,
after the optional <|python_tag|> token. The text before <|python_tag|> is content; without
the tag, an output that opens with `{` is calls and any other is content."""

from __future__ import annotations

from atoll.serve.tools.parser import WHITESPACE, Scan, ToolParser, before_marker, scan_objects

TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        content, at = before_marker(text, TAG, final)
        if at >= 0:
            at += len(TAG)
        else:
            lead = len(text) - len(text.lstrip(WHITESPACE))
            if lead == len(text) and not final:
                return Scan("")  # only whitespace yet: a call may follow
            if not text.startswith("{", lead):
                return Scan(content)
            content, at = text[:lead], lead
        return scan_objects(text, at, Scan(content), sep=";")
