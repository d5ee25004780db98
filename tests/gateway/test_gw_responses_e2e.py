"""End to end: stateful Responses through `prefixgate serve` (the bundled model, real
engine child processes, real HTTP on loopback) with the official openai SDK and the
OpenAI Agents SDK.

From turn 2 on, each turn's cached tokens are at least the previous turn's input plus
output tokens minus 32 (two blocks of slack: the last generated token is never
written to the cache, and one partial block); a restart of `serve` on the same data
directory keeps the chain; another tenant can neither read, continue nor delete a
response; with `--replicas 2` every turn of a chain reaches the replica holding it."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from gw_fakes import rows, wait_healthy
from support.net import free_port

from gateway.policy.api_key import hash_key
from gateway.stats.database import default_db_url

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"acme": "acme-key-0123456789", "beta": "beta-key-0123456789"}
SLACK = 32
QUESTIONS = ["Name a fruit.", "What color is it?", "Where does it grow?", "Name another one.", "Which is sweeter?"]


class Serve:
    """`prefixgate serve` on a data directory; ``restart`` keeps the directory."""

    def __init__(self, data: Path, *extra: str) -> None:
        self.data, self.extra = data, extra
        config = data / "gateway.toml"
        config.write_text("".join(f'[tenants.{name}]\nkeys = ["{hash_key(key)}"]\n' for name, key in KEYS.items()))
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        port, engine_port = free_port(), 20000 + free_port() % 20000
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--engine-port", str(engine_port),
             "--data-dir", str(self.data), "--config", str(self.config), "--log-level", "warning", *self.extra],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.process, name="prefixgate serve", timeout=900, interval=0.5)

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        try:
            assert self.process.wait(120) == 0
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)

    def client(self, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    serve = Serve(tmp_path_factory.mktemp("responses-e2e"))
    serve.start()
    try:
        yield serve
    finally:
        serve.stop()


def turn(client: openai.OpenAI, question: str, previous: Any = None) -> Any:
    return client.responses.create(model=MODEL, input=question, max_output_tokens=48, temperature=0.0,
                                   previous_response_id=previous.id if previous is not None else None)


def assert_cached_from_previous(previous: Any, current: Any) -> None:
    """Turn N's cached tokens cover turn N-1's prompt and output (minus SLACK)."""
    carried = previous.usage.input_tokens + previous.usage.output_tokens
    cached = current.usage.input_tokens_details.cached_tokens
    assert current.usage.input_tokens >= carried  # the whole history went up
    assert cached >= carried - SLACK, (previous.usage, current.usage, previous.output_text)


def test_a_chain_continues_across_a_restart_with_its_cache(served: Serve) -> None:
    client = served.client()
    answers = [turn(client, QUESTIONS[0])]
    for question in QUESTIONS[1:3]:
        answers.append(turn(client, question, answers[-1]))
        assert_cached_from_previous(answers[-2], answers[-1])
    served.stop()  # mid-chain: the next turns come to a new gateway and a new, empty engine
    served.start()
    client = served.client()
    answers.append(turn(client, QUESTIONS[3], answers[-1]))
    assert answers[-1].usage.input_tokens >= answers[-2].usage.input_tokens + answers[-2].usage.output_tokens
    answers.append(turn(client, QUESTIONS[4], answers[-1]))
    assert_cached_from_previous(answers[-2], answers[-1])
    items = client.responses.input_items.list(answers[-1].id, order="asc", limit=100).data
    user_texts = [item.content[0].text for item in items if getattr(item, "role", None) == "user"]
    assert user_texts == QUESTIONS  # the whole history, in order
    assert client.responses.retrieve(answers[0].id).output_text == answers[0].output_text


def test_another_tenant_can_neither_read_continue_nor_delete(served: Serve) -> None:
    mine = turn(served.client("acme"), "Remember the word 'otter'.")
    other = served.client("beta")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError):
        turn(other, "Which word?", mine)
    unstored = served.client("acme").responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        served.client("acme").responses.retrieve(unstored.id)
    served.client("acme").responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        served.client("acme").responses.retrieve(mine.id)


def test_an_agents_sdk_agent_with_a_tool_over_five_turns(served: Serve) -> None:
    agents = pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEYS["acme"], max_retries=0)
    agent = Agent(name="helper", instructions="You are a helpful assistant. Use get_weather for weather questions.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0.0, max_tokens=48))

    # The first turn must call the tool (the SDK then resets tool_choice for the answer):
    # its function_call and function_call_output items join the chain.
    calling = agent.clone(model_settings=ModelSettings(temperature=0.0, max_tokens=48, tool_choice="required"))

    async def chat() -> list[Any]:
        results, previous = [], None
        for index, question in enumerate(["What is the weather in Paris?", "And in Oslo?", "Say hello.",
                                          "What is 2 + 2?", "Thank you."]):
            result = await Runner.run(calling if index == 0 else agent, question, previous_response_id=previous,
                                      max_turns=4)
            previous = result.last_response_id
            results.append(result)
        return results

    results = asyncio.run(chat())
    assert agents is not None and all(result.last_response_id for result in results)
    assert calls, "the tool was never called"
    responses = [raw for result in results for raw in result.raw_responses]
    for before, after in itertools.pairwise(responses):
        carried = before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens >= carried
        assert after.usage.input_tokens_details.cached_tokens >= carried - SLACK, (before.usage, after.usage)


def test_with_two_replicas_every_turn_reaches_the_replica_holding_its_prefix(tmp_path: Path) -> None:
    serve = Serve(tmp_path, "--replicas", "2", "--engine-arg=--kv-cache-memory=0.05", "--health-interval", "60")
    serve.start()
    try:
        client = serve.client()
        instructions = "You are the assistant of a fruit shop. Answer in one short sentence. " * 20
        answers = [client.responses.create(model=MODEL, instructions=instructions, input=QUESTIONS[0],
                                           max_output_tokens=32, temperature=0.0)]
        for question in QUESTIONS[1:4]:
            answers.append(client.responses.create(model=MODEL, instructions=instructions, input=question,
                                                   previous_response_id=answers[-1].id, max_output_tokens=32,
                                                   temperature=0.0))
            assert_cached_from_previous(answers[-2], answers[-1])
    finally:
        serve.stop()
    replicas = [row.replica for row in rows(default_db_url(tmp_path)) if row.endpoint == "responses"]
    assert len(replicas) == 4 and len(set(replicas)) == 1, replicas
