"""`atoll serve` under torchrun: every rank runs the command, rank 0 serves HTTP and the other
runs its engine rank; transformers' greedy tokens through the openai client, and SIGTERM to
the job drains rank 0 and stops the other ranks with it."""

import shutil
import signal
import sys

import openai
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

from atoll.launch.local import free_port

NAME = "tiny"
PROMPTS = [[5, 7, 9, 11, 13], [100, 3]]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.timeout(300)
def test_torchrun_serves_transformers_tokens_and_stops_on_sigterm(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=4), tmp_path / "m")
    expected = reference_tokens(d, PROMPTS, 6)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    server = Server(d, "-tp", "2", "--served-model-name", NAME, log=tmp_path / "server.log", launch=torchrun,
                    env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(PROMPTS, expected):
            r = c.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].token_ids == want
            streamed = [t for chunk in c.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                            stream=True, extra_body={"ignore_eos": True,
                                                                                     "return_token_ids": True})
                        for t in chunk.choices[0].token_ids]
            assert streamed == want
        server.proc.send_signal(signal.SIGTERM)
        server.wait(90)
        out = server.text()
        assert "atoll: shut down" in out and "atoll: error" not in out, out
    finally:
        server.kill()
