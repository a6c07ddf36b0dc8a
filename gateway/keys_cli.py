"""`ctxgate keys add|list|revoke|rotate`: the keys file from the command line (import-light)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ctxgate.backend.settings.cli_actions import warn_deprecated
from ctxgate.gateway.keys_limit_flags import add_limit_flags, limits_from_args


class _KeysFile(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--keys":
            warn_deprecated("--keys", "--keys-file")
        super().__call__(parser, namespace, values, option_string)


def _add_keys_file_flag(parser: argparse.ArgumentParser) -> None:
    """`--keys-file`, as `serve` spells it; `--keys`, the earlier spelling here, still works (with a notice)."""
    parser.add_argument(
        "--keys-file",
        "--keys",
        action=_KeysFile,
        default="keys.yaml",
        metavar="FILE",
        help="keys file (default keys.yaml; --keys: deprecated spelling)",
    )


def register_keys(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="manage API keys: add, list, revoke, rotate")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="create a key for a tenant; prints it once, stores only its hash")
    add.add_argument("tenant", help="tenant the key belongs to (created if new)")
    _add_keys_file_flag(add)
    add.add_argument("--policy", default=None, help="the tenant's home policy (its quota and prices)")
    add.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the `serve --config` file: --model and --policy are checked against what it serves",
    )
    add.add_argument(
        "--allow-policy",
        action="append",
        default=None,
        dest="allow_policies",
        metavar="NAME",
        help="another policy the tenant's requests may name (repeat; default: the home policy only)",
    )
    add.add_argument(
        "--allow-index",
        action="append",
        default=None,
        dest="allow_indexes",
        metavar="NAME",
        help="a retrieval index the tenant may search (repeat; default: none)",
    )
    add.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a searchable label (repeat); text without '=' is stored as a free-text note",
    )
    add.add_argument(
        "--expires",
        default=None,
        metavar="WHEN",
        help="expiry: a duration from now (90d, 12h, 30m) or an ISO date/time (UTC unless zoned)",
    )
    add.add_argument(
        "--model",
        action="append",
        default=None,
        dest="models",
        metavar="NAME",
        help="served model name this key may use (repeat); default: every model",
    )
    add.add_argument(
        "--weight",
        type=tenant_weight,
        default=None,
        help="the tenant's share against other tenants' weights (fair queuing, admission; default 1)",
    )
    add_limit_flags(add)
    add.set_defaults(func=_keys_add)

    listing = keys_sub.add_parser(
        "list", help="list keys (ids, tenants, status, limits, labels; never the keys)"
    )
    _add_keys_file_flag(listing)
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="only keys carrying this label (repeat: all must match)",
    )
    listing.add_argument("--all", action="store_true", help="include revoked and expired keys")
    listing.add_argument("--json", action="store_true", help="one JSON object per key instead of a table")
    _add_usage_flags(listing, switch=True)
    listing.set_defaults(func=_keys_list)

    revoke = keys_sub.add_parser(
        "revoke", help="revoke keys; running gateways refuse them after their next reload"
    )
    revoke.add_argument(
        "key_ids", nargs="+", metavar="KEY_ID", help="key id from `keys list` (or the key itself)"
    )
    _add_keys_file_flag(revoke)
    revoke.set_defaults(func=_keys_revoke)

    show = keys_sub.add_parser(
        "show",
        help="one key: its tenant, status and limits, and what it has used of each and when each resets",
    )
    show.add_argument("key_id", metavar="KEY_ID", help="key id from `keys list` (or the key itself)")
    _add_keys_file_flag(show)
    _add_usage_flags(show)
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    show.set_defaults(func=_keys_show)

    rotate = keys_sub.add_parser(
        "rotate", help="replace a key with a new one (same tenant, limits and counters)"
    )
    rotate.add_argument("key_id", metavar="KEY_ID", help="key id from `keys list` (or the key itself)")
    _add_keys_file_flag(rotate)
    rotate.add_argument(
        "--grace",
        default=None,
        metavar="DURATION",
        help="keep the old key valid this long (e.g. 1h) instead of revoking it now",
    )
    rotate.set_defaults(func=_keys_rotate)


def _add_usage_flags(parser: argparse.ArgumentParser, switch: bool = False) -> None:
    """--redis-url and --config (to read what each limit has used); `switch`: --usage turns it on."""
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="the Redis the gateways share their quota ledger in (default $REDIS_URL): read what each "
        "limit has used; an in-process ledger lives in its gateway and cannot be read from here",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the `serve --config` file: the tenant's home policy (its quota) as it serves it",
    )
    if switch:
        parser.add_argument("--usage", action="store_true", help="add what each limit has used (needs Redis)")


def tenant_weight(text: str) -> float:
    """argparse type: a tenant weight, a finite number above 0 and at most MAX_TENANT_WEIGHT."""
    from ctxgate.backend.engine.api import MAX_TENANT_WEIGHT

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TENANT_WEIGHT):
        raise argparse.ArgumentTypeError(
            f"'{text[:40]}' is not a weight: a finite number above 0 and at most {MAX_TENANT_WEIGHT:g}"
        )
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in '90d', '12h', '30m', '45s' or '2w'."""
    number, unit = text[:-1], text[-1:].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _DURATION_UNITS or value <= 0:
        raise ValueError(f"'{text}' is not a duration (use e.g. 90d, 12h, 30m, 45s, 2w)")
    return value * _DURATION_UNITS[unit]


