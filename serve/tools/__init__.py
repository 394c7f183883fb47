"""Tool calling: the parsers that read calls out of a model's text (one file per format,
named as vLLM's --tool-call-parser names them), the grammar that forces them, and the
request's tools checked (choice.py). A parser's interface: `extract(text) -> (content,
calls)` for a whole output, `feed(delta)` and `finish()` for a stream."""

from atoll.serve.tools.deepseek import DeepSeekV3
from atoll.serve.tools.hermes import Hermes
from atoll.serve.tools.llama3 import Llama3Json
from atoll.serve.tools.parser import ToolCall, ToolParser

PARSERS = {p.name: p for p in (Hermes, Llama3Json, DeepSeekV3)}

__all__ = ["PARSERS", "ToolCall", "ToolParser", "DeepSeekV3", "Hermes", "Llama3Json"]
