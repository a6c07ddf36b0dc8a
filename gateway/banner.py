"""The startup banner: one block in the log saying what this gateway serves and how it is secured."""

from __future__ import annotations

import logging

from ctxgate.gateway.service import Gateway

# Its own logger at INFO: the banner shows even when the root level is WARNING (as the access log).
banner_logger = logging.getLogger("ctxgate.banner")
banner_logger.setLevel(logging.INFO)

OPEN_MODE_WARNING = (
    "open mode: no keys file, any key accepted (anyone who can reach this port can use it); "
    "create keys with `ctxgate keys add TENANT --keys-file keys.yaml` and pass --keys-file"
)


def _mode(gateway: Gateway) -> str:
    settings = gateway.settings
    if settings.model_list:
        return f"model list ({len(settings.model_list)} models)"
    if settings.upstreams:
        return f"upstream {', '.join(settings.upstreams)}"
    return "built-in engine"


def banner_lines(gateway: Gateway) -> list[str]:
    settings = gateway.settings
    lines = [
        f"ctxgate gateway listening on http://{settings.host}:{settings.port}",
        f"  models:   {', '.join(gateway.access.model_names)}",
        f"  mode:     {_mode(gateway)}",
    ]
    if settings.keys_file is None:
        lines.append("  keys:     none (open mode, any key accepted)")
    else:
        tenants, keys = gateway.keys.counts()
        lines.append(f"  keys:     {settings.keys_file} ({tenants} tenants, {keys} keys)")
    names = gateway.policies.names()
    folders = [str(folder) for folder in gateway.policies.directories]
    lines.append(f"  policies: {len(names)} loaded from {', '.join(folders)}: {', '.join(names)}")
    lines.append(f"  default policy: {settings.default_policy}")
    lines.append(
        f"  metrics:  /metrics {'needs the metrics key' if settings.metrics_key else 'open (no metrics key)'}"
    )
    lines.append(f"  access log: {'on' if settings.access_log else 'off'}")
    lines.append(
        f"  console:  {'/console (admin key)' if settings.admin_key_file else 'off (no --admin-key-file)'}"
    )
    return lines


def log_banner(gateway: Gateway) -> None:
    banner_logger.info("%s", "\n".join(banner_lines(gateway)))
    if gateway.settings.keys_file is None:
        banner_logger.warning("%s", OPEN_MODE_WARNING)
