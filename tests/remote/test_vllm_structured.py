"""Constraints and the sampling extensions through modeld to a real vLLM
(`make test-remote`): vLLM honours what the vllm backend sends in its own
fields (structured_outputs, the penalties, logit_bias), and the openai SDK's
parse() round-trips through modeld in front of it."""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

from modeld.gen import generation_pb2 as g
from remote_setup import REMOTE_MODEL

pytestmark = pytest.mark.remote


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


def _text(stub, prompt: str, **sampling) -> str:
    request = g.GenerateRequest(model=REMOTE_MODEL, prompt=prompt,
                                sampling=g.SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **sampling}))
    return "".join(r.text for r in stub.Generate(request, timeout=120))


def test_vllm_honours_each_constraint_kind(stub):
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", _text(stub, "Call me at", constraint=g.Constraint(
        regex=r" [0-9]{3}-[0-9]{4}")))
    assert _text(stub, "The sky is", constraint=g.Constraint(choice=g.ChoiceList(choices=[" blue", " green"]))) in (
        " blue", " green")
    # a boolean, not an integer: the grammar lets an integer grow without end, and greedy
    # SmolLM2 on vLLM writes "1000..." until max_tokens cuts the document short
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert isinstance(json.loads(_text(stub, "Is water wet? Answer as JSON:", constraint=g.Constraint(
        json_schema=json.dumps(schema))))["ok"], bool)


def test_vllm_honours_the_penalties(stub):
    prompt = "one two one two one two one two one two"
    plain = _text(stub, prompt, max_tokens=8)
    assert _text(stub, prompt, max_tokens=8, frequency_penalty=2.0) != plain
    assert _text(stub, prompt, max_tokens=8, repetition_penalty=1.8) != plain


def test_parse_through_modeld_in_front_of_vllm(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        # the system message keeps greedy SmolLM2 from padding the JSON with newlines, which the
        # grammar allows and which otherwise run on until max_tokens
        completion = client.chat.completions.parse(
            model=REMOTE_MODEL, response_format=City, max_tokens=64, temperature=0,
            messages=[{"role": "system", "content": "You answer in compact JSON on one line."},
                      {"role": "user", "content": "Paris?"}])
    assert completion.choices[0].message.parsed == City(name="Paris", country="France")
