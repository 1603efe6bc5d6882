"""Reading published tables back with an engine this project did not write: DuckDB's delta and iceberg
extensions, loaded from their wheels (duckdb-ext-*: DuckDB would otherwise download them)."""
from __future__ import annotations

import importlib.util
import os
import sqlite3
from urllib.parse import urlparse


def duckdb_connection(s3=None):
    """A DuckDB connection with delta, iceberg and httpfs loaded offline; ``s3``: a ``tests.s3_server.S3Server``
    whose bucket it reads with a secret of its own."""
    import duckdb

    spec = importlib.util.find_spec("duckdb_ext")
    assert spec is not None and spec.submodule_search_locations, "the duckdb-ext-* wheels are not installed"
    folder = os.path.join(list(spec.submodule_search_locations)[0], "extensions")
    con = duckdb.connect(config={"extension_directory": folder, "autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    for ext in ("httpfs", "delta", "iceberg"):
        con.sql(f"LOAD {ext}")
    if s3 is not None:
        reads_s3(con, s3)
    return con


def reads_s3(con, s3) -> None:
    """Lets ``con`` read the bucket of ``s3`` (a ``tests.s3_server.S3Server``)."""
    con.sql(f"CREATE OR REPLACE SECRET lake (TYPE s3, KEY_ID '{s3.key}', SECRET '{s3.secret}', "
            f"ENDPOINT '{urlparse(s3.endpoint).netloc}', URL_STYLE 'path', USE_SSL false, REGION '{s3.region}')")


def iceberg_metadata(catalog_db: str, identifier: str) -> str:
    """The current metadata file of ``namespace.table`` in a SQLite SQL catalog, read from the catalog's own
    table (what a catalog client resolves the name to)."""
    namespace, _, name = identifier.rpartition(".")
    with sqlite3.connect(catalog_db) as db:
        row = db.execute("SELECT metadata_location FROM iceberg_tables WHERE table_namespace = ? AND table_name = ?",
                         (namespace, name)).fetchone()
    assert row is not None, f"no table {identifier} in {catalog_db}"
    return row[0]


def scan_sql(table: dict) -> str:
    """The DuckDB table function that reads ``table`` ({"format": "delta", "url": ...} or {"format": "iceberg",
    "catalog_db": ..., "identifier": ...}, optional "snapshot_id" for an Iceberg snapshot)."""
    if table["format"] == "delta":
        return f"delta_scan('{table['url']}')"
    meta = iceberg_metadata(table["catalog_db"], table["identifier"])
    at = f", snapshot_from_id => {table['snapshot_id']}" if table.get("snapshot_id") is not None else ""
    return f"iceberg_scan('{meta}'{at})"


def rows_by_day(con, table: dict, columns: str = "id, output") -> dict[str, list[tuple]]:
    """Every row of the table, by ``dt``, sorted."""
    out: dict[str, list[tuple]] = {}
    for row in con.sql(f"SELECT dt, {columns} FROM {scan_sql(table)} ORDER BY ALL").fetchall():
        out.setdefault(row[0], []).append(tuple(row[1:]))
    return out