def parse_when(text: str):
    """A duration from now or an ISO date/time (UTC unless it names a zone)."""
    from datetime import UTC, datetime, timedelta

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=parse_duration(text))
        except ValueError:
            raise ValueError(
                f"--expires: '{text}' is neither a duration (90d, 12h) nor an ISO date/time"
            ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _parse_labels(items: list[str]) -> tuple[dict[str, str], str | None]:
    labels, notes = {}, []
    for item in items:
        name, sep, value = item.partition("=")
        if sep and name.strip():
            labels[name.strip()] = value.strip()
        else:
            notes.append(item)
    return labels, "; ".join(notes) or None


def _keys_add(args: argparse.Namespace) -> int:
    from ctxgate.gateway.key_admin import add_key

    labels, note = _parse_labels(args.label)
    limits = limits_from_args(args)
    expires_at = parse_when(args.expires) if args.expires else None
    for warning in _add_warnings(args):
        print(f"ctxgate: warning: {warning}", file=sys.stderr)
    key = add_key(
        args.keys_file,
        args.tenant,
        policy=args.policy,
        label=note,
        labels=labels,
        expires_at=expires_at,
        limits=limits,
        models=args.models,
        policies=args.allow_policies,
        indexes=args.allow_indexes,
        weight=args.weight,
    )
    print(key)
    print(
        f"stored the sha256 of this key for tenant '{args.tenant}' in {args.keys_file}; it is not shown again",
        file=sys.stderr,
    )
    return 0


def _add_warnings(args: argparse.Namespace) -> list[str]:
    from ctxgate.gateway.config_file import CtxgateConfig, load_config
    from ctxgate.gateway.keys_warnings import key_warnings

    config = load_config(args.config) if args.config else CtxgateConfig()
    return key_warnings(args.models, args.policy, args.budget, config, config_given=args.config is not None)


def _keys_list(args: argparse.Namespace) -> int:
    import json
    from datetime import UTC, datetime

    from ctxgate.gateway.keys import read_keys_file
    from ctxgate.gateway.keys_usage import usage_text

    if not os.path.exists(args.keys_file):
        raise FileNotFoundError(f"keys file not found: {args.keys_file}")
    wanted, _ = _parse_labels(args.label)
    if args.usage and not (args.redis_url or os.environ.get("REDIS_URL")):
        raise ValueError("--usage reads the shared ledger: give --redis-url (or set REDIS_URL)")
    now = datetime.now(UTC)
    rows = []
    for tenant, entry in read_keys_file(args.keys_file).tenants.items():
        if args.tenant is not None and tenant != args.tenant:
            continue
        for key in entry.keys:
            status = key.status(now)
            if (status != "active" and not args.all) or any(
                key.labels.get(k) != v for k, v in wanted.items()
            ):
                continue
            rows.append(
                {
                    "id": key.key_id,
                    "tenant": tenant,
                    "status": status,
                    "created": key.created,
                    "expires_at": key.expires_at.isoformat() if key.expires_at else None,
                    "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
                    "models": key.models,
                    "limits": key.limits.model_dump(exclude_none=True),
                    "labels": key.labels,
                    "note": key.label,
                }
            )
            if args.usage:
                rows[-1]["usage"] = _ledger_usage(args, tenant, entry, key)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'ID':<13} {'TENANT':<16} {'STATUS':<8} {'EXPIRES':<26} {'MODELS':<20} LIMITS / LABELS")
    for row in rows:
        extras = (
            [f"{k}={v}" for k, v in row["limits"].items()]
            + [f"{k}={v}" for k, v in row["labels"].items()]
            + [usage_text(usage) for usage in row.get("usage") or ()]
        )
        print(
            f"{row['id']:<13} {row['tenant']:<16} {row['status']:<8} {row['expires_at'] or '-':<26} "
            f"{','.join(row['models'] or ['*']):<20} {' '.join(extras) or '-'}"
        )
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from ctxgate.gateway.key_admin import revoke_key

    for key_id in args.key_ids:
        tenant, entry = revoke_key(args.keys_file, key_id)
        print(f"revoked {entry.key_id} (tenant '{tenant}') at {entry.revoked_at.isoformat()}")
    return 0


