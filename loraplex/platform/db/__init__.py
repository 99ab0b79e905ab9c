"""The platform's database: SQLAlchemy 2.0 models, the ``Database`` handle, the tenant scope."""
