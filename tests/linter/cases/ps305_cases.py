"""PS305 cases: history sent as a sliding window or edited in place (marked) and append-only use."""


def sliding_window(client, system: dict, history: list) -> None:
    client.create(messages=[system, *history[-10:]])  # expect: PS305 at "history[-10:]"


class SessionStore:
    def __init__(self) -> None:
        self.items: list[dict] = []

    def get_items(self, limit: int | None = None) -> list[dict]:
        if limit is None:
            return list(self.items)
        return self.items[-limit:]  # expect: PS305 at "self.items[-limit:]"


def build_messages(system: dict, turns: list, budget: int) -> list:
    window = turns[len(turns) - budget :]  # expect: PS305 at "turns[len(turns) - budget :]"
    return [system, *window]


class Chat:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    def forget_oldest(self) -> None:
        self.messages.pop(1)  # expect: PS305 at "self.messages.pop"
        del self.messages[1]  # expect: PS305 at "self.messages[1]"


def fixed_start_is_stable(client, messages: list) -> None:
    client.create(system=messages[0]["content"], messages=messages[1:])


def append_only(messages: list) -> list:
    messages.append({"role": "user", "content": "hi"})
    return messages


def test_like_assertion(messages: list) -> None:
    assert messages[-2:] == [{"role": "user"}, {"role": "assistant"}]


def display_last_turns(print_fn, history: list) -> None:
    for message in history[-5:]:
        print_fn(message["content"])


def dict_pop_is_not_history(message: dict, conversations: dict, key: str) -> None:
    message.pop("tool_calls", None)
    conversations.pop(key)
