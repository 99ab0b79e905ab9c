"""The shared components of ``templates/macros.html``: tables, form fields, escaping."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest

from loraplex.webui.context import make_templates


@pytest.fixture(scope="module")
def templates() -> jinja2.Environment:
    return make_templates()


def render(templates: jinja2.Environment, source: str, **context: Any) -> str:
    return templates.from_string(source).render(context)


COLUMNS = [{"key": "name", "label": "Name"}, {"key": "rpm", "label": "Req/min", "numeric": True}]


def test_a_table_labels_every_cell_and_escapes_values(templates: jinja2.Environment) -> None:
    rows = [{"name": "<script>alert(1)</script>", "rpm": 60}, {"name": "beta", "rpm": None}]
    html = render(
        templates, '{% from "macros.html" import table %}{{ table(columns, rows) }}',
        columns=COLUMNS, rows=rows,
    )  # fmt: skip
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count('data-label="Name"') == 2 and html.count('class="num"') == 3
    assert '<th scope="col" class="num">Req/min</th>' in html


def test_a_table_cell_can_be_rendered_by_the_page(templates: jinja2.Environment) -> None:
    source = (
        '{% from "macros.html" import table %}'
        "{% call(row, column) table(columns, rows) %}"
        '{% if column.key == "name" %}<a href="/t/{{ row.name }}">{{ row.name }}</a>'
        "{% else %}{{ row[column.key] }}{% endif %}{% endcall %}"
    )
    html = render(templates, source, columns=COLUMNS, rows=[{"name": "a&b", "rpm": 1}])
    assert '<a href="/t/a&amp;b">a&amp;b</a>' in html


def test_an_empty_table_says_so(templates: jinja2.Environment) -> None:
    source = '{% from "macros.html" import table %}{{ table(columns, [], empty="No tenants.") }}'
    html = render(templates, source, columns=COLUMNS)
    assert '<p class="empty">No tenants.</p>' in html and "<table" not in html


def test_a_field_shows_its_error_inline(templates: jinja2.Environment) -> None:
    source = (
        '{% from "macros.html" import field %}'
        '{{ field("name", "Name", value=v, required=True, error="Use lowercase letters.") }}'
    )
    html = render(templates, source, v='"><img src=x onerror=alert(1)>')
    assert 'value="&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"' in html
    assert 'aria-invalid="true"' in html and 'aria-describedby="f-name-help"' in html
    assert '<p class="field-error" id="f-name-help">Use lowercase letters.</p>' in html
