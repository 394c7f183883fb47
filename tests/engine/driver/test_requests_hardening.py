"""`atoll generate` against what users do: each bad request is its own error line, the output
path is checked before any rank starts, and results are written as they finish."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli import run_cli

from atoll import LLM, SamplingParams
from atoll.errors import InputError


@pytest.fixture(scope="module")
def model_with_tokenizer(tiny_model, tmp_path_factory):
    """The tiny llama with a byte-level BPE tokenizer.json (280 tokens < its 301), so text
    prompts, empty ones and lone surrogates can be tried."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok") / "m"
    shutil.copytree(tiny_model("llama"), d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox"], trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if any rank would start."""
    def launch(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("atoll.launch.launchers.launch", launch)
    monkeypatch.setattr("atoll.launch.local.LocalJob.__init__", launch)  # run_local and the living engine


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("atoll: error:")]
    assert len(lines) == 1, err
    return lines[0]


# (raw JSONL line, what its error says); every line's id is its position here, so order shows
BAD = [
    ('{"id": %d, "prompt_token_ids": [5, 301]}', "prompt_token_ids[1]=301 is outside the vocabulary: token ids are 0..300"),
    ('{"id": %d, "prompt_token_ids": [-1, 5]}', "prompt_token_ids[0]=-1 is outside the vocabulary"),
    ('{"id": %d, "prompt_token_ids": []}', "prompt_token_ids is empty"),
    ('{"id": %d, "prompt_token_ids": ["a"]}', "prompt_token_ids[0]='a' is not an integer token id"),
    ('{"id": %d, "prompt_token_ids": [1, NaN]}', "prompt_token_ids[1]=nan is not an integer token id"),
    ('{"id": %d, "prompt_token_ids": [1, 2.7]}', "prompt_token_ids[1]=2.7 is not an integer token id"),
    ('{"id": %d, "prompt_token_ids": [true, false]}', "prompt_token_ids[0]=True is not an integer token id"),
    ('{"id": %d, "prompt_token_ids": "5 7"}', "prompt_token_ids='5 7' must be a list of token ids"),
    ('{"id": %d, "prompt": 123}', "prompt=123 must be a text string"),
    ('{"id": %d, "prompt": "ab\\ud800c"}', "prompt holds '\\ud800' at character 2, a lone surrogate"),
    ('{"id": %d, "prompt": ""}', "prompt is empty"),
    ('{"id": %d, "prompt_token_ids": [3' + ", 3" * 299 + "]}", "prompt has 300 tokens; the context is 256"),
    ('{"id": %d, "prompt_token_ids": [3], "max_new_tokens": 4}', "unknown field 'max_new_tokens'; a request takes id, prompt"),
    ('{"id": %d, "prompt": "x", "prompt_token_ids": [3]}', "give 'prompt' (text) or 'prompt_token_ids' (token ids), not both"),
    ('{"id": %d}', "a request needs 'prompt' (text) or 'prompt_token_ids'"),
    ('{"id": %d, "prompt_token_ids": [3], "max_tokens": 0}', "max_tokens=0 must be at least 1"),
    ('{"id": %d, "prompt_token_ids": [3], "max_tokens": "8"}', "max_tokens='8' must be a whole number"),
    ('{"id": %d, "prompt_token_ids": [3], "temperature": -1}', "temperature=-1.0 must be >= 0"),
    ('{"id": %d, "prompt_token_ids": [3], "top_p": 1.5}', "top_p=1.5 must be in (0, 1]"),
    ('{"id": %d, "prompt_token_ids": [3], "top_k": 1.5}', "top_k=1.5 must be a whole number"),
    ('{"id": %d, "prompt_token_ids": [3], "seed": -2}', "seed=-2 must be between 0 and"),
    ('{"id": %d, "prompt_token_ids": [3], "stop": ""}', "stop='' must be a non-empty string or a list of them"),
    ('{"id": %d, "prompt_token_ids": [3], "stop": ["a", 1]}', "stop[1]=1 must be a non-empty string"),
    ('{"id": %d, "prompt_token_ids": [3], "id": [1]}', "id=[1] must be a string or a whole number"),
    ("42", "expected a JSON object"),
    ('{"id": %d, "prompt_token_ids": [3]', "not valid JSON"),
]


def _given_id(raw: str, line: int):
    """The id an output line carries: the request's own when it has a usable one."""
    try:
        rid = json.loads(raw).get("id")
    except (ValueError, AttributeError):
        rid = None
    return rid if isinstance(rid, int) else f"line-{line}"


def _jsonl(entries) -> str:
    return "".join((raw % i if "%d" in raw else raw) + "\n" for i, raw in enumerate(entries))


@pytest.mark.timeout(120)
def test_each_request_is_checked_on_its_own_and_the_others_run(capsys, model_with_tokenizer, tmp_path):
    good = {  # position -> line; per-request fields override the flags (--max-new-tokens 4)
        3: '{"id": %d, "prompt_token_ids": [5, 7, 9], "max_tokens": 2}',
        8: '{"id": %d, "prompt_token_ids": [5, 7, 9], "max_tokens": 7}',
        12: '{"id": %d, "prompt": "hello world"}',
        15: '{"id": %d, "prompt_token_ids": [5, 7, 9], "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 11, "max_tokens": 6}',
        20: '{"id": %d, "prompt_token_ids": [5, 7, 9], "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 11, "max_tokens": 6}',
        24: '{"id": %d, "prompt": "the quick", "stop": ["q", "zz"], "max_tokens": 5, "seed": null}',
    }
    entries = [raw for raw, _ in BAD]
    for at in sorted(good):
        entries.insert(at, good[at])
    prompts = tmp_path / "p.jsonl"
    text = _jsonl(entries)
    lines = text.splitlines(keepends=True)
    prompts.write_text("".join(lines[:10]) + "  \n" + "".join(lines[10:]))  # a blank line counts
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli(capsys, "generate", "--model", str(model_with_tokenizer), "--prompts", str(prompts),
                                "--output", str(out), "--max-new-tokens", "4", "--no-progress")
    assert code == 1, err  # some requests failed
    assert "Traceback" not in err and stdout == ""
    assert f"{len(good)} done, {len(BAD)} failed" in err
    rows = _rows(out.read_text())
    line_of = [n if n <= 10 else n + 1 for n in range(1, len(entries) + 1)]  # line 11 is blank
    assert [r["line"] for r in rows] == line_of  # every request, in input order
    bad = iter(BAD)
    for i, row in enumerate(rows):
        if i in good:
            assert "error" not in row and row["id"] == i, row
            continue
        raw, reason = next(bad)
        assert row["id"] == _given_id(raw % i if "%d" in raw else raw, row["line"]), row
        assert row["error"].startswith(f"line {row['line']}: ") and reason in row["error"], (reason, row)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id[3]["token_ids"]) == 2 and len(by_id[8]["token_ids"]) == 7  # max_tokens per line
    assert len(by_id[12]["token_ids"]) == 4 and isinstance(by_id[12]["text"], str)  # the flag's default
    assert by_id[15]["token_ids"] == by_id[20]["token_ids"]  # the same seed, the same tokens
    assert "q" not in by_id[24]["text"] and "zz" not in by_id[24]["text"]


