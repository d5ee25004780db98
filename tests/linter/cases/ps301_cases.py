"""PS301 cases: volatile values that reach a system prompt or tools (marked) and harmless uses."""

import random
import time
import uuid
from datetime import date, datetime

SYSTEM = "You are helpful."


def direct() -> list[dict]:
    return [{"role": "system", "content": f"Now {datetime.now().isoformat()}"}]  # expect: PS301 at "datetime.now"


def through_names() -> list[dict]:
    stamp = time.time()  # expect: PS301 at "time.time"
    text = f"{SYSTEM} t={stamp}"
    return [{"role": "system", "content": text}]


def system_variable() -> str:
    system_prompt = SYSTEM + str(uuid.uuid4())  # expect: PS301 at "uuid.uuid4"
    return system_prompt


def keyword(client) -> None:
    client.create(system=f"t={time.time()}")  # expect: PS301 at "time.time"


def developer_role() -> dict:
    return {"role": "developer", "content": "id " + uuid.uuid4().hex}  # expect: PS301 at "uuid.uuid4"


class Agent:
    def system_prompt(self, func):
        return func


agent = Agent()


@agent.system_prompt
def add_the_date() -> str:
    return f"Today is {date.today():%A %d %B %Y}."  # expect: PS301 at "date.today"


def current_time_instructions() -> str:
    return "The time is " + datetime.utcnow().strftime("%H:%M")  # expect: PS301 at "datetime.utcnow"


def build_agent(make_agent) -> None:
    make_agent(name="helper", instructions=current_time_instructions)


def lucky_number_prefix() -> list[dict]:
    seed = random.randint(0, 1000)  # expect: PS301 at "random.randint"
    return [{"role": "system", "content": f"[{seed}] You are a helpful assistant."}]


def helper_returns_time() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M")  # expect: PS301 at "datetime.now"


def through_a_helper() -> dict:
    return {"role": "system", "content": "You help. " + helper_returns_time()}


def fine_in_user_turn() -> list[dict]:
    now = datetime.now()
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Time: {now}"}]


def fine_in_a_log_line(log) -> None:
    log.info("request at %s", datetime.now())


def fine_in_a_tool_result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": f"done at {time.time()}"}


def fine_with_noqa() -> dict:
    return {"role": "system", "content": f"{time.time()}"}  # prefixgate: noqa: PS301
