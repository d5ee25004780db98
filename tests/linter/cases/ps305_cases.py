"""PS305 cases: history sliced or edited away from its end (marked) and append-only use."""


def sliding_window(system: dict, history: list) -> list:
    return [system, *history[-10:]]  # expect: PS305 at "history[-10:]"


def drop_first(messages: list) -> list:
    return messages[2:]  # expect: PS305 at "messages[2:]"


def edits(chat_history: list, conversation) -> None:
    del chat_history[1]  # expect: PS305 at "chat_history[1]"
    chat_history.pop(0)  # expect: PS305 at "chat_history.pop"
    conversation.messages.insert(1, {})  # expect: PS305 at "conversation.messages.insert"


def append_only(messages: list, system_messages: list) -> list:
    messages.append({"role": "user", "content": "hi"})
    last = messages.pop()
    head = messages[:5]
    return [*system_messages[1:], last, *head, *messages[-1:]]  # expect: PS305 at "messages[-1:]"


def dict_pop_is_not_history(message: dict, conversations: dict, key: str) -> None:
    message.pop("tool_calls", None)
    conversations.pop(key)