def _keys_rotate(args: argparse.Namespace) -> int:
    from ctxgate.gateway.key_admin import rotate_key

    grace = parse_duration(args.grace) if args.grace else 0.0
    tenant, key, old = rotate_key(args.keys_file, args.key_id, grace_s=grace)
    print(key)
    ending = f"expires at {old.expires_at.isoformat()}" if grace else "is revoked"
    print(
        f"new key for tenant '{tenant}' stored in {args.keys_file}; the old key {old.key_id} {ending}",
        file=sys.stderr,
    )
    return 0


def _ledger_usage(args: argparse.Namespace, tenant: str, entry, key) -> list[dict] | None:
    """Each limit the key meets, read from the shared ledger; None without a Redis URL."""
    from ctxgate.gateway.keys_usage import read_key_usage

    url = args.redis_url or os.environ.get("REDIS_URL")
    return read_key_usage(url, args.config, tenant, entry, key) if url else None


def _keys_show(args: argparse.Namespace) -> int:
    import json
    from datetime import UTC, datetime

    from ctxgate.gateway.key_admin import find_key
    from ctxgate.gateway.keys import read_keys_file

    if not os.path.exists(args.keys_file):
        raise FileNotFoundError(f"keys file not found: {args.keys_file}")
    keys_file = read_keys_file(args.keys_file)
    tenant, key = find_key(keys_file, args.key_id)
    entry = keys_file.tenants[tenant]
    usage = _ledger_usage(args, tenant, entry, key)
    record = {
        "id": key.key_id,
        "tenant": tenant,
        "status": key.status(datetime.now(UTC)),
        "models": key.models,
        "tenant_quota": entry.quota.model_dump(exclude_none=True),
        "limits": key.limits.model_dump(exclude_none=True),
        "usage": usage,
    }
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"key {key.key_id}  tenant {tenant}  {record['status']}  models {','.join(key.models or ['*'])}")
    print(f"tenant quota: {record['tenant_quota'] or '-'}")
    print(f"key limits:   {record['limits'] or '-'}")
    if usage is None:
        print("usage: give --redis-url (or set REDIS_URL) to read the shared ledger")
        return 0
    print(f"{'SCOPE':<7} {'LIMIT':<22} {'MODEL':<16} {'USED':>14} {'MAX':>14} {'RESET IN':>9}  RESETS AT")
    for row in usage:
        print(
            f"{row['scope']:<7} {row['limit']:<22} {row['model'] or '-':<16} {row['used']:>14g} "
            f"{row['max']:>14g} {row['reset_s']:>8}s  {row['resets_at']}"
        )
    return 0
