"""The platform's HTTP routers: the OpenAI API (``openai``), the adapter registry's tenant and
operator routes (``registry``), the admin API (``admin``), a tenant's usage (``usage``) and the
metrics (``metrics``). The components they call live beside them in ``platform``; nothing there
imports these. ``loraplex.server.mount_routes`` mounts each router with its audience.
"""
