"""common-ai parity of ``GPULLMBatchOperator`` / ``@task.gpu_llm_batch``, without an engine.

Compared against apache-airflow-providers-common-ai 1.0.0: ``exceptions.py`` (the ``LLMBatch*`` classes and their
bases), ``operators/llm_batch.py`` (``_raise_if_partial``: ``LLMBatchPartialFailureError``, retryable, state kept),
``batch/openai.py`` (``response_format`` of OpenAI's json_schema shape; rows of a failed request:
``type: provider_error``, ``stage: provider``) and ``decorators/llm_batch.py`` (built by ``task_decorator_factory``,
so ``.partial()`` / ``.expand()`` work). The mapped batch run on the transformers engine, and the one task switched
between the two decorators, are in tests/system/test_llm_batch_conventions.py (the example DAG).
"""
from __future__ import annotations

import datetime as dt
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KW = dict(result_path="/tmp/r/{{ run_id }}", model_id="/models/m", config_overrides={"engine.kind": "transformers"})
SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Label", "schema": SCHEMA, "strict": False}}


def _common_ai_stub() -> types.ModuleType:
    """common-ai 1.0.0's exceptions.py, the batch classes (same names and bases)."""
    m = types.ModuleType("common_ai_exceptions_stub")
    m.LLMBatchInputError = type("LLMBatchInputError", (ValueError,), {})
    for name in ("LLMBatchModelMismatchError", "UnsupportedBatchProviderError", "LLMBatchOutputTypeError"):
        setattr(m, name, type(name, (m.LLMBatchInputError,), {}))
    m.LLMBatchJobError = type("LLMBatchJobError", (RuntimeError,), {})
    for name in ("LLMBatchPartialFailureError", "LLMBatchStateReadError"):
        setattr(m, name, type(name, (m.LLMBatchJobError,), {}))
    return m


def test_errors_are_common_ais_names_and_subclass_common_ais_classes():
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm_airflow.llm_batch import as_common_ai, common_ai_errors

    theirs = _common_ai_stub()
    for cls in llm_batch.COMMON_AI_ERRORS:  # the stage library's: common-ai's names, common-ai's bases
        assert cls.__name__ in vars(theirs)
        assert issubclass(cls, ValueError if issubclass(getattr(theirs, cls.__name__), ValueError) else RuntimeError)

    made = common_ai_errors(theirs)  # with common-ai installed: subclasses of theirs as well
    assert set(made) == set(llm_batch.COMMON_AI_ERRORS) and common_ai_errors(None) == {}
    mm = made[llm_batch.LLMBatchModelMismatchError]
    assert issubclass(mm, theirs.LLMBatchModelMismatchError) and issubclass(mm, theirs.LLMBatchInputError)
    assert issubclass(mm, llm_batch.LLMBatchModelMismatchError) and issubclass(mm, made[llm_batch.LLMBatchInputError])
    with pytest.raises(theirs.LLMBatchPartialFailureError, match="3 missing") as e:
        with as_common_ai(made):
            raise llm_batch.LLMBatchPartialFailureError("3 missing")
    assert isinstance(e.value, llm_batch.LLMBatchJobError) and type(e.value).__name__ == "LLMBatchPartialFailureError"
    with pytest.raises(theirs.UnsupportedBatchProviderError, match="hosted model"):  # a parse-time refusal
        with as_common_ai(made):
            llm_batch.batch_config(name="t", model_id="openai:gpt-5", result_path="/r", max_tokens=8,
                                   output=llm_batch.OutputType.of(str))
    with pytest.raises(KeyError):  # anything else passes through untouched
        with as_common_ai(made):
            raise KeyError("x")


def test_where_each_error_is_raised():
    from airflow.sdk import DAG
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm.io.storage import Location

    with pytest.raises(llm_batch.LLMBatchModelMismatchError):
        llm_batch.request_problem(llm_batch.BatchRequest(prompt="x", model="other"), "/models/m")
    with pytest.raises(llm_batch.LLMBatchOutputTypeError):
        llm_batch.OutputType.of(type("Plain", (), {}))
    with pytest.raises(llm_batch.LLMBatchStateReadError, match="cannot read the batch's state"):
        llm_batch.read_batch(Location("/nonexistent/state"), "k" * 16, "f" * 16)
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    with DAG("errors", start_date=dt.datetime(2026, 1, 1), schedule=None):
        with pytest.raises(llm_batch.UnsupportedBatchProviderError):
            GPULLMBatchOperator(task_id="t", requests=["x"], result_path="/r", model_id="openai:gpt-5-mini")


