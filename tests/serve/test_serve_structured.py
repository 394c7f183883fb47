"""Structured outputs through a real `atoll serve` of SmolLM2-135M-Instruct and the real openai
client: `chat.completions.parse` with 20 pydantic models (nested objects, enums, bounded
arrays, optional fields, anyOf), each output valid under its JSON schema (jsonschema) at
temperature 0 and 0.8, one streamed; vLLM's structured_outputs (regex, choice, grammar) and
its older guided_* fields on completions; a bad schema, regex or grammar a 400 naming the
field while the server serves on; the compiled grammar cached across requests."""

import asyncio
import json
import re
from enum import Enum
from typing import Annotated, Literal, Optional, Union

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import Server

NAME = "smol"
S = Field(min_length=1, max_length=16)  # bounded strings, so a sampled answer ends
N = Field(ge=-999, le=999)  # bounded numbers too: a sampled number's digits have no other end


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = S
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    city: str = S
    zip: str = Field(pattern=r"^[0-9]{5}$")


class WithAddress(BaseModel):
    person: Person
    address: Address


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=5)


class Tags(BaseModel):
    tags: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=3)


class Scores(BaseModel):
    scores: list[Annotated[int, Field(ge=0, le=100)]] = Field(min_length=2, max_length=4)


class Maybe(BaseModel):
    title: str = S
    subtitle: Optional[str] = Field(None, max_length=24)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Union[Cat, Dog]


class Point(BaseModel):
    x: int = N
    y: int = N


class Line(BaseModel):
    start: Point
    end: Point


class Team(BaseModel):
    name: str = S
    members: list[Person] = Field(min_length=1, max_length=2)


class Flag(BaseModel):
    enabled: bool


class Mood(BaseModel):
    mood: Literal["happy", "sad", "neutral"]


class Book(BaseModel):
    title: str = S
    year: int = Field(ge=1500, le=2030)
    genre: Literal["fiction", "history", "science"]


class Weather(BaseModel):
    city: str = S
    celsius: int = Field(ge=-50, le=60)
    sky: Literal["clear", "cloudy", "rain"]


class Order(BaseModel):
    item: str = S
    quantity: int = Field(ge=1, le=99)
    express: Optional[bool] = None


class IdOrName(BaseModel):
    key: Union[Annotated[int, N], Annotated[str, S]] = Field(union_mode="left_to_right")


class Matrix(BaseModel):
    rows: list[Annotated[list[int], Field(min_length=1, max_length=3)]] = Field(min_length=1, max_length=2)


class Recipe(BaseModel):
    dish: str = S
    steps: list[Annotated[str, Field(max_length=24)]] = Field(min_length=1, max_length=3)
    vegetarian: bool


class Event(BaseModel):
    name: str = S
    day: Literal["mon", "tue", "wed", "thu", "fri"]
    attendees: Optional[list[Person]] = Field(None, max_length=2)


class Deep(BaseModel):
    outer: WithAddress
    paint: Paint


SCHEMAS = [Person, Address, WithAddress, Paint, Tags, Scores, Maybe, Pet, Point, Line, Team, Flag, Mood, Book,
           Weather, Order, IdOrName, Matrix, Recipe, Event, Deep]
assert len(SCHEMAS) >= 20


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-structured") / "server.log"
    s = Server(smollm2_dir, "--served-model-name", NAME, "--max-model-len", "1024", "--max-num-seqs", "48",
               log=log)
    try:
        yield s
    finally:
        s.kill()


def ask(model) -> list[dict]:
    return [{"role": "user", "content": f"Fill in a {model.__name__} as JSON."}]


def schema_of(model) -> dict:
    return openai.lib._pydantic.to_strict_json_schema(model)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_parse_with_pydantic_models_validates_at_two_temperatures(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=800)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse

    async def go():
        return await asyncio.gather(*[parse(model=NAME, messages=ask(m), response_format=m, temperature=t,
                                            max_tokens=300, seed=7)
                                      for t in (0.0, 0.8) for m in SCHEMAS])

    outs = asyncio.run(go())
    for r, (t, m) in zip(outs, [(t, m) for t in (0.0, 0.8) for m in SCHEMAS]):
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", (t, m.__name__, msg.content)
        jsonschema.validate(json.loads(msg.content), schema_of(m))
        assert isinstance(msg.parsed, m), (t, m.__name__, msg.content)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_streamed_output_follows_the_schema_and_equals_the_whole(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=800)
    body = dict(model=NAME, messages=ask(Recipe), temperature=0, max_tokens=300,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "Recipe", "schema": schema_of(Recipe), "strict": True}})
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 5 and text == whole
    jsonschema.validate(json.loads(text), schema_of(Recipe))
    # any object: its strings and keys have no bound a sampler must reach, so greedy here
    any_object = client.chat.completions.create(model=NAME, messages=ask(Person), temperature=0,
                                                max_tokens=200, response_format={"type": "json_object"})
    assert any_object.choices[0].finish_reason == "stop", any_object.choices[0].message.content
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)


@pytest.mark.timeout(300)
def test_vllm_fields_on_completions(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=240)
    prompt = "My phone number is "
    rx = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0.8, seed=1,
                                   extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", rx.choices[0].text)
    pick = client.completions.create(model=NAME, prompt="The sky is", max_tokens=10, temperature=0,
                                     extra_body={"guided_choice": ["green", "purple", "red"]})
    assert pick.choices[0].text in ("green", "purple", "red")
    grammar = 'start: "answer: " ("yes" | "no")'
    g = client.completions.create(model=NAME, prompt="Is water wet?", max_tokens=10, temperature=0.8, seed=2,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    assert g.choices[0].text in ("answer: yes", "answer: no")
    js = client.completions.create(model=NAME, prompt="A person:", max_tokens=100, temperature=0,
                                   extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "p", "schema": schema_of(Person)}}})
    jsonschema.validate(json.loads(js.choices[0].text), schema_of(Person))


@pytest.mark.timeout(300)
def test_bad_grammars_are_400_naming_the_field_and_the_server_serves_on(server):
    url = server.url
    messages = [{"role": "user", "content": "hi"}]
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
              "response_format"),
             ({"response_format": {"type": "xml"}}, "response_format.type"),
             ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
             ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
             ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
             ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"guided_json": "{not json"}, "guided_json"),
             ({"structured_outputs": {"json": {"type": "object"}}, "guided_regex": "x"}, "guided_regex")]

    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[http.post(f"{url}/v1/chat/completions",
                                                    json={"messages": messages, "max_tokens": 4, **body})
                                          for body, _ in cases])

    for r, (body, param) in zip(asyncio.run(go()), cases):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"], (body, err)
    ok = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                    json={"messages": messages, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
