"""Agents declared with decorators and callbacks, in the style of small agent frameworks (labelled)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any


@dataclass
class Agent:
    """A tiny agent: instructions (text or callbacks) and tools, rendered into one request."""

    name: str
    instructions: str | Callable[[], str] = ""
    prompt_parts: list[Callable[[], str]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)

    def system_prompt(self, func: Callable[[], str]) -> Callable[[], str]:
        self.prompt_parts.append(func)
        return func

    def tool(self, description: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(func: Callable[..., Any]) -> Callable[..., Any]:
            self.tools.append({"type": "function", "function": {"name": func.__name__, "description": description, "parameters": {"type": "object"}}})
            return func

        return register

    def request(self, question: str) -> dict[str, Any]:
        base = self.instructions() if callable(self.instructions) else self.instructions
        system = "\n".join([base, *(part() for part in self.prompt_parts)])
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "tools": self.tools}


travel = Agent(name="travel")


@travel.system_prompt
def todays_date() -> str:
    return f"Today is {date.today().isoformat()}."  # expect: PS301


@travel.system_prompt
def house_rules() -> str:
    return "Prefer trains over flights for trips under 600 km."


@travel.tool(description="Find train connections between two cities.")
def find_trains(origin: str, destination: str) -> list[dict[str, Any]]:
    return [{"from": origin, "to": destination, "departs": datetime.now().isoformat()}]


def greeting_instructions() -> str:
    mood = random.choice(["cheerful", "calm", "upbeat"])  # expect: PS301
    return f"You are a {mood} concierge. Answer in two sentences."


concierge = Agent(name="concierge", instructions=greeting_instructions)


def static_instructions() -> str:
    return "You are a concise concierge. Answer in two sentences."


stable_concierge = Agent(name="concierge-v2", instructions=static_instructions)


def make_support_agent(shop_name: str) -> Agent:
    return Agent(name="support", instructions=f"You are the assistant of {shop_name}. Be brief.")


def tenant_agent(tenant: Any) -> Agent:
    agent = Agent(name=f"{tenant.slug}-helper", instructions=static_instructions)

    @agent.tool(description=f"Search the documents of {tenant.display_name}.")  # expect: PS304
    def search_documents(query: str) -> list[str]:
        return [query]

    @agent.tool(description="Search the public handbook.")
    def search_handbook(query: str) -> list[str]:
        return [query]

    return agent
