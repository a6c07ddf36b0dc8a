"""The operator console: read views and key/policy actions under `/console`, behind the admin key.

One idea per module: `admin_key` (the key and its constant-time check), `session` (the signed
session cookie and its CSRF token), `headers` (the security headers every console answer carries),
`forms` (bounded form bodies), the read models (`tenants_view`, `savings`, `counter_history`,
`engine_view`, `policies_view`), `policy_edit` (validate, then save), `charts` (inline SVG),
`audit` (one log line per action), `pages` and `actions` (the routes) and `install` (the wiring).
Nothing is mounted without an admin key: every /console path is then the app's plain 404.
"""
