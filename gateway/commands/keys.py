"""``prefixgate keys create``: a new tenant (or admin) API key, printed once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EPILOG = """examples:
  prefixgate keys create acme                       # prints the key and the config line
  prefixgate keys create acme --config gateway.toml # also adds the hash to the config file
  prefixgate keys create --admin --config gateway.toml
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="create tenant API keys",
        description="Create API keys. Only their SHA-256 hash goes into the config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create", help="create a key for TENANT (printed once)", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    create.add_argument("tenant", nargs="?", help="tenant name (omit with --admin)")
    create.add_argument("--admin", action="store_true", help="create an admin key for /v1/cache/stats")
    create.add_argument("--config", type=Path, default=None, help="add the key hash to this TOML file")
    create.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway.api_key import generate_key, hash_key
    from gateway.config import NAME_PATTERN
    from gateway.config_editor import add_key_hash

    if args.admin == (args.tenant is not None):
        print("prefixgate keys create: error: give a TENANT name or --admin (not both)", file=sys.stderr)
        return 2
    if args.tenant is not None and not NAME_PATTERN.match(args.tenant):
        print(f"prefixgate keys create: error: invalid tenant name {args.tenant!r} (letters, digits, '_.-')",
              file=sys.stderr)
        return 2
    key = generate_key()
    key_hash = hash_key(key)
    print(f"API key (shown once, store it now): {key}")
    if args.config is not None:
        try:
            add_key_hash(args.config, args.tenant, key_hash)
        except (ValueError, OSError) as exc:
            # The key exists now: say how to add its hash by hand, then the one error line.
            _print_config_lines(args.tenant, key_hash)
            message = exc if isinstance(exc, ValueError) else f"{args.config}: {exc.strerror or exc}"
            print(f"prefixgate keys create: error: {message}", file=sys.stderr)
            return 2
        print(f"added its hash to {args.config}")
    else:
        _print_config_lines(args.tenant, key_hash)
    return 0


def _print_config_lines(tenant: str | None, key_hash: str) -> None:
    if tenant is None:
        print(f'add to your config under [server]:\nadmin_keys = ["{key_hash}"]')
    else:
        print(f'add to your config:\n[tenants.{tenant}]\nkeys = ["{key_hash}"]')
