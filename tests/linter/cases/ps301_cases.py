"""PS301 cases: volatile calls flowing into system prompts (marked lines) and harmless uses."""

import time
import uuid
from datetime import datetime

SYSTEM = "You are helpful."


def direct() -> list[dict]:
    return [{"role": "system", "content": f"Now {datetime.now()}"}]  # expect: PS301 at "datetime.now"


def through_names() -> list[dict]:
    stamp = time.time()
    text = f"{SYSTEM} t={stamp}"
    return [{"role": "system", "content": text}]  # expect: PS301 at "text"


def system_variable() -> str:
    system_prompt = SYSTEM + str(uuid.uuid4())  # expect: PS301 at "uuid.uuid4"
    return system_prompt


def keyword(client) -> None:
    client.create(system=f"t={time.time()}")  # expect: PS301 at "time.time"


def developer_role() -> dict:
    return {"role": "developer", "content": "id " + uuid.uuid4().hex}  # expect: PS301 at "uuid.uuid4"


def fine_in_user_turn() -> list[dict]:
    now = datetime.now()
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Time: {now}"}]


def fine_with_noqa() -> dict:
    return {"role": "system", "content": f"{time.time()}"}  # prefixgate: noqa: PS301
