"""Headless Chromium driven over the Chrome DevTools Protocol (one WebSocket, flattened target sessions): enough to
open a page, click, read the DOM, grant or deny the microphone and take screenshots. No selenium or playwright:
Debian's `chromium` package and the `websockets` library are all it needs.

    async with Chromium.launch(fake_audio=Path("speech.wav")) as browser:
        page = await browser.new_page()
        await page.navigate("http://127.0.0.1:8765/")
        await page.click("#toggle")
        await page.wait_for("document.querySelectorAll('li.final').length >= 2")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
import tempfile
from pathlib import Path

from websockets.asyncio.client import connect

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CdpError(RuntimeError):
    pass


class Chromium:
    def __init__(self, process: asyncio.subprocess.Process, websocket, profile: tempfile.TemporaryDirectory):
        self.process = process
        self.websocket = websocket
        self.profile = profile
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._listeners: dict[str, list] = {}  # session id -> event handlers
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, *, fake_audio: Path | None = None, fake_ui: bool = True, window=(1100, 820)):
        """Start headless Chromium. fake_audio: a WAV the fake microphone plays (in a loop); fake_ui: accept
        permission prompts without asking (without it, and with no UI to ask, requests are denied)."""
        binary = find_chromium()
        if binary is None:
            raise FileNotFoundError("no Chromium found (Debian: apt-get install chromium)")
        profile = tempfile.TemporaryDirectory(prefix="qasr-chromium-")
        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                "--autoplay-policy=no-user-gesture-required", f"--window-size={window[0]},{window[1]}",
                f"--user-data-dir={profile.name}", "--remote-debugging-port=0"]
        if fake_audio is not None:
            args += ["--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={fake_audio}"]
        if fake_ui:
            args.append("--use-fake-ui-for-media-stream")
        process = await asyncio.create_subprocess_exec(*args, "about:blank", stdout=asyncio.subprocess.DEVNULL,
                                                       stderr=asyncio.subprocess.PIPE)
        browser = None
        try:
            url = await asyncio.wait_for(_devtools_url(process), 30)
            websocket = await connect(url, max_size=None, ping_interval=None)
            browser = cls(process, websocket, profile)
            yield browser
        finally:
            if browser is not None:
                await browser.close()
            elif process.returncode is None:
                process.kill()
                await process.wait()
            profile.cleanup()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("Browser.close"), 5)
        self._reader.cancel()
        with contextlib.suppress(Exception):
            await self.websocket.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()

    async def send(self, method: str, params: dict | None = None, session_id: str | None = None) -> dict:
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        future = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        await self.websocket.send(json.dumps(message))
        return await future

    async def new_page(self) -> "Page":
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        self._listeners[page.session_id] = [page.on_event]
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        return page

    async def set_microphone(self, origin: str, setting: str) -> None:
        """setting: "granted", "denied" or "prompt" for the microphone on `origin`."""
        await self.send("Browser.setPermission", {"permission": {"name": "microphone"}, "setting": setting,
                                                  "origin": origin})

    async def _read(self) -> None:
        async for raw in self.websocket:
            message = json.loads(raw)
            if "id" in message:
                future = self._pending.pop(message["id"], None)
                if future is not None and not future.done():
                    if "error" in message:
                        future.set_exception(CdpError(f"{message['error']}"))
                    else:
                        future.set_result(message.get("result", {}))
            else:
                for handler in self._listeners.get(message.get("sessionId"), []):
                    handler(message["method"], message.get("params", {}))


class Page:
    def __init__(self, browser: Chromium, session_id: str):
        self.browser = browser
        self.session_id = session_id
        self.console: list[str] = []  # console messages and uncaught exceptions, for failure reports
        self._loaded = asyncio.Event()

    def on_event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled":
            self.console.append(f"{params['type']}: " + " ".join(str(arg.get("value", arg.get("description", "")))
                                                                 for arg in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console.append(f"exception: {details.get('exception', {}).get('description', details['text'])}")

    async def send(self, method: str, params: dict | None = None) -> dict:
        return await self.browser.send(method, params, self.session_id)

    async def navigate(self, url: str, timeout: float = 20) -> None:
        self._loaded.clear()
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"cannot open {url}: {result['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), timeout)

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                      "awaitPromise": True})
        if "exceptionDetails" in result:
            raise CdpError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20, interval: float = 0.1):
        """Poll `expression` until it is truthy; returns its value. Fails with the page's console on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                status = await self.evaluate("document.getElementById('status')?.textContent")
                raise AssertionError(f"{expression!r} still false after {timeout} s; status {status!r}; "
                                     f"console: {self.console[-10:]}")
            await asyncio.sleep(interval)

    async def click(self, selector: str) -> None:
        found = await self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                                    "if (!e || e.disabled) return false; e.click(); return true; })()")
        if not found:
            raise AssertionError(f"no enabled element {selector!r} to click")

    async def screenshot(self, path: Path) -> None:
        result = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(result["data"]))


async def _devtools_url(process: asyncio.subprocess.Process) -> str:
    """Chromium prints "DevTools listening on ws://..." on stderr once it can be driven; stderr is drained
    afterwards so a chatty browser never blocks on a full pipe."""
    seen = []
    while True:
        line = await process.stderr.readline()
        if not line:
            raise RuntimeError(f"Chromium exited before it was ready: {b''.join(seen[-20:]).decode(errors='replace')}")
        seen.append(line)
        match = re.search(rb"DevTools listening on (ws://\S+)", line)
        if match:
            asyncio.ensure_future(_drain(process.stderr))
            return match.group(1).decode()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass
