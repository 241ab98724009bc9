"""Headless Chromium (Debian's package, scripts/setup_chromium.sh) driven by Playwright, for the status page's tests."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("no chromium on this machine: bash scripts/setup_chromium.sh installs it")


@contextlib.contextmanager
def chromium_page(url: str, *, headers: dict[str, str] | None = None, screenshot: str | None = None,
                  wait_for: str = "body[data-loaded=true]") -> Iterator[Any]:
    """A page of a fresh headless Chromium (its own user-data dir) at `url`, once `wait_for` matches; the page's
    console errors fail the test. With `screenshot`, a full-page PNG is written there first."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="tiercache-chromium-")
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                profile, executable_path=chromium_binary(), headless=True, args=FLAGS,
                viewport={"width": 1200, "height": 900}, extra_http_headers=headers or {})
            try:
                page = browser.new_page()
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url)
                page.wait_for_selector(wait_for, timeout=30_000)
                if screenshot:
                    page.screenshot(path=screenshot, full_page=True)
                yield page
                assert not errors, errors
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
