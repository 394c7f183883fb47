"""The README's library example as a newcomer runs it: saved as a script with no
`if __name__ == "__main__":` guard, and read from stdin. The ranks start from atoll's own entry
and never import the user's script again (launch.local._own_entry), so both runs give
transformers' greedy tokens; the script prints a line at import, and it appears once."""

import subprocess
import sys

import pytest
from reference import reference_tokens

SCRIPT = """\
from atoll import LLM, SamplingParams

print("script imported")
llm = LLM({model!r}, layout="TP2")
for out in llm.generate([[5, 17, 42, 9]], SamplingParams(max_tokens=6, ignore_eos=True)):
    print("tokens", out.token_ids, out.finish_reason)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["script", pytest.param("stdin", marks=pytest.mark.slow)])
def test_library_example_without_a_main_guard(tiny_model, tmp_path, how):
    model = tiny_model("llama")
    text = SCRIPT.format(model=str(model))
    if how == "script":
        path = tmp_path / "example.py"
        path.write_text(text)
        r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    else:
        r = subprocess.run([sys.executable, "-"], input=text, capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bootstrapping phase" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.count("script imported") == 1, r.stdout  # no rank ran the script again
    want = reference_tokens(model, [[5, 17, 42, 9]], 6)[0]
    assert f"tokens {want} length" in r.stdout, (r.stdout, want)