def test_every_request_invalid_starts_no_rank(capsys, tiny_model, tmp_path, no_ranks):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl(raw for raw, _ in BAD[:5]))
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompts", str(prompts))
    assert code == 1 and "Traceback" not in err
    rows = _rows(out)  # stdout gets the lines when there is no --output
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(reason in r["error"] for r, (_, reason) in zip(rows, BAD))


def _output_cases(tmp_path, prompts):
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    return {
        "missing directory": (tmp_path / "nope" / "out.jsonl", "the directory"),
        "a directory": (tmp_path / "sub", "is a directory"),
        "under a file": (prompts / "out.jsonl", "is not a directory"),
        "the prompts file": (prompts, "is the prompts file"),
        "the prompts file, spelled otherwise": (tmp_path / "sub" / ".." / "p.jsonl", "is the prompts file"),
        "a symlink to the prompts file": (tmp_path / "link.jsonl", "is the prompts file"),
        "a hard link to the prompts file": (tmp_path / "hard.jsonl", "is the prompts file"),
    }


def test_output_path_is_checked_before_any_rank(capsys, tiny_model, tmp_path, no_ranks):
    prompts = tmp_path / "p.jsonl"
    original = _jsonl(['{"id": %d, "prompt_token_ids": [5, 7]}'] * 3)
    prompts.write_text(original)
    for name, (output, expected) in _output_cases(tmp_path, prompts).items():
        code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompts", str(prompts),
                                 "--output", str(output))
        assert code == 2, (name, err)
        line = _one_error_line(err)
        assert "--output" in line and expected in line, (name, line)
        assert prompts.read_text() == original, name  # the input is untouched
        assert out == ""


def test_unwritable_output(capsys, tiny_model, tmp_path, no_ranks):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5]}\n')
    if os.geteuid() == 0:  # root writes through file modes; sysfs refuses new files even to root
        output = "/sys/atoll-out.jsonl"
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no sysfs to try an unwritable path as root")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        output = str(locked / "out.jsonl")
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompts", str(prompts),
                           "--output", output)
    assert code == 2, err
    line = _one_error_line(err)
    assert f"--output {output}" in line and ("not writable" in line or "Permission denied" in line), line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line(capsys, tiny_model, tmp_path, no_ranks):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": []}\n')
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompts", str(prompts),
                           "--output", "/dev/full")
    assert code == 2 and "cannot write --output /dev/full: No space left on device" in _one_error_line(err)


def test_prompts_path_problems_are_one_line(capsys, tiny_model, tmp_path, no_ranks):
    model = str(tiny_model("llama"))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt_token_ids": [1]}\n{"prompt": "caf\xe9"}\n')
    for path, expected in [(tmp_path, "is a directory"), (tmp_path / "missing.jsonl", "does not exist"),
                           (latin1, "is not UTF-8 text: byte 0xe9 on line 2")]:
        code, _, err = run_cli(capsys, "generate", "--model", model, "--prompts", str(path))
        assert code == 2, err
        assert expected in _one_error_line(err)


