"""The chat page at `/` of `moaspec serve`, in a real browser: headless Chromium (Debian's, `make browser`)
driven by playwright, against the API on loopback over SmolLM2 with the lookup drafter.

The streamed answer must be the API's own for the same request (the page is only a client), its tokens
shaded by who wrote them with the round on hover, the figures filled; Stop must end the generation on the
server; a second turn carries the first; any error the page raises fails the test.
`MOASPEC_PAGE_SCREENSHOT=docs/chat-page.png` also saves a screenshot of an answer (the README's).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
from servers import Running

from experiments.shaping import ShapingProxy
from moaspec.decoding.engine import GenerationConfig
from moaspec.link.protocol import Limits
from moaspec.models.runtime import Transformer
from moaspec.models.store import weights_fingerprint
from moaspec.pipeline import SpecDecoder
from moaspec.serving.openai_api import ApiLimits, create_app
from moaspec.serving.target_server import TargetServer, load_encoders

SMOL = "smollm2-135m"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# where `make browser` can install Debian's chromium (root, apt-get), its absence fails the tests; elsewhere they skip
ROOT_WITH_APT = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make setup installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None and not ROOT_WITH_APT,
                                reason="no Chromium here, and not root with apt-get: `make browser` installs Debian's "
                                "chromium as root")


@pytest.fixture(scope="session", autouse=True)
def _chromium_here():
    """On a root + apt-get machine without chromium: fail at once, before the model and servers are built."""
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH, though this is root with apt-get: `make browser` installs Debian's "
                    "(apt-get install chromium) and failed or was not run", pytrace=False)


# a prompt whose answer repeats what it was given: the lookup drafter's drafts are accepted there
PROMPT = "Repeat this list three times, one item per line: apple, banana, cherry, date."
FOLLOW_UP = "Now write it in reverse order."
N = 48


@pytest.fixture(scope="module")
def served(dec_lookup):
    app = create_app(dec_lookup, SMOL, limits=ApiLimits(max_prompt_tokens=512, max_tokens=512))
    run = Running(app)
    yield app.state.api, run
    run.stop()


@pytest.fixture(scope="module")
def remote_served(smol_folder):
    """The API on a device whose target is a `serve-target` server behind a proxy that can cut the link."""
    model = Transformer(smol_folder)
    fp = weights_fingerprint(smol_folder)
    target = TargetServer(model, SMOL, fp, "page-token", load_encoders(model, SMOL, fp),
                          Limits(max_prompt_tokens=512, max_seq_len=1024), pass_costs={1: 10.0, 2: 10.2, 4: 10.8})
    target_run = Running(target.app, scheme="ws")
    with ShapingProxy(("127.0.0.1", target_run.port)) as proxy:
        dec = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token="page-token",
                          tree="adaptive:4", target_timeout_s=2)
        app = create_app(dec, SMOL)
        run = Running(app)
        yield run, proxy
        run.stop()
        app.state.api.close()
        dec.close()
    target_run.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


def _open(browser, url: str):
    """The page at `url`, loaded; every page error or console error is collected, and fails the test."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.goto(url + "/")
    page.wait_for_function("document.querySelectorAll('#drafter option').length > 1")
    yield page
    ctx.close()
    assert not errors, errors


@pytest.fixture
def page(browser, served):
    yield from _open(browser, served[1].url)


@pytest.fixture
def remote_page(browser, remote_served):
    yield from _open(browser, remote_served[0].url)


def _ask(page, prompt: str, max_tokens: int = N, temperature: float = 0.0) -> None:
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def _answer(page, index: int, state: str = "done") -> str:
    msg = page.locator(".msg.assistant").nth(index)
    msg.locator(f"xpath=self::*[@data-state='{state}']").wait_for(timeout=120_000)
    return "".join(msg.locator(".tokens .tok").all_text_contents())


