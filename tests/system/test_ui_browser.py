"""What a user sees: the real Airflow UI in headless Chromium (Playwright), against real services.

api-server, scheduler and dag-processor run on 127.0.0.1 (``tests/airflow_services.py``) with one pipeline,
``ui_demo`` (dags/pipelines/demo.yaml on 8 sample rows, one shard, the transformers engine). The browser:

1. signs in through the simple auth manager's login form,
2. finds ``ui_demo`` in the DAG list and opens the trigger form: every Param is there with its description,
3. triggers a run from the form (the run is then awaited through the REST API),
4. shows the run's graph, then the publish task's "Run report" extra link, and follows it,
5. sees the report served by the plugin (``include/batch_llm_airflow/report_app.py``): its plots are decoded
   ``data:image/png`` images; a browser that has not signed in gets 401 for the same URL,
6. finds the report again under "Batch LLM reports" (the plugin's view inside the UI).

Screenshots of each step go to ``var/test/screenshots/``. Chromium is Debian's (/usr/bin/chromium, installed
by ``scripts/services.sh browser`` when missing); Playwright drives it, nothing is downloaded.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest
import requests
from airflow_services import ROOT, AirflowServices, print_on_failure, valid_sample_rows

pytestmark = pytest.mark.slow

DAG_ID = "ui_demo"
ROWS = 8
SHOTS = ROOT / "var" / "test" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
# The flags this machine kind needs: no sandbox as root, no GPU, and no background connections (the closed
# network refuses them). Playwright gives every launch a new empty profile (--user-data-dir) of its own.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI_TIMEOUT_MS = 120_000   # a 2-core machine, busy running the task next door: pages may take a while


def write_ui_pipeline(tmp: Path) -> tuple[Path, Path]:
    """dags/pipelines/demo.yaml as ``ui_demo``: absolute input and word-list paths, output under tmp, one shard
    on the transformers engine (starts in seconds; the vLLM path is tests/system/test_pipeline_e2e.py's)."""
    import json

    import yaml

    demo_dir = ROOT / "dags" / "pipelines"
    cfg = yaml.safe_load((demo_dir / "demo.yaml").read_text())
    (tmp / "in").mkdir(parents=True, exist_ok=True)
    prompts = tmp / "in" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in valid_sample_rows()[:ROWS]))
    out = tmp / "out"
    cfg["name"] = DAG_ID
    cfg["description"] = f"UI test: {cfg['description']}"
    cfg["input"]["path"] = str(prompts)
    cfg["output"]["path"] = str(out)
    cfg["sharding"] = {"num_shards": 1}
    cfg["engine"] = {"kind": "transformers", "max_model_len": 1024, "batch_size": 8, "commit_every_rows": 8,
                     "max_error_rate": 0.2}
    cfg["sampling"]["max_tokens"] = 32
    for wl in cfg["filter"]["lists"]:
        if wl["path"].startswith(("./", "../")):
            wl["path"] = str((demo_dir / wl["path"]).resolve())
    cfg["airflow"] = {"schedule": None, "start_date": "2026-01-01", "retries": 1, "retry_delay_seconds": 5,
                      "tags": ["test"]}
    pipelines = tmp / "pipelines"
    pipelines.mkdir(parents=True, exist_ok=True)
    (pipelines / f"{DAG_ID}.yaml").write_text("# tests/system/test_ui_browser.py: dags/pipelines/demo.yaml adjusted\n"
                                              + yaml.safe_dump(cfg, sort_keys=False))
    return pipelines, out


@pytest.fixture(scope="module")
def chromium() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        p = subprocess.run(["bash", str(ROOT / "scripts" / "services.sh"), "browser"], capture_output=True,
                           text=True, timeout=900)
        if p.returncode or not os.access(CHROMIUM, os.X_OK):
            pytest.fail(f"Chromium missing and `scripts/services.sh browser` failed ({p.returncode}):\n"
                        f"{p.stdout}\n{p.stderr}")
    return CHROMIUM


