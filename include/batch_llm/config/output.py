"""The ``output`` section: where a run writes its artifacts and publishes its dataset, or the Delta or Iceberg table
(and the table's catalog) it publishes into."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from batch_llm.config.section import Section
from batch_llm.host import path_policy


class TableCatalogConfig(Section):
    """The Iceberg catalog that names the table (``output.table.format: iceberg``), through pyiceberg."""

    type: Literal["sql", "rest"] = Field("sql", description="sql: pyiceberg's SQL catalog (SQLite, PostgreSQL); "
                                         "rest: an Iceberg REST catalog")
    uri: str | None = Field(None, description="sql: the catalog database's SQLAlchemy URL (production: "
                            "postgresql+psycopg2://...; default sqlite:///<output.path>/_iceberg/catalog.db, for a "
                            "local output.path); rest: the catalog's URL. conn_id instead keeps credentials out of "
                            "the YAML")
    conn_id: str | None = Field(None, description="An Airflow connection for the catalog: sql, a database "
                                "connection (the Airflow metadata database's PostgreSQL server will do); rest, "
                                "host = the URL, login/password = OAuth2 client id/secret (a password alone: a "
                                "bearer token), extra = more pyiceberg catalog properties")
    warehouse: str | None = Field(None, description="Where the table's data and metadata files go, local or "
                                  "s3:// through output.conn_id; default <output.path>/_iceberg/warehouse (rest: "
                                  "the catalog's own default when unset)")
    name: str = Field("batch_llm", description="The catalog's name (the SQL catalog's catalog_name column)")


class TableConfig(Section):
    """Publish into a table instead of the file versions: each run replaces its partition in one commit."""

    format: Literal["delta", "iceberg"]
    location: str | None = Field(None, description="delta: the table's folder, local or s3:// through "
                                 "output.conn_id; default <output.path>/<pipeline>/_table")
    name: str | None = Field(None, description="iceberg: the table as namespace.table; default "
                             "batch_llm.<pipeline name>")
    catalog: TableCatalogConfig = Field(default_factory=TableCatalogConfig)
    partition_columns: dict[str, str] | None = Field(
        None, description="The table's partition columns and the value each run writes ({ds}: the run's date); "
        "default output.partition read as column=value (dt={ds}: a string column dt)")
    retention_hours: float = Field(168.0, ge=1, description="Delta vacuum / Iceberg snapshot expiry after each "
                                   "publish keep every snapshot younger than this (time travel and running readers "
                                   "need them) and the current one always")
    commit_attempts: int = Field(5, ge=1, description="Times a publish writes its partition again after a "
                                 "concurrent writer's commit to the same table came first, before it fails")

    @field_validator("partition_columns")
    @classmethod
    def _columns_and_templates(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for col, template in (v or {}).items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", col):
                raise ValueError(f"partition column {col!r}: a name of letters, digits and '_'")
            if problem := path_policy.template_problem(template):
                raise ValueError(f"partition column {col!r}: {problem}")
        if v is not None and not v:
            raise ValueError("name at least one partition column, or leave the key out")
        return v

    @field_validator("name")
    @classmethod
    def _namespace_dot_table(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.[A-Za-z0-9_]+", v):
            raise ValueError(f"{v!r}: name the Iceberg table as namespace.table (letters, digits, '_')")
        return v

    @model_validator(mode="after")
    def _keys_of_the_format(self) -> "TableConfig":
        if self.format == "delta" and self.name is not None:
            raise ValueError("name is the Iceberg table's; a Delta table is named by its location")
        if self.format == "iceberg" and self.location is not None:
            raise ValueError("location is the Delta table's; an Iceberg table's files go to catalog.warehouse")
        return self


class OutputConfig(Section):
    """Where a run writes: ``<path>/<pipeline>/runs/<run>/`` for artifacts, ``<path>/<pipeline>/<partition>``
    for the published dataset."""

    path: str
    conn_id: str | None = None
    partition: str = Field("dt={ds}", description="Published partition under the pipeline prefix: one folder "
                           "name (no '/', not '..'); {ds} is the run's date")
    orphan_grace_hours: float = Field(24.0, gt=0, description="A version folder never made current (its "
                                      "publisher was killed) or a temporary file in the partition is removed by "
                                      "the next publish once nothing in it changed for this long")
    table: TableConfig | None = Field(None, description="Publish into a Delta or Iceberg table (the tables "
                                      "extra) instead of the file versions; the run's artifacts stay under path")
    parts: bool = Field(False, description="Publish the version's dataset as one file a shard (data/part-NNNNN.<format>"
                        " in the version), each written by its shard's filter_shard task; publish links them into "
                        "the version and writes the errors, summary and pointer, so no task writes every row. "
                        "Readers take the version's data folder. Not with table")

    @field_validator("partition")
    @classmethod
    def _one_folder_in_the_pipeline(cls, v: str) -> str:
        # filled with the run's date, it names a folder next to runs/: it must not reach out of the pipeline's
        if problem := path_policy.partition_template_problem(v):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _table_partition_and_catalog(self) -> "OutputConfig":
        t = self.table
        if t is None:
            return self
        if self.parts:
            raise ValueError("output.parts: a table's day is one commit of spooled rows here; set parts: false "
                             "with output.table")
        if t.partition_columns is None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", self.partition):
            raise ValueError(f"table: output.partition {self.partition!r} is not column=value (dt={{ds}}): set "
                             "output.table.partition_columns")
        c = t.catalog
        if t.format == "iceberg" and c.type == "sql" and not (c.uri or c.conn_id) \
                and not path_policy.resolve(self.path).is_local:
            raise ValueError("table.catalog: the default SQLite catalog lives in a local output.path; with "
                             f"output.path {self.path!r} set catalog.uri or catalog.conn_id (PostgreSQL)")
        if t.format == "iceberg" and c.type == "rest" and not (c.uri or c.conn_id):
            raise ValueError("table.catalog: a rest catalog needs uri or conn_id")
        return self