def test_response_format_is_the_output_schema(tmp_path):
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm.io.storage import Location

    text, typed = llm_batch.OutputType.of(str), llm_batch.OutputType.of(int)

    def cfg(output, rf, kind="transformers"):
        return llm_batch.batch_config(name="t", model_id="/models/m", result_path=str(tmp_path), max_tokens=8,
                                      output=output, overrides={"engine.kind": kind}, response_format=rf)

    assert llm_batch.response_format_schema(RESPONSE_FORMAT) == SCHEMA
    assert llm_batch.response_format_schema({"type": "json_object"}) == {"type": "object"}
    assert llm_batch.response_format_schema({"type": "text"}) is None is llm_batch.response_format_schema(None)
    for bad in ({"type": "json_schema"}, {"type": "xml"}, "json", {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": 5}}}):
        with pytest.raises(llm_batch.LLMBatchOutputTypeError):
            llm_batch.response_format_schema(bad)
    # output_type=str: the response_format decides; transformers only checks, vLLM decodes under it
    checked = cfg(text, RESPONSE_FORMAT)
    assert checked.sampling.output_schema == SCHEMA and not checked.sampling.guided_decoding
    assert cfg(text, RESPONSE_FORMAT, "vllm").sampling.guided_decoding
    assert cfg(text, None).sampling.output_schema is None
    # a structured output_type wins, as common-ai's directive comes after request_params
    assert cfg(typed, RESPONSE_FORMAT).sampling.output_schema == typed.json_schema
    # the schema is part of what names the batch; the body carries no response_format (the engine row would refuse)
    key = llm_batch.identity_key(dag_id="d", task_id="t", run_id="r")
    state = Location(str(tmp_path)).child(llm_batch.STATE_DIR)
    reqs = ["a", {"prompt": "same", "params": {"response_format": RESPONSE_FORMAT}},
           {"prompt": "other", "params": {"response_format": {"type": "json_object"}}}]
    batch = llm_batch.prepare(checked, state, key=key, requests=llm_batch.normalize_requests(reqs),
                              request_params={"response_format": RESPONSE_FORMAT, "temperature": 0.0})
    plain = llm_batch.prepare(cfg(text, None), state, key=key, requests=llm_batch.normalize_requests(["a"]))
    assert batch.layout.run_dir != plain.layout.run_dir
    bodies = [line for line in Path(batch.manifest.requests).read_text().splitlines()]
    assert len(bodies) == 2 and all("response_format" not in b for b in bodies)
    refused = Path(batch.manifest.refused).read_text()
    assert batch.manifest.refused_count == 1 and "another schema than the batch's" in refused


def test_a_batch_refuses_a_filter_it_would_not_run(tmp_path):
    """A batch lands the shards' results as they are: an override that turns the content filter on (its masks
    would never be applied) is refused, not ignored."""
    from batch_llm.config import ConfigError
    from batch_llm.frontends import common_ai as llm_batch

    def cfg(overrides):
        return llm_batch.batch_config(name="t", model_id="/models/m", result_path=str(tmp_path), max_tokens=8,
                                      output=llm_batch.OutputType.of(str), overrides=overrides)

    assert not cfg({}).filter.enabled
    with pytest.raises(ConfigError, match="filter.enabled: a batch lands the model's results as they are"):
        cfg({"filter.enabled": True})


def test_operator_and_decorator_map_like_common_ais():
    from airflow.sdk import DAG, task
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    with DAG("mapped", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        op = GPULLMBatchOperator.partial(task_id="classify", output_type=int, **KW).expand(
            requests=[["a"], ["b", "c"]])
        kw_op = GPULLMBatchOperator.partial(task_id="by_kwargs", **KW).expand_kwargs(
            [{"requests": ["a"], "system_prompt": "Be brief."}, {"requests": ["b"]}])

        @task.gpu_llm_batch(**KW)
        def build(rows: list[str], prefix: str) -> list[str]:
            return [prefix + r for r in rows]

        manifests = build.partial(prefix="p:").expand(rows=[["x"], ["y"]])
        plain = build(["z"], prefix="q:")

        @task
        def read(ms: list[dict]) -> int:
            return len(list(ms))

        read(manifests)
        with pytest.raises(TypeError, match="cannot expand output_type"):
            GPULLMBatchOperator.partial(task_id="bad", requests=["x"], **KW).expand(output_type=[int, str])
        with pytest.raises(TypeError, match="given to .partial"):
            GPULLMBatchOperator.partial(task_id="bad2", requests=["x"], **KW).expand(requests=[["y"]])
        with pytest.raises(TypeError, match="requests or input_path"):
            GPULLMBatchOperator.partial(task_id="bad3", **KW).expand(system_prompt=["a"])
    for name in ("classify", "by_kwargs", "build"):
        plan, land = dag.get_task(f"{name}.plan_shards"), dag.get_task(name)
        assert type(plan).__name__ in ("MappedOperator", "DecoratedMappedOperator") and land.is_mapped
        assert dag.get_task(f"{name}.fetch_model").is_mapped
        assert dag.get_task(f"{name}.shards").upstream_task_ids == {f"{name}.plan_shards", f"{name}.fetch_model"}
        infer = dag.get_task(f"{name}.batch_inference")
        assert infer.is_mapped and (infer.pool, infer.queue) == ("gpu", "gpu")
    assert op.task_id == "classify" and op.output.operator is dag.get_task("classify")
    assert manifests.operator is dag.get_task("build") and "build" in dag.get_task("read").upstream_task_ids
    assert dag.get_task("build.plan_shards").partial_kwargs["op_kwargs"] == {"prefix": "p:"}
    assert not dag.get_task("build__1").is_mapped and plain.operator.task_id == "build__1"
    assert kw_op.plan.expand_input.value[0]["system_prompt"] == "Be brief."

    from airflow.serialization.serialized_objects import DagSerialization

    DagSerialization.to_dict(dag)  # what the DAG processor stores: mapped batches serialize


def test_the_example_task_switches_provider_by_one_line():
    """One decorated task (``build_summary_requests``), called and mapped, under ``task.gpu_llm_batch`` or
    common-ai's ``task.llm_batch``: the DAG is the same but for the decorator line (``LLM_BATCH_BACKEND``)."""
    sys.path.insert(0, str(ROOT / "dags"))
    import example_llm_batch_switch as example

    gpu = example.build_dag("gpu", dag_id="switch_gpu")
    mapped = gpu.get_task("summaries_by_group")
    assert mapped.is_mapped and gpu.get_task("summaries_by_group.plan_shards").is_mapped
    assert gpu.get_task("count_mapped").upstream_task_ids == {"summaries_by_group"}
    source = Path(example.__file__).read_text()
    assert source.count("def build_summary_requests") == 1 and source.count("reviews=[REVIEWS[:2], REVIEWS[2:]]") == 1
    pytest.importorskip("airflow.providers.common.ai", reason="common-ai is not installed here "
                        "(tests/system/test_provider_wheel.py parses the example with both providers)")
    hosted = example.build_dag("common_ai", dag_id="switch_common_ai")
    assert hosted.get_task("summaries_by_group").is_mapped
    assert hosted.get_task("count_mapped").upstream_task_ids == {"summaries_by_group"}


def _attr(task, name):
    """A task's argument, mapped or not (a MappedOperator keeps the .partial() ones in partial_kwargs)."""
    kwargs = getattr(task, "partial_kwargs", None)
    if kwargs is not None and name in kwargs:
        return kwargs[name]
    return getattr(task, name)


def test_task_arguments_land_where_their_meaning_is():
    """The batch's outcome (outlets, inlets, callbacks) on the landing task alone, its start (trigger_rule,
    on_execute_callback) on the plan task alone, the rest on every task; unmapped and mapped, operator and
    decorator. On the old code every task of the group got every argument: plan_shards updated the Asset."""
    from airflow.sdk import DAG, Asset, task
    from batch_llm_airflow.llm_batch import BATCH_OUTCOME_ARGS, BATCH_START_ARGS, GPULLMBatchOperator

    asset, source = Asset("s3://lake/llm/classified"), Asset("s3://lake/reviews")
    alert, started, retried = (lambda ctx: None), (lambda ctx: None), (lambda ctx: None)
    args = dict(outlets=[asset], inlets=[source], on_failure_callback=alert, on_success_callback=alert,
                on_retry_callback=retried, on_execute_callback=started, trigger_rule="all_done", retries=3,
                execution_timeout=dt.timedelta(minutes=30), owner="ml", pool="cpu_pool", priority_weight=7)
    with DAG("routing", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        GPULLMBatchOperator(task_id="op", requests=["x"], **args, **KW)
        GPULLMBatchOperator.partial(task_id="mapped", **args, **KW).expand(requests=[["a"], ["b"]])

        @task.gpu_llm_batch(**args, **KW)
        def deco(rows: list[str]) -> list[str]:
            return rows

        deco(["y"])
        deco.override(task_id="deco_mapped").expand(rows=[["c"]])
    assert {"outlets", "inlets", "on_failure_callback"} <= BATCH_OUTCOME_ARGS and "trigger_rule" in BATCH_START_ARGS
    for name in ("op", "mapped", "deco", "deco_mapped"):
        group = [t for t in dag.tasks if t.task_id == name or t.task_id.startswith(f"{name}.")]
        land, plan = dag.get_task(name), dag.get_task(f"{name}.plan_shards")
        assert len(group) >= 4, [t.task_id for t in group]
        assert _attr(land, "outlets") == [asset] and _attr(land, "inlets") == [source], name
        assert _attr(land, "on_failure_callback") in (alert, [alert]), name
        assert _attr(land, "on_retry_callback") in (retried, [retried]), name
        assert _attr(plan, "on_execute_callback") in (started, [started]), name
        assert str(_attr(plan, "trigger_rule")) in ("all_done", "TriggerRule.ALL_DONE"), name
        for t in group:
            assert _attr(t, "retries") == 3 and _attr(t, "owner") == "ml", t.task_id
            assert _attr(t, "execution_timeout") == dt.timedelta(minutes=30), t.task_id
            assert _attr(t, "priority_weight") == 7, t.task_id
            if t is not land:
                assert not _attr(t, "outlets") and not _attr(t, "inlets"), t.task_id
                assert not _attr(t, "on_failure_callback") and not _attr(t, "on_success_callback"), t.task_id
                assert not _attr(t, "on_retry_callback"), t.task_id
            if t is not plan:
                assert not _attr(t, "on_execute_callback"), t.task_id
            if t.task_id.endswith(".batch_inference"):  # the shards: the config's GPU pool and queue
                assert (_attr(t, "pool"), _attr(t, "queue")) == ("gpu", "gpu"), t.task_id
            else:
                assert _attr(t, "pool") == "cpu_pool", t.task_id
        # the landing task's trigger rule is its own: after every shard (unmapped: all_done, and it checks)
        assert str(_attr(land, "trigger_rule")).endswith(("all_done", "ALL_DONE", "none_failed", "NONE_FAILED"))
    assert str(_attr(dag.get_task("op"), "trigger_rule")).lower().endswith("all_done")
    assert str(_attr(dag.get_task("mapped"), "trigger_rule")).lower().endswith("none_failed")

    from airflow.serialization.serialized_objects import DagSerialization

    DagSerialization.to_dict(dag)


def test_plan_and_fetch_tasks_carry_no_outlets():
    """The Asset a downstream DAG is scheduled on is updated by the landing task alone (the old code put the
    outlets on every task, so plan_shards updated it before any result existed)."""
    from airflow.sdk import DAG, Asset
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    asset = Asset("file:///tmp/llm/landed")
    with DAG("outlets", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        GPULLMBatchOperator(task_id="classify", requests=["x"], outlets=[asset], **KW)
    with_outlets = sorted(t.task_id for t in dag.tasks if _attr(t, "outlets"))
    assert with_outlets == ["classify"]
    assert not dag.get_task("classify.plan_shards").outlets and not dag.get_task("classify.fetch_model").outlets


def test_the_batch_is_airflows_own_task_group():
    """``GPULLMBatchOperator`` builds Airflow's ``TaskGroup`` (no dependency methods of its own): ``a >> batch >> b``
    is the group's protocol, ``a`` before the plan task and ``b`` after the landing task, mapped or not; its
    ``task_id`` and ``output`` are the landing task's, as common-ai's one task's are."""
    from airflow.sdk import DAG, TaskGroup
    from airflow.sdk.bases.operator import BaseOperator
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    class Noop(BaseOperator):
        def execute(self, context):
            return None

    with DAG("grouped", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        a, b = Noop(task_id="a"), Noop(task_id="b")
        batch = GPULLMBatchOperator(task_id="classify", requests=["x"], **KW)
        mapped = GPULLMBatchOperator.partial(task_id="many", **KW).expand(requests=[["y"], ["z"]])
        a >> batch >> b
        [a] >> mapped >> [b]
    for group, name in ((batch, "classify"), (mapped, "many")):
        assert isinstance(group, TaskGroup) and dag.task_group.children[f"{name}_gpu_batch"] is group
        assert [t.task_id for t in group.roots] == [f"{name}.plan_shards"]
        assert [t.task_id for t in group.leaves] == [name] and group.task_id == name
        assert dag.get_task(f"{name}.plan_shards").upstream_task_ids == {"a"}
        assert group.output.operator is dag.get_task(name)
    assert dag.get_task("b").upstream_task_ids == {"classify", "many"}
    own = vars(GPULLMBatchOperator)
    assert not {"__rshift__", "__lshift__", "set_upstream", "set_downstream", "update_relative"} & set(own)
