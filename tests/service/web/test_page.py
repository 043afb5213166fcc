"""The web page in a real headless Chromium against a real server: the chat streams a reply (and asks
for the API key when the server needs one), and the cache view follows the traffic; the heatmap stays
fast at Qwen3-30B-A3B's 48 layers x 128 experts."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.serve_process import ServeProcess

pytest.importorskip("selenium")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Counts the text changes of the newest reply, so the test sees a stream and not one final write.
WATCH_REPLY = """
window.replyUpdates = 0;
new MutationObserver(() => { window.replyUpdates += 1; })
  .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""

# 48 layers x 128 experts: layer 0 dense, layers 1-4 resident, a diagonal band of cached experts.
DRAW_LARGE = """
const [layers, experts, rounds] = [48, 128, 20];
const usage = [], where = [];
for (let l = 0; l < layers; l++) {
  usage.push(Array.from({length: experts}, (_, e) => ((l * 31 + e * 17) % 97) / 9));
  where.push(Array.from({length: experts}, (_, e) =>
    l === 0 ? -1 : l <= 4 ? 2 : Math.abs(e - 2 * l) < 8 ? 1 : 0));
}
const state = {layers, experts, usage, where};
window.moecache.feed.close();
const started = performance.now();
for (let i = 0; i < rounds; i++) window.moecache.heatmap.draw(state);
const data = document.getElementById('heatmap').dataset;
return {meanMs: (performance.now() - started) / rounds, layers: data.layers, experts: data.experts,
        cached: data.cached, resident: data.resident, elements: document.getElementsByTagName('*').length,
        layout: window.moecache.heatmap.layout,
        expectedCached: where.flat().filter((w) => w === 1).length};
"""


def wait_for(driver: Any, predicate: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    logs = driver.get_log("browser")
    raise AssertionError(f"timed out waiting for {what}; browser log: {logs}")


def dataset(driver: Any, element_id: str) -> dict[str, str]:
    return driver.execute_script(f"return Object.assign({{}}, document.getElementById('{element_id}').dataset)")


def canvas_image(driver: Any, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').toDataURL()")


def send(driver: Any, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def test_chat_streams_and_the_cache_view_follows(browser: Any, page_server: ServeProcess, api_key: str,
                                                 tmp_path: Path) -> None:
    browser.get(page_server.url("/"))
    wait_for(browser, lambda: dataset(browser, "heatmap").get("layers") == "8", what="the first cache state")
    assert browser.find_element(By.ID, "status").text == "ok"
    assert "8 layers in host RAM" in browser.find_element(By.ID, "placement").text
    heat_before, draws_before = canvas_image(browser, "heatmap"), int(dataset(browser, "heatmap")["draws"])
    samples_before = int(dataset(browser, "hit-chart").get("samples", "0"))

    # the server needs a key: without one the reply is the 401, shown to the user
    send(browser, "Hello?")
    error = browser.find_element(By.ID, "chat-error")
    wait_for(browser, error.is_displayed, what="the missing-key error")
    assert "API key" in error.text

    browser.find_element(By.ID, "api-key").send_keys(api_key)
    for field, value in (("max-tokens", "48"), ("temperature", "0")):  # greedy: a full-length reply
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.execute_script(WATCH_REPLY)
    send(browser, "Why is the sky blue?")
    reply = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]
    wait_for(browser, lambda: reply.get_attribute("data-state") == "done", 60, "the end of the reply")
    assert reply.find_element(By.CSS_SELECTOR, ".text").text.strip()
    meta = reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert re.fullmatch(r"48 tokens in [\d.]+ s, [\d.]+ tokens/s, finish: length", meta), meta
    assert browser.execute_script("return window.replyUpdates") > 10, "the reply arrived in many pieces"
    assert not error.is_displayed()

    # the heatmap redraws with heat on the experts just used, cached ones marked, and the chart moves.
    # NOTE: a state arrives every 0.5 s: the first redraw may show the prompt step, which caches nothing
    wait_for(browser, lambda: canvas_image(browser, "heatmap") != heat_before, what="a new heatmap")
    wait_for(browser, lambda: int(dataset(browser, "heatmap").get("cached", "0")) > 0, what="cached experts")
    heat = dataset(browser, "heatmap")
    assert int(heat["draws"]) > draws_before and int(heat["active"]) > 0 and int(heat["cached"]) > 0
    wait_for(browser, lambda: int(dataset(browser, "hit-chart").get("samples", "0")) > samples_before,
             what="a hit-ratio sample")
    assert float(browser.find_element(By.ID, "tile-hit").text.rstrip("%")) > 0

    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes().startswith(PNG_MAGIC)


def test_heatmap_draws_48_layers_by_128_experts_fast(browser: Any, page_server: ServeProcess) -> None:
    browser.get(page_server.url("/"))
    wait_for(browser, lambda: dataset(browser, "heatmap").get("layers") == "8", what="the first cache state")
    result = browser.execute_script(DRAW_LARGE)
    assert (result["layers"], result["experts"]) == ("48", "128")
    assert int(result["cached"]) == result["expectedCached"] and int(result["resident"]) == 4 * 128
    assert result["meanMs"] < 50, f"one draw of 6144 experts took {result['meanMs']:.1f} ms"
    assert result["elements"] < 150, "the heatmap is one canvas, not a node per expert"
    # hovering a cell names it: layer 47 (the last row), expert 127 (the last column)
    layout, canvas = result["layout"], browser.find_element(By.ID, "heatmap")
    x = layout["left"] + 127.5 * layout["cellW"] - canvas.size["width"] / 2
    y = layout["top"] + 47.5 * layout["cellH"] - canvas.size["height"] / 2
    ActionChains(browser).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    tip = browser.find_element(By.ID, "heatmap-tip")
    wait_for(browser, tip.is_displayed, 5, "the tooltip")
    assert tip.text.startswith("layer 47, expert 127:")