def _api(served, messages: list[dict], max_tokens: int = N) -> dict:
    r = httpx.post(served[1].url + "/v1/chat/completions", timeout=120, json={
        "model": SMOL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "drafter": "lookup"})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_page_streams_the_apis_answer_with_shaded_tokens(page, served):
    _ask(page, PROMPT)
    text = _answer(page, 0)
    first = _api(served, [{"role": "user", "content": PROMPT}])
    assert text == first["choices"][0]["message"]["content"] and text

    msg = page.locator(".msg.assistant").first
    origins = set(msg.locator(".tokens .tok").evaluate_all("els => els.map(e => e.dataset.origin)"))
    assert {"target", "lookup"} <= origins, origins  # the target's own tokens and accepted drafts
    tips = msg.locator(".tokens .tok").evaluate_all("els => els.map(e => e.dataset.tip)")
    assert all(t.startswith("round ") for t in tips)
    msg.locator(".tokens .tok[data-origin=lookup]").first.hover()  # hovering a token shows its round
    assert page.is_visible("#tip") and "lookup's draft, accepted" in page.text_content("#tip")
    shaded = msg.locator(".tokens .tok[data-origin=lookup]").first.evaluate(
        "e => getComputedStyle(e).backgroundColor")
    assert shaded not in ("rgba(0, 0, 0, 0)", "transparent")
    legend = page.locator("#legend .tok").evaluate_all("els => els.map(e => e.dataset.origin)")
    assert {"target", "lookup", "unverified"} <= set(legend)
    calls = int(page.text_content("#fig-calls"))
    assert 0 < calls < first["usage"]["completion_tokens"]  # drafts were accepted: fewer calls than tokens
    assert float(page.text_content("#fig-tau")) > 1.0 and float(page.text_content("#fig-tps")) > 0
    assert page.text_content("#fig-link") == "local"
    assert "drafter lookup" in msg.locator(".meta").text_content()

    # a second turn carries the first
    _ask(page, FOLLOW_UP)
    second = _answer(page, 1)
    want = _api(served, [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UP}])
    assert second == want["choices"][0]["message"]["content"]

    if path := os.environ.get("MOASPEC_PAGE_SCREENSHOT"):
        page.screenshot(path=path)

    page.click("#reset")
    assert page.locator(".msg").count() == 0


def test_stop_ends_the_generation_on_the_server(page, served):
    api, run = served
    before = httpx.get(run.url + "/health").json()["cancelled"]
    _ask(page, "Write a long story about a lighthouse keeper.", max_tokens=500, temperature=0.8)
    page.locator(".msg.assistant .tokens .tok").nth(3).wait_for(timeout=60_000)
    page.click("#stop")
    stopped = _answer(page, 0, state="stopped")
    assert stopped and page.locator(".msg.assistant .meta").text_content().endswith("stopped")
    deadline = time.time() + 30
    while httpx.get(run.url + "/health").json()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(run.url + "/health").json()["cancelled"] == before + 1
    assert api.gen.admission.holders == 0  # its place was given back
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_unverified_tokens_are_marked_then_corrected_in_place(remote_page, remote_served, dec_none):
    """Client-server: the link to the target is cut mid-answer; the drafter writes on alone, its tokens
    shown as unverified and the link as away; when the target is back they are verified or corrected in
    place, and the answer is plain greedy decoding's, with nothing left unverified."""
    run, proxy = remote_served
    page = remote_page
    assert page.text_content("#fig-link") == "connected"
    # record what the page showed on the way: unverified tokens, and the link's states
    page.evaluate("""() => {
        window.seen = {unverified: 0, links: new Set()};
        new MutationObserver(() => {
            window.seen.unverified = Math.max(window.seen.unverified,
                document.querySelectorAll('.msg.assistant .tok.unverified').length);
            window.seen.links.add(document.getElementById('fig-link').textContent);
        }).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    prompt = "Write a Python function that returns the squares of a list of numbers."
    _ask(page, prompt, max_tokens=64)
    page.locator(".msg.assistant .tokens .tok").nth(6).wait_for(timeout=60_000)
    proxy.down("refuse")
    threading.Timer(1.5, proxy.up).start()
    text = _answer(page, 0)
    want = dec_none.generate([{"role": "user", "content": prompt}], GenerationConfig(max_new_tokens=64))
    assert text == want.text
    seen = page.evaluate("() => ({unverified: window.seen.unverified, links: [...window.seen.links]})")
    assert seen["unverified"] > 0 and "away" in seen["links"], seen
    assert page.locator(".msg.assistant .tok.unverified").count() == 0
    assert page.locator(".msg.assistant .tok.resynced").count() > 0  # the text the target re-stated
    assert page.text_content("#fig-link") == "connected"
