"""What the gateway decides about a request before it leaves: who sent it (API keys,
authentication, tenant names), how tenants stay apart (the server-side cache salt),
how the body is made stable (canonicalization), and what the linter says about its
prefix (prefix warnings, bounded in time and size, with their helper process, pixel
rate and the conversation history shared between workers). No HTTP to upstreams here.
"""
