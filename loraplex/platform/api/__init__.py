"""The platform's HTTP routers that are not part of a component package (the OpenAI API is
``platform.openai.routes``, the adapter registry's ``platform.registry.routes``): the admin API,
a tenant's usage, the metrics. Each router is mounted with its audience by
``loraplex.server.mount_routes``."""
