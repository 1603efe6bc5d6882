"""output.table: the settings a pipeline gives (refused with the key and the reason), what they resolve to for a run
(the partition values, the catalog's properties, the sink), the catalog connection through Airflow, and the rows'
spool (bounded batches, table-safe types)."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest
from batch_llm.config import ConfigError, parse_config
from batch_llm.io.storage import Location
from batch_llm.layout import RunLayout
from batch_llm.sinks import DeltaSink, IcebergSink, spooled_rows
from batch_llm.sinks.configured import iceberg_catalog_properties, partition_values, run_date, sink_for
from batch_llm.sinks.rows import table_schema


def cfg_of(output: dict, name: str = "reviews"):
    return parse_config({"name": name, "model": {"ref": "org/m"}, "input": {"path": "/data/in.jsonl"},
                         "output": output})


@pytest.mark.parametrize("output, message", [
    ({"path": "/o", "partition": "{ds}", "table": {"format": "delta"}},
     "output.partition '{ds}' is not column=value (dt={ds}): set output.table.partition_columns"),
    ({"path": "s3://lake/o", "table": {"format": "iceberg"}},
     "the default SQLite catalog lives in a local output.path"),
    ({"path": "/o", "table": {"format": "iceberg", "catalog": {"type": "rest"}}}, "a rest catalog needs uri or conn_id"),
    ({"path": "/o", "table": {"format": "iceberg", "name": "reviews"}}, "name the Iceberg table as namespace.table"),
    ({"path": "/o", "table": {"format": "delta", "name": "a.b"}}, "a Delta table is named by its location"),
    ({"path": "/o", "table": {"format": "iceberg", "location": "/t"}}, "an Iceberg table's files go to"),
    ({"path": "/o", "table": {"format": "delta", "retention_hours": 0.5}}, "output.table.retention_hours"),
    ({"path": "/o", "table": {"format": "delta", "partition_columns": {"dt-x": "{ds}"}}}, "partition column 'dt-x'"),
    ({"path": "/o", "table": {"format": "delta", "partition_columns": {"dt": "{day}"}}}, "unknown placeholder {day}"),
    ({"path": "/o", "table": {"format": "parquet"}}, "output.table.format"),
])
def test_settings_a_table_cannot_have_are_refused_naming_the_key(output, message):
    with pytest.raises(ConfigError) as e:
        cfg_of(output)
    assert message in str(e.value)


@pytest.mark.parametrize("template, ds", [("dt={ds}", "2026-11-30"), ("day_{ds}_v{ds}", "2026-12-01"),
                                          ("run={ds}T00", "2026-12-02")])
def test_the_runs_date_is_read_back_from_its_partition(template, ds):
    assert run_date(template, template.format(ds=ds)) == ds


def test_partition_values_from_output_partition_or_the_tables_own_columns(tmp_path):
    plain = cfg_of({"path": str(tmp_path), "table": {"format": "delta"}})
    layout = RunLayout.for_run(plain, run_id="r", ds="2026-11-30")
    assert partition_values(plain, layout) == {"dt": "2026-11-30"}
    own = cfg_of({"path": str(tmp_path), "partition": "day={ds}",
                  "table": {"format": "delta", "partition_columns": {"dt": "{ds}", "region": "eu"}}})
    assert partition_values(own, RunLayout.for_run(own, run_id="r", ds="2026-12-01")) == {
        "dt": "2026-12-01", "region": "eu"}


def test_the_sinks_a_config_names(tmp_path):
    delta = cfg_of({"path": str(tmp_path), "table": {"format": "delta"}})
    sink = sink_for(delta, RunLayout.for_run(delta, run_id="r", ds="2026-11-30"))
    assert isinstance(sink, DeltaSink) and sink.url == f"{tmp_path}/reviews/_table" and sink.partition_columns == ["dt"]
    ice = cfg_of({"path": str(tmp_path), "table": {"format": "iceberg", "commit_attempts": 2}}, name="my-reviews")
    sink = sink_for(ice, RunLayout.for_run(ice, run_id="r", ds="2026-11-30"))
    assert isinstance(sink, IcebergSink) and sink.identifier == "batch_llm.my_reviews" and sink.attempts == 2
    assert sink.properties == {"type": "sql", "uri": f"sqlite:///{tmp_path}/_iceberg/catalog.db",
                               "warehouse": f"file://{tmp_path}/_iceberg/warehouse"}


def test_an_iceberg_warehouse_on_s3_gets_the_outputs_credentials_and_a_connection_wins():
    cfg = cfg_of({"path": "s3://lake/out", "table": {"format": "iceberg",
                                                     "catalog": {"uri": "postgresql+psycopg2://h/cat"}}})
    root = Location("s3://lake/out", {"key": "K", "secret": "S", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}})
    assert iceberg_catalog_properties(cfg, root) == {
        "type": "sql", "uri": "postgresql+psycopg2://h/cat", "warehouse": "s3://lake/out/_iceberg/warehouse",
        "s3.access-key-id": "K", "s3.secret-access-key": "S", "s3.endpoint": "http://127.0.0.1:9000",
        "s3.region": "eu-west-1"}
    assert iceberg_catalog_properties(cfg, root, {"uri": "postgresql+psycopg2://u:p@db/x"})["uri"] == \
        "postgresql+psycopg2://u:p@db/x"


@pytest.mark.parametrize("catalog, conn, expected", [
    ({"type": "sql", "conn_id": "cat"},
     {"conn_type": "postgres", "login": "air flow", "password": "p@ss", "host": "db", "port": 5432, "schema": "meta"},
     {"uri": "postgresql+psycopg2://air%20flow:p%40ss@db:5432/meta"}),
    ({"type": "rest", "conn_id": "cat"},
     {"conn_type": "http", "login": "client", "password": "secret", "host": "catalog.example", "port": 8181,
      "extra": {"warehouse": "lake"}},
     {"uri": "https://catalog.example:8181", "credential": "client:secret", "warehouse": "lake"}),
    ({"type": "rest", "conn_id": "cat"}, {"conn_type": "http", "password": "tok", "host": "http://cat:8181"},
     {"uri": "http://cat:8181", "token": "tok"}),
    ({"type": "rest", "uri": "https://cat.example", "conn_id": "cat"}, {"conn_type": "http", "password": "tok"},
     {"token": "tok"}),   # no host: the YAML's uri stays (iceberg_catalog_properties lays these over it)
])
def test_the_catalog_connection_as_pyiceberg_properties(monkeypatch, catalog, conn, expected):
    pytest.importorskip("airflow")
    from batch_llm_airflow.table_catalog import catalog_properties

    monkeypatch.setenv("AIRFLOW_CONN_CAT", json.dumps(conn))
    cfg = cfg_of({"path": "/o", "table": {"format": "iceberg", "catalog": catalog}})
    assert catalog_properties(cfg) == expected
    assert catalog_properties(cfg_of({"path": "/o", "table": {"format": "delta"}})) is None


def test_the_spool_streams_bounded_batches_again_and_again_with_table_types(tmp_path):
    rows = ({"id": f"r{i}", "n": i, "vec": [0.5, 1.5], "none": None} for i in range(25))
    vec = pa.field("vec", pa.list_(pa.float32(), 2))   # an embedding's fixed width, as publish types it
    with spooled_rows(rows, types=[vec], batch_rows=10, spool_dir=str(tmp_path)) as spooled:
        assert [b.num_rows for b in spooled.batches()] == [10, 10, 5]
        assert sum(b.num_rows for b in spooled.batches()) == 25   # a retry reads them again
        assert spooled.schema.field("vec").type == pa.list_(pa.field("element", pa.float32()))
        assert spooled.schema.field("none").type == pa.null()     # typed by the table it goes into
    assert list(tmp_path.iterdir()) == []                          # the spool is gone with the context


def test_types_no_table_stores_are_mapped():
    schema = table_schema(pa.schema([("u", pa.uint32()), ("s", pa.large_string()),
                                     ("nested", pa.struct([("x", pa.null()), ("l", pa.large_list(pa.uint8()))]))]))
    assert schema.field("u").type == pa.int64() and schema.field("s").type == pa.string()
    assert schema.field("nested").type == pa.struct([("x", pa.string()),
                                                     ("l", pa.list_(pa.field("element", pa.int64())))])
