"""Helpers for the `atoll serve` tests: a tiny model with a word-level tokenizer and a chat
template, and the server as a subprocess on 127.0.0.1 (port 0: it binds one itself and says
which), always ended by its pid."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(vocab_size: int = 301) -> list[str]:
    """The tokenizer's vocabulary: special tokens, then w7, w8, ... (one id each)."""
    return SPECIAL + [f"w{i}" for i in range(len(SPECIAL), vocab_size)]


def with_tokenizer(model_dir, out_dir, *, vocab_size: int = 301) -> Path:
    """A copy of model_dir with a word-level tokenizer.json over its whole vocabulary (id i is
    the word `w<i>`; decode joins words with spaces) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    shutil.copytree(model_dir, out)
    vocab = {w: i for i, w in enumerate(words(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return out


def text_of(ids) -> str:
    return " ".join(words()[i] for i in ids)


class Server:
    """`python -m atoll serve --model DIR --port 0 ARGS...`; its log goes to a file."""

    def __init__(self, model_dir, *args, log: Path, env: dict | None = None, ready_s: float = 240,
                 launch: list[str] | None = None):
        """launch: what runs `-m atoll serve ...` instead of this Python (torchrun's command)."""
        self.log = Path(log)
        self._out = open(self.log, "wb")
        cmd = [*(launch or [sys.executable]), "-m", "atoll", "serve", "--model", str(model_dir), "--port", "0",
               *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.pid = self.proc.pid
        try:
            self.url = self._wait_ready(ready_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, ready_s: float) -> str:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.text())
            if m:
                url = m.group(1)
                while time.monotonic() < deadline:
                    try:
                        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                            return url
                    except httpx.TransportError:
                        pass
                    time.sleep(0.2)
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready within {ready_s:.0f} s:\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict:
        """Every unlabelled sample of /metrics, and labelled ones as name{labels}."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metric(self, name: str, want: float, timeout_s: float = 30) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics().get(name)
            if value == want or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def rank_pids(self) -> list[int]:
        from procs import spawned_children

        return spawned_children(self.pid)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._out.close()

    def kill(self) -> None:
        """End the server and its ranks: its own process group (it leads a new session)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self._out.close()


# A chat template in the manner of Hermes and Qwen 2.5's: the tools as JSON in the system
# turn, an assistant's calls as <tool_call> blocks, a tool's result as <tool_response>. It
# uses what transformers' environment adds (tojson without HTML escaping, loop controls).
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_tools_template(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` (its files linked) whose chat template renders tools."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            os.symlink(f, out / f.name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return out