@pytest.mark.parametrize("flags,expected", [
    (["--stop", "end", "--stop", ""], "--stop '' must be a non-empty string"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (["--seed", "-1"], "--seed -1 must be between 0 and"),
    (["--temperature", "nan"], "--temperature nan must be a finite number"),
])
def test_bad_sampling_flags(capsys, tiny_model, no_ranks, flags, expected):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompt", "x", *flags)
    assert code == 2, err
    assert expected in _one_error_line(err)


def test_a_bad_single_prompt_is_one_line(capsys, model_with_tokenizer, no_ranks):
    code, _, err = run_cli(capsys, "generate", "--model", str(model_with_tokenizer), "--prompt", "")
    assert code == 2 and "--prompt: prompt is empty" in _one_error_line(err)


def test_a_rank_failure_keeps_what_finished(capsys, tiny_model, tmp_path, monkeypatch):
    """What rank 0 reported before a rank failed is written as done; every other request as
    failed with the cause; the file ends in input order."""
    from atoll.errors import RankFailure

    def generate_requests(self, requests, *, on_result, **kwargs):  # the living engine's path
        result = {"token_ids": [4, 5], "finish_reason": "length", "metrics": {}}
        on_result(1, result)  # the second valid request finished
        raise RankFailure(1, "killed by SIGKILL", node="here")

    monkeypatch.setattr("atoll.engine.driver.llm.LLM.generate_requests", generate_requests)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl(['{"id": %d, "prompt_token_ids": [5]}', '{"id": %d, "prompt_token_ids": []}',
                               '{"id": %d, "prompt_token_ids": [6]}', '{"id": %d, "prompt_token_ids": [7]}']))
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model("llama")), "--prompts", str(prompts),
                           "--output", str(out), "--no-progress")
    assert code == 2 and "rank 1 on here failed: killed by SIGKILL" in _one_error_line(err)
    rows = _rows(out.read_text())
    assert [(r["id"], r["line"]) for r in rows] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert "prompt_token_ids is empty" in rows[1]["error"]
    assert rows[2]["token_ids"] == [4, 5] and "error" not in rows[2]
    assert rows[0]["error"] == rows[3]["error"] == "rank 1 on here failed: killed by SIGKILL"


def test_writer_streams_each_line_once_then_orders_the_file(tmp_path, capsys):
    from atoll.cli.requests import ResultWriter

    out = tmp_path / "out.jsonl"
    w = ResultWriter(out)
    for i in (2, 0, 2, 1):
        w.write(i, {"id": i, "text": "\ud800" if i == 1 else "é"})
        assert out.read_text().count("\n") == len(w.rows)  # flushed as written
    assert [r["id"] for r in _rows(out.read_text())] == [2, 0, 1]  # finishing order, each once
    w.close()
    rows = _rows(out.read_text())
    assert [r["id"] for r in rows] == [0, 1, 2] and rows[0]["text"] == "é"  # input order
    assert rows[1]["text"] == "\ud800"  # a lone surrogate is escaped, not a crash
    assert os.listdir(tmp_path) == ["out.jsonl"]  # no temporary file left
    s = ResultWriter(None)  # stdout
    s.write(1, {"id": 1})
    assert capsys.readouterr().out == '{"id": 1}\n'


def test_library_prepare_names_the_bad_prompt(tiny_model):
    llm = LLM(tiny_model("llama"))
    with pytest.raises(InputError, match=r"prompt 1: prompt\[0\]=True is not an integer token id"):
        llm.prepare([[5, 7], [True]])
    errors = {}
    requests = llm.prepare([[5, 7], [1, 2.0], [9]], SamplingParams(max_tokens=2), errors=errors)
    assert [r.index for r in requests] == [0, 2]
    assert errors == {1: "prompt[1]=2.0 is not an integer token id"}


@pytest.mark.timeout(120)
def test_a_killed_run_keeps_what_finished(tiny_model, tmp_path):
    """SIGKILL of the parent mid-run: the requests already done are in the file, whole lines."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_jsonl(['{"id": %d, "prompt_token_ids": [5, 7], "max_tokens": 2}']
                              + ['{"id": %d, "prompt_token_ids": [5, 7], "max_tokens": 250}'] * 4))
    out = tmp_path / "out.jsonl"
    model = tiny_model("llama", eos_token_id=None, bos_token_id=None)  # no EOS: the long requests run long
    cmd = [sys.executable, "-m", "atoll", "generate", "--model", str(model), "--prompts", str(prompts),
           "--output", str(out), "--max-num-seqs", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its ranks too (they are not this test's subject)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        proc.stderr.close()
    rows = _rows(out.read_text())  # whole JSON lines only
    assert out.read_text().endswith("\n")
    assert rows[0]["id"] == 0 and rows[0]["line"] == 1 and len(rows[0]["token_ids"]) == 2
    assert len(rows) < 5, "the run finished before the kill; make it longer"
