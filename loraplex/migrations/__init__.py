"""The platform database's Alembic migrations (run them with ``loraplex db upgrade``).

They ship inside the package so that an installed ``loraplex`` can migrate its database with no
``alembic.ini``: :mod:`loraplex.platform.db.migrate` points Alembic at this directory.
"""
