"""The Iceberg catalog's Airflow connection (``output.table.catalog.conn_id``) as pyiceberg catalog properties.

``sql``: a database connection becomes the catalog's SQLAlchemy URL (``postgres`` → ``postgresql+psycopg2``; the
Airflow metadata database's PostgreSQL server will do). ``rest``: the connection's host is the catalog's URL,
login/password its OAuth2 client credentials (``credential``; a password alone is a bearer ``token``), and its
extra any further pyiceberg REST properties (``warehouse``, ``scope``, ``oauth2-server-uri``, ...). The
properties reach the stage library as plain values; Airflow masks the connection's password in logs.
"""
from __future__ import annotations

from urllib.parse import quote

from batch_llm.config import PipelineConfig

SQL_DRIVERS = {"postgres": "postgresql+psycopg2", "postgresql": "postgresql+psycopg2", "mysql": "mysql+pymysql",
               "sqlite": "sqlite"}


def catalog_properties(cfg: PipelineConfig) -> dict[str, str] | None:
    """The catalog properties from the connection; None when the pipeline names no catalog connection."""
    table = cfg.output.table
    if table is None or table.format != "iceberg" or not table.catalog.conn_id:
        return None
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(table.catalog.conn_id)
    if table.catalog.type == "sql":
        driver = SQL_DRIVERS.get(conn.conn_type or "")
        if driver is None:
            raise ValueError(f"output.table.catalog.conn_id {conn.conn_id!r}: a {conn.conn_type!r} connection is "
                             f"not a SQL catalog's database (one of {', '.join(SQL_DRIVERS)})")
        if driver == "sqlite":
            return {"uri": f"sqlite:///{conn.host}"}
        user = quote(conn.login or "", safe="") + (f":{quote(conn.password, safe='')}" if conn.password else "")
        where = (conn.host or "") + (f":{conn.port}" if conn.port else "")
        return {"uri": f"{driver}://{user + '@' if user else ''}{where}/{conn.schema or ''}"}
    props = {k: str(v) for k, v in conn.extra_dejson.items()}
    if host := conn.host or "":  # else the catalog's uri from the YAML stays
        props["uri"] = host if "://" in host else f"{conn.schema or 'https'}://{host}" + (
            f":{conn.port}" if conn.port else "")
    if conn.login:
        props["credential"] = f"{conn.login}:{conn.password or ''}"
    elif conn.password:
        props["token"] = conn.password
    return props
