"""OpenAI's Responses API through a real `atoll serve` of SmolLM2-135M-Instruct and the real
openai client (`client.responses.create`, streamed and not, and `responses.parse`): the text
equals the chat endpoint's greedy text for the same conversation, streamed deltas join to it,
a follow-up by previous_response_id is the stored conversation and hits the prefix cache,
text.format's JSON schema holds, and bad input is a 400 naming the field while the server
serves on."""

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import Server

NAME = "smol"
BLOCK = 16  # the engine's default block_size: the prefix cache reuses whole blocks
QUESTION = ("I am planning a week of walking in the hills with two friends in late spring. We will sleep in "
            "huts. Which three things should each of us carry?")


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-responses") / "server.log"
    s = Server(smollm2_dir, "--served-model-name", NAME, "--max-model-len", "1024", log=log)
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=240)


def chat(client, messages, max_tokens):
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)


@pytest.mark.slow  # 64 s at load 3: the first request whose whole prompt is cached took 29 s
@pytest.mark.timeout(300)
def test_text_and_stream_equal_the_chat_endpoints_greedy_text(client):
    given = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = client.responses.create(model=NAME, instructions="Answer briefly.", input=given, max_output_tokens=24,
                                temperature=0)
    want = chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == want.choices[0].message.content and len(r.output_text) > 20
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == want.usage.prompt_tokens and r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # 24 tokens cut it

    events = list(client.responses.create(model=NAME, instructions="Answer briefly.", input=given,
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert len(deltas) > 5 and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == r.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


@pytest.mark.timeout(300)
def test_previous_response_id_continues_the_stored_conversation_from_the_prefix_cache(client, server):
    first = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=12, temperature=0)
    follow = client.responses.create(model=NAME, input="And which one matters most?", max_output_tokens=12,
                                     temperature=0, previous_response_id=first.id)
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And which one matters most?"}]
    want = chat(client, conversation, 12)
    assert follow.output_text == want.choices[0].message.content and follow.previous_response_id == first.id
    assert follow.usage.input_tokens == want.usage.prompt_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the whole blocks of the first prompt came from the cache (the system prompt alone is one block)
    assert first.usage.input_tokens >= 3 * BLOCK
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK

    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=NAME, input="Hello", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="Hi", max_output_tokens=4, previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404
    assert httpx.delete(f"{server.url}/v1/responses/{first.id}").json()["deleted"] is True
    assert httpx.get(f"{server.url}/v1/responses/{first.id}").status_code == 404


class Hike(BaseModel):
    region: str = Field(min_length=1, max_length=16)
    days: int = Field(ge=1, le=14)
    difficulty: Literal["easy", "medium", "hard"]
    items: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=3)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_text_format_json_schema_validates(client):
    schema = openai.lib._pydantic.to_strict_json_schema(Hike)
    parsed = client.responses.parse(model=NAME, input=f"{QUESTION} Answer as JSON.", text_format=Hike,
                                    max_output_tokens=160, temperature=0)
    assert isinstance(parsed.output_parsed, Hike) and parsed.status == "completed"
    jsonschema.validate(json.loads(parsed.output_text), schema)
    fmt = {"format": {"type": "json_schema", "name": "Hike", "schema": schema, "strict": True}}
    events = list(client.responses.create(model=NAME, input=f"{QUESTION} Answer as JSON.", text=fmt,
                                          max_output_tokens=160, temperature=0.8, top_p=0.95, stream=True,
                                          extra_body={"seed": 7}))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text, text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.timeout(300)
def test_bad_input_is_a_400_naming_the_field_and_the_server_serves_on(server, client):
    cases = [({"background": True}, "background"),
             ({"reasoning": {"effort": "high"}}, "reasoning"),
             ({"include": ["message.output_text.logprobs"]}, "include"),
             ({"truncation": "auto"}, "truncation"),
             ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
             ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
             ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
             ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
             ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
             ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
             ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
             ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
             ({"input": []}, "input"),
             ({"max_output_tokens": 5000}, "max_output_tokens"),
             ({"max_tokens": 5}, "max_tokens"),
             ({"n": 2}, "n"),
             ({"model": "gpt-4o"}, "model"),
             ({"temperature": 3}, "temperature")]
    with httpx.Client(timeout=60) as http:
        for extra, param in cases:
            r = http.post(f"{server.url}/v1/responses", json={"input": "hi", "max_output_tokens": 4, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"], (extra, err)
            assert err["message"].startswith(param) or param in err["message"], (extra, err)
    ok = client.responses.create(model=NAME, input="Say hi.", max_output_tokens=4, temperature=0)
    assert ok.usage.output_tokens == 4 and ok.output_text
