"""The sink ``output.table`` names, for one run's layout: where the table is, its catalog, the partition values.

    sink = sink_for(cfg, layout)                       # DeltaSink or IcebergSink
    values = partition_values(cfg, layout)             # {"dt": "2026-11-30"}

A catalog connection (``output.table.catalog.conn_id``) is resolved by the Airflow layer, which hands its
properties in as ``catalog_properties``; the stage library reads no connection itself.
"""
from __future__ import annotations

import re
from pathlib import Path

from batch_llm.config import ConfigError, PipelineConfig, TableConfig
from batch_llm.host import path_policy
from batch_llm.io.storage import Location
from batch_llm.layout import RunLayout
from batch_llm.sinks.base import TableSink
from batch_llm.sinks.s3 import S3Access, is_s3


def sink_for(cfg: PipelineConfig, layout: RunLayout, *, catalog_properties: dict[str, str] | None = None) -> TableSink:
    """The table sink of ``cfg.output.table`` (which must be set) for the run ``layout`` describes."""
    t = _table(cfg)
    columns = list(partition_columns(cfg))
    if t.format == "delta":
        from batch_llm.sinks.delta import DeltaSink

        loc = Location(t.location, layout.output_root.options) if t.location else \
            layout.pipeline_root.child("_table")
        return DeltaSink(loc.url, loc.options, partition_columns=columns, attempts=t.commit_attempts)
    from batch_llm.sinks.iceberg import IcebergSink

    props = iceberg_catalog_properties(cfg, layout.output_root, catalog_properties)
    return IcebergSink(props, t.name or f"batch_llm.{re.sub(r'[^A-Za-z0-9_]', '_', cfg.name)}",
                       catalog_name=t.catalog.name, partition_columns=columns, attempts=t.commit_attempts)


def iceberg_catalog_properties(cfg: PipelineConfig, output_root: Location,
                               resolved: dict[str, str] | None = None) -> dict[str, str]:
    """pyiceberg's ``load_catalog`` properties: the catalog's type, its URI (``resolved``: from the catalog's
    connection, which wins), the warehouse and its S3 credentials (output.conn_id's)."""
    c = _table(cfg).catalog
    props: dict[str, str] = {"type": c.type}
    if c.uri:
        props["uri"] = c.uri
    elif c.type == "sql" and not (resolved or {}).get("uri"):
        props["uri"] = "sqlite:///" + str(Path(_local(output_root.child("_iceberg", "catalog.db").url)).resolve())
    warehouse = c.warehouse or (output_root.child("_iceberg", "warehouse").url if c.type == "sql" else None)
    if warehouse:
        props["warehouse"] = warehouse if "://" in warehouse else Path(warehouse).resolve().as_uri()
        if is_s3(warehouse):
            props.update(S3Access.of(output_root.options).iceberg_properties())
    props.update(resolved or {})
    return props


def partition_columns(cfg: PipelineConfig) -> dict[str, str]:
    """The table's partition columns and their value templates: ``output.table.partition_columns``, or
    ``output.partition`` read as ``column=value``."""
    t = _table(cfg)
    if t.partition_columns:
        return dict(t.partition_columns)
    column, _, template = cfg.output.partition.partition("=")
    return {column: template}


def partition_values(cfg: PipelineConfig, layout: RunLayout) -> dict[str, str]:
    """This run's partition values: the templates filled with the run's date (read back from its partition
    folder name, which ``RunLayout.for_run`` filled from ``output.partition``)."""
    ds = run_date(cfg.output.partition, layout.partition)
    return {c: template.format(ds=ds) for c, template in partition_columns(cfg).items()}


def run_date(template: str, partition: str) -> str:
    """The ``{ds}`` that filled ``template`` into ``partition`` (``dt={ds}``, ``dt=2026-11-30`` → 2026-11-30)."""
    if "{ds}" not in template:
        return ""
    literal = [re.escape(part) for part in template.split("{ds}")]
    pattern = literal[0] + "(?P<ds>.+?)" + "(?P=ds)".join(literal[1:])  # a second {ds} holds the same date
    m = re.fullmatch(pattern, partition)
    if m is None:
        raise ConfigError(f"output.partition {template!r}: the partition {partition!r} was not filled from it")
    return m.group("ds")


def _table(cfg: PipelineConfig) -> TableConfig:
    if cfg.output.table is None:
        raise ValueError(f"pipeline {cfg.name}: output.table is not set")
    return cfg.output.table


def _local(url: str) -> str:
    resolved = path_policy.resolve(url)
    if not resolved.is_local:
        raise ConfigError(f"output.table.catalog: the default SQLite catalog needs a local output.path, not {url}")
    return str(resolved.local_path)
