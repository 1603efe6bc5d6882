"""The Airflow layer of batch_llm: thin operators over the stage library, a task group, the DAG factory
and the UI plugin. No stage logic lives here."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

# The lowest Airflow whose public API this provider uses (airflow.sdk's TriggerRule, AirflowFailException and
# configuration, determine_kwargs in airflow.sdk.bases.decorator: 3.2.0), and with universal-pathlib >= 0.3 as
# the stage library needs (3.1 pins < 0.3). pyproject.toml's `airflow` extra says the same to pip;
# tests/system/test_airflow_floor.py runs the demo DAG on exactly this version.
MIN_AIRFLOW = "3.2.0"


def _release(v: str) -> tuple[int, ...]:
    m = re.match(r"\d+(?:\.\d+)*", v)
    if m is None:
        raise RuntimeError(f"batch-llm's Airflow provider cannot read the release of Airflow version {v!r}; it needs "
                           f"apache-airflow>={MIN_AIRFLOW}")
    return tuple(int(x) for x in m.group().split("."))


def check_airflow_version(found: str | None) -> None:
    """Raises when ``found`` (an installed Airflow's version) is older than ``MIN_AIRFLOW``; a pre-release of
    the floor itself is older too."""
    if found is None:
        return
    release, floor = _release(found), _release(MIN_AIRFLOW)
    if release < floor or (release == floor and re.search(r"(a|b|rc|dev)\d*$", found)):
        raise RuntimeError(f"batch-llm's Airflow provider needs apache-airflow>={MIN_AIRFLOW}; this environment has "
                           f"{found} (the stage library, batch_llm, also runs without Airflow)")


def _installed_airflow() -> str | None:
    try:
        return version("apache-airflow-core")
    except PackageNotFoundError:
        return None


check_airflow_version(_installed_airflow())
