"""PS304 cases: tool definitions built from user data (marked) and shared definitions."""


def per_user_description(user) -> dict:
    return {
        "type": "function",
        "function": {"name": "orders", "description": f"Orders of {user.name}", "parameters": {}},  # expect: PS304 at "user.name"
    }


def per_user_schema(customer_id: str) -> dict:
    return {"name": "lookup", "parameters": {"description": "for " + customer_id}}  # expect: PS304 at "customer_id"


TEMPLATE = "Search the records of {}"


def tools_variable(account) -> list:
    tools = [TEMPLATE.format(account)]  # expect: PS304 at "account)"
    return tools


def shared_definition() -> dict:
    return {"type": "function", "function": {"name": "orders", "description": "Orders of the current customer"}}


def user_in_a_message(user) -> dict:
    return {"role": "user", "content": f"I am {user.name}"}


def a_tool_returns_user_data(user) -> str:
    return f"Orders of {user.name}: 3 open"


def lookup_orders_tool(customer_id: str) -> dict:
    return {"orders": [], "summary": f"No orders for {customer_id}"}
