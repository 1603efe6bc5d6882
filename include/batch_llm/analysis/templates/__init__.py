"""The HTML pages (run report, report index) as jinja2 templates, autoescaped: a value is text unless the code
that built it made it ``Markup``."""
from __future__ import annotations

from functools import cache

import jinja2


@cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("batch_llm.analysis", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def render(name: str, **context) -> str:
    return environment().get_template(name).render(**context)
