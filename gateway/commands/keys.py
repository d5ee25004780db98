"""``prefixgate keys create``: a new tenant (or admin) API key, printed once;
``prefixgate keys label``: the name the dashboard and ``prefixgate stats`` show for a
key's tenant in open mode (:mod:`gateway.policy.tenant_names`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EPILOG = """examples:
  prefixgate keys create acme                       # prints the key and the config line
  prefixgate keys create acme --config gateway.toml # also adds the hash to the config file
  prefixgate keys create --admin --config gateway.toml
  echo "$OPENAI_API_KEY" | prefixgate keys label   # which dashboard line is this key's (open mode)
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="create tenant API keys, or show a key's open-mode label",
        description="Create API keys (only their SHA-256 hash goes into the config), or print the label "
        "the dashboard shows for a key's tenant in open mode.",
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
    label = actions.add_parser(
        "label", help="print the open-mode tenant label and id of a key read from stdin", epilog=EPILOG,
        description="Reads one key from stdin (never from the command line, which others may see) and prints "
        "the label the dashboard and 'prefixgate stats' show for its tenant in open mode, then the full tenant id.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    label.set_defaults(func=run_label)


def run(args: argparse.Namespace) -> int:
    from gateway.config.config_file import NAME_PATTERN
    from gateway.config.editor import add_key_hash
    from gateway.policy.api_key import generate_key, hash_key
    from gateway.policy.tenant_names import label_of_key

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
    print(f"in open mode (no config) reports show its tenant as {label_of_key(key)}")
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
        _warn_if_exposed(args.config)
    else:
        _print_config_lines(args.tenant, key_hash)
    return 0


def _print_config_lines(tenant: str | None, key_hash: str) -> None:
    if tenant is None:
        print(f'add to your config under [server]:\nadmin_keys = ["{key_hash}"]')
    else:
        print(f'add to your config:\n[tenants.{tenant}]\nkeys = ["{key_hash}"]')


def _warn_if_exposed(path: Path) -> None:
    """A warning on stderr when ``path`` holds the server secret and others can read it."""
    import tomllib

    from gateway.policy.salt import exposed_secret_warning

    try:
        with path.open("rb") as handle:
            holds_secret = "secret" in tomllib.load(handle).get("server", {})
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return
    warning = exposed_secret_warning(path) if holds_secret else None
    if warning is not None:
        print(f"prefixgate keys create: warning: {warning}", file=sys.stderr)


def run_label(args: argparse.Namespace) -> int:
    from gateway.policy.tenant_names import label_of_key, open_tenant_id

    key = sys.stdin.readline().strip()
    if not key:
        print("prefixgate keys label: error: no key on stdin (try: echo \"$KEY\" | prefixgate keys label)",
              file=sys.stderr)
        return 2
    print(f"label: {label_of_key(key)}")
    print(f"tenant id: {open_tenant_id(key)}")
    return 0