@pytest.fixture(scope="module")
def services(tmp_path_factory, demo_model_dir, request):
    tmp = tmp_path_factory.mktemp("ui_browser")
    pipelines, out = write_ui_pipeline(tmp)
    svc = AirflowServices(tmp, pipelines_dir=pipelines)
    failed_before = request.session.testsfailed
    try:
        svc.start()
        svc.wait_dag_parsed(DAG_ID)
        yield svc, out
    finally:
        print_on_failure(request, svc, failed_before)
        killed = svc.stop()
        print(f"services: {svc.timings}; needed SIGKILL: {killed}")
        assert not svc.procs.marked_pids(), "processes left behind"


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def report_url(base: str, path: str, **extra: str) -> str:
    q = "&".join(f"{k}={quote(v, safe='')}" for k, v in {"path": path, **extra}.items())
    return f"{base}/batch-llm/report?{q}"


def wait_graph(page, timeout: float) -> int:
    """Waits until the graph view shows the task group and its 7 tasks; returns the number of nodes."""
    nodes = page.locator(".react-flow__node")
    deadline = time.monotonic() + timeout
    while nodes.count() < 7 and time.monotonic() < deadline:
        time.sleep(0.5)
    return nodes.count()


def test_report_endpoint_access_rules(services):
    """Without a run: who and what the report endpoint refuses (the browser test below shows the yes)."""
    svc, out = services
    base = svc.base_url
    missing = str(out / DAG_ID / "dt=2026-01-01" / "v-1" / "report.html")
    auth = {"Authorization": f"Bearer {svc.token()}"}

    r = requests.get(report_url(base, missing), timeout=30)
    assert r.status_code == 401, (r.status_code, r.text)
    r = requests.get(report_url(base, missing), headers={"Accept": "text/html"}, timeout=30)
    assert r.status_code == 401 and "/auth/login" in r.text, (r.status_code, r.text)      # a login link
    r = requests.get(report_url(base, missing), headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
    assert r.status_code == 403, (r.status_code, r.text)
    r = requests.get(f"{base}/batch-llm/", timeout=30)
    assert r.status_code == 401, (r.status_code, r.text)

    # signed in: only HTML files under a pipeline's output root; no escapes through '..' or symlinks
    outside = out.parent / "secret.html"
    outside.write_text("<p>not a report</p>")
    (out / DAG_ID).mkdir(parents=True, exist_ok=True)
    link = out / DAG_ID / "link.html"
    if not link.is_symlink():
        link.symlink_to(outside)
    for path, status in [("/etc/passwd", 403), (str(outside), 403), (str(out / DAG_ID / ".." / "x.html"), 403),
                         (str(link), 403), (str(out / DAG_ID / "dt=x" / "data.jsonl"), 403),
                         ("s3://bucket/anything/report.html", 403), (missing, 404)]:
        r = requests.get(report_url(base, path), headers=auth, timeout=30)
        assert r.status_code == status, (path, r.status_code, r.text)
    r = requests.get(f"{base}/batch-llm/", headers=auth, timeout=30)
    assert r.status_code == 200 and "Batch LLM reports" in r.text, (r.status_code, r.text)

    # the plugin as Airflow lists it: the apps (reports, OpenAI Batch API), the nav entry; the "Run report" link is
    # PublishOperator's own (listed in the provider info's extra-links), no longer repeated by the plugin
    plugins = {p["name"]: p for p in svc.api("GET", "plugins")["plugins"]}
    p = plugins["batch_llm"]
    assert [a["url_prefix"] for a in p["fastapi_apps"]] == ["/batch-llm", "/openai"], p
    assert [v["name"] for v in p["external_views"]] == ["Batch LLM reports"], p
    assert p["operator_extra_links"] == [], p


def test_trigger_from_ui_and_open_run_report(services, browser):
    from playwright.sync_api import expect

    svc, out = services
    base = svc.base_url
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    expect.set_options(timeout=UI_TIMEOUT_MS)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def shot(name: str, **kw) -> Path:
        path = SHOTS / f"{name}.png"
        page.screenshot(path=str(path), **kw)
        return path

    # 1. sign in: the UI sends an anonymous visitor to the simple auth manager's login form
    page.goto(f"{base}/")
    page.wait_for_url(re.compile(r"/auth/login"))
    expect(page.locator("input[name=username]")).to_be_visible()
    shot("01-login")
    page.locator("input[name=username]").fill("admin")
    page.locator("input[name=password]").fill(svc.password)
    page.locator("button[type=submit]").click()
    page.wait_for_url(lambda u: "/auth/login" not in u)
    assert any(c["name"] == "_token" for c in ctx.cookies()), ctx.cookies()
    timings["login"] = time.monotonic() - t0

    # 2. the DAG list, then the pipeline's DAG
    page.goto(f"{base}/dags")
    dag_link = page.get_by_role("link", name=DAG_ID, exact=True).first
    expect(dag_link).to_be_visible()
    shot("02-dags-list")
    dag_link.click()
    page.wait_for_url(re.compile(rf"/dags/{DAG_ID}(/|$|\?)"))

    # 3. the trigger form: every Param with its description, the YAML's values as defaults
    from batch_llm_airflow.params import PARAM_KEYS

    first_param = next(iter(PARAM_KEYS.values()))[2]
    for attempt in range(3):
        # The form sometimes opens before the DAG's params have loaded (seen in CI): if the fields are not
        # there, unfold "Run Parameters", and failing that reopen the form on a fresh page.
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.get_by_role("dialog")
        expect(dialog).to_be_visible()
        expect(dialog.get_by_text("Run Parameters")).to_be_visible()
        field = dialog.get_by_text(first_param, exact=True)
        try:
            expect(field).to_be_visible(timeout=20_000)
            break
        except AssertionError:
            dialog.get_by_text("Run Parameters").first.click()
            try:
                expect(field).to_be_visible(timeout=10_000)
                break
            except AssertionError:
                shot(f"03-trigger-form-attempt{attempt + 1}")
                page.keyboard.press("Escape")
                page.reload()
    for _key, _type, description in PARAM_KEYS.values():
        expect(dialog.get_by_text(description, exact=True)).to_be_visible()
    expect(dialog.get_by_text("transformers", exact=True).first).to_be_visible()        # engine default
    temperature = dialog.get_by_text("Sampling temperature; 0 is greedy", exact=True)
    temperature.scroll_into_view_if_needed()
    shot("03-trigger-form")
    # the whole form, top to bottom: a viewport tall enough for the dialog, then back
    page.set_viewport_size({"width": 1400, "height": 2600})
    dialog.get_by_text(f"Trigger Dag - {DAG_ID}").scroll_into_view_if_needed()
    time.sleep(0.5)
    dialog.screenshot(path=str(SHOTS / "03-trigger-form-dialog.png"))
    page.set_viewport_size({"width": 1400, "height": 900})
    unpause = dialog.get_by_role("checkbox", name=re.compile("Unpause"))
    if unpause.count() and not unpause.is_checked():
        unpause.check()
    dialog.get_by_role("button", name="Trigger").click()
    # the UI goes to the new run's page
    page.wait_for_url(re.compile(rf"/dags/{DAG_ID}/runs/[^/?]+"))
    run_id = unquote(re.search(rf"/dags/{DAG_ID}/runs/([^/?]+)", page.url).group(1))
    runs = svc.dag_runs(DAG_ID)
    assert [r["dag_run_id"] for r in runs] == [run_id], runs
    assert runs[0]["run_type"] == "manual", runs
    timings["triggered"] = time.monotonic() - t0

    # 4. wait for the run (REST API), then its graph
    svc.wait_run(DAG_ID, run_id, timeout=1200)
    timings["run_done"] = time.monotonic() - t0
    run_page = f"{base}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"
    page.goto(run_page)
    page.get_by_role("button", name=re.compile("Show Graph")).click()
    expect(page.locator(".react-flow__node").first).to_be_visible()
    # The pipeline's tasks sit in a task group, drawn collapsed: expand it once the graph is drawn.
    expand = page.get_by_role("button", name="Expand all task groups")
    deadline = time.monotonic() + 30
    while page.locator(".react-flow__node").count() < 7 and time.monotonic() < deadline:
        if expand.count() and expand.first.is_visible():
            expand.first.click()
        time.sleep(1)
    nodes = wait_graph(page, 60)
    assert nodes >= 7, f"graph shows {nodes} nodes"
    expect(page.locator(".react-flow").get_by_text("publish", exact=True)).to_be_visible()
    time.sleep(1)   # fit-view animation
    shot("04-run-graph")

    # 5. the publish task's "Run report" extra link (task instance, Details tab), followed in the browser
    page.goto(f"{run_page}/tasks/pipeline.publish/details")
    link = page.get_by_role("link", name="Run report")
    expect(link).to_be_visible()
    wait_graph(page, 30)   # the UI keeps the graph mode: let it draw before the screenshot
    href = link.get_attribute("href")
    assert href and href.startswith("/batch-llm/report?path="), href
    report_path = parse_qs(urlsplit(href).query)["path"][0]
    assert report_path.startswith(str(out / DAG_ID)) and report_path.endswith("/report.html"), report_path
    assert Path(report_path).is_file(), report_path
    shot("05-publish-extra-link")
    with page.expect_response(lambda r: "/batch-llm/report" in r.url) as resp_info:
        link.click()
    resp = resp_info.value
    assert resp.status == 200, (resp.status, resp.text()[:500])
    assert "script-src" not in resp.headers.get("content-security-policy", "x") and \
        "default-src 'none'" in resp.headers.get("content-security-policy", ""), resp.headers
    page.wait_for_url(re.compile(r"/batch-llm/report\?"))
    expect(page.locator("h1")).to_contain_text(DAG_ID)
    images = page.locator('img[src^="data:image/png;base64,"]')
    expect(images.first).to_be_visible()
    decoded = page.eval_on_selector_all('img[src^="data:image/png"]',
                                        "els => els.filter(e => e.complete && e.naturalWidth > 0).length")
    assert images.count() >= 3 and decoded == images.count(), (images.count(), decoded)
    shot("06-run-report")
    shot("06-run-report-full", full_page=True)
    timings["report"] = time.monotonic() - t0

    # the same URL: 401 for a browser that has not signed in, and for a plain request without a token
    anon = browser.new_context()
    anon_page = anon.new_page()
    anon_resp = anon_page.goto(f"{base}{href}")
    assert anon_resp.status == 401 and "log in" in anon_page.content(), anon_resp.status
    anon.close()
    assert requests.get(f"{base}{href}", timeout=30).status_code == 401
    ok = requests.get(f"{base}{href}", headers={"Authorization": f"Bearer {svc.token()}"}, timeout=60)
    assert ok.status_code == 200 and "data:image/png;base64," in ok.text

    # 6. "Batch LLM reports" in the UI's navigation: the plugin's list, inside the UI, links this report, and
    #    the report opens there too
    page.goto(f"{base}/plugin/batch-llm-reports")
    frame = page.frame_locator("iframe").first
    expect(frame.get_by_role("link", name=re.compile(r"^v-"))).to_have_count(1)
    assert quote(report_path, safe="") in (frame.get_by_role("link").first.get_attribute("href") or "")
    shot("07-reports-list")
    frame.get_by_role("link", name=re.compile(r"^v-")).click()       # opens in place, inside the UI
    expect(frame.locator("h1")).to_contain_text(DAG_ID)
    expect(frame.locator('img[src^="data:image/png;base64,"]').first).to_be_visible()
    shot("08-report-inside-ui")

    ctx.close()
    print(f"page errors: {errors}" if errors else "no page errors")
    print(f"ui timings (s since start of test): { {k: round(v, 1) for k, v in timings.items()} }; "
          f"screenshots in {SHOTS}")
