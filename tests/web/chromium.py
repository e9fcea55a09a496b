"""The system's headless Chromium (Debian's `chromium` package) driven through Playwright's Python API: no browser
download, `executable_path=` points Playwright's driver (Node, inside the playwright wheel) at the installed
binary. What the browser tests need beyond Playwright itself: the fake microphone's launch flags, the page's
console kept for failure reports, and a wait that says what the page showed when it times out.

    async with launch(fake_audio=Path("speech.wav")) as browser:     # a Playwright BrowserContext
        page = await browser.new_page()
        await page.goto("http://127.0.0.1:8765/")
        await page.click("#toggle")
        await wait_for(page, "document.querySelectorAll('li.final').length >= 2")
"""

from __future__ import annotations

import contextlib
import shutil
import weakref
from pathlib import Path
from typing import AsyncIterator

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_MS = 20_000  # Playwright's default for clicks and navigation (30 s) is longer than these pages need

_consoles: "weakref.WeakKeyDictionary[object, list[str]]" = weakref.WeakKeyDictionary()


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@contextlib.asynccontextmanager
async def launch(*, fake_audio: Path | None = None, fake_ui: bool = True,
                 window: tuple[int, int] = (1100, 820)) -> AsyncIterator:
    """Headless Chromium and one browser context. fake_audio: a WAV the fake microphone plays (in a loop);
    fake_ui: accept permission prompts without asking (without it, and with no UI to ask, what the context's
    permissions say holds: Playwright's `grant_permissions` / `clear_permissions`)."""
    from playwright.async_api import async_playwright

    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError("no Chromium found (Debian: apt-get install chromium)")
    args = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-extensions",
            "--autoplay-policy=no-user-gesture-required"]
    if fake_audio is not None:
        args += ["--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={fake_audio}"]
    if fake_ui:
        args.append("--use-fake-ui-for-media-stream")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=binary, headless=True, args=args)
        try:
            context = await browser.new_context(viewport={"width": window[0], "height": window[1]})
            context.set_default_timeout(TIMEOUT_MS)
            context.on("page", _keep_console)
            yield context
        finally:
            await browser.close()


def console_of(page) -> list[str]:
    """The page's console messages and uncaught exceptions ("exception: ..."), oldest first."""
    return _consoles.setdefault(page, [])


def _keep_console(page) -> None:
    lines = console_of(page)
    page.on("console", lambda message: lines.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: lines.append(f"exception: {error}"))


async def wait_for(page, expression: str, timeout: float = 20, interval: float = 0.1):
    """Poll `expression` until it is truthy; returns its value. Fails with the page's status line and console on
    timeout."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    try:
        handle = await page.wait_for_function(expression, timeout=timeout * 1e3, polling=interval * 1e3)
    except PlaywrightTimeout:
        status = await page.evaluate("document.getElementById('status')?.textContent")
        raise AssertionError(f"{expression!r} still false after {timeout} s; status {status!r}; "
                             f"console: {console_of(page)[-10:]}") from None
    return await handle.json_value()
