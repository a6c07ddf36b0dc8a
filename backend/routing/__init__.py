"""Remote deployments and routing: the upstream HTTP client, model groups over deployments
(`ModelRouter`), the routing strategies, deployment health and metrics.
"""
