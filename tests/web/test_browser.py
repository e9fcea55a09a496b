"""The demo page in Debian's headless Chromium, driven through Playwright (tests/web/chromium.py), against
a running qasr server: the fake microphone plays espeak-ng speech into the page, which streams it through its
AudioWorklet and shows partials, then finals with times, language and latency. Also: a denied microphone shows the
denied state, a server that goes away shows the dropped state, and Reconnect resumes against a restarted server;
a server that requires an API key: the page asks for one, says when it is missing or wrong, and streams with a key
or a minted token sent as a subprotocol; "Word times" asks for words and shows each final's (times on hover), and on a
server without an aligner the page streams without them and disables the toggle, saying why.

Skips (saying why) without Chromium (Debian: apt-get install chromium) or espeak-ng.
`QASR_UPDATE_SCREENSHOT=1 pytest tests/web/test_browser.py -k transcribes` rewrites docs/demo-page.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request

import pytest
import soundfile

from qasr.streaming.settings import StreamLimits, StreamSettings

# tests/ is on sys.path (tests/conftest.py); tests/web is put there by pytest for this file's folder
from chromium import console_of, find_chromium, launch, wait_for
from fakes import FakeEngine, speech_like
from live_server import REPO, WEB_ROOT, ThreadedServer, real_engine, requiring_key, spoken_wav

pytestmark = pytest.mark.skipif(find_chromium() is None,
                                reason="no Chromium: apt-get install chromium (headless browser tests)")

SENTENCES = ["streaming speech recognition in the browser", "every pause ends a segment"]
SCREENSHOT = REPO / "docs" / "demo-page.png"
STATE = "document.body.dataset.state"
ITEMS = """[...document.querySelectorAll('#transcript li')].map(li => ({
    segment: Number(li.dataset.segment), kind: li.className, partials: Number(li.dataset.partials || 0),
    time: li.querySelector('.time').textContent, language: li.querySelector('.language').textContent,
    text: li.querySelector('.text').textContent, latency: li.querySelector('.latency').textContent}))"""

STYLES = """Object.fromEntries(['partial', 'final'].map(kind => {
    const style = getComputedStyle(document.querySelector(`#transcript li.${kind} .text`));
    return [kind, {style: style.fontStyle, color: style.color}];
}))"""


async def listening_page(browser, server, prepare: str | None = None):
    """The demo page, opened and started: `prepare` (a script) runs before the click, then it is listening."""
    page = await browser.new_page()
    await page.goto(server.http_url + "/")
    if prepare is not None:
        await page.evaluate(prepare)
    assert await page.evaluate(STATE) == "idle"
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'listening'")
    return page


def run(coroutine, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def test_the_page_transcribes_the_microphone_with_partials_then_finals(tiny_model_dir, tmp_path):
    truth = spoken_wav(tmp_path / "speech.wav", SENTENCES, lead_s=1.0, pause_s=1.2, tail_s=1.5)
    defaults = StreamSettings(partial_interval_ms=500)  # several partials per utterance

    async def main(server: ThreadedServer):
        async with launch(fake_audio=tmp_path / "speech.wav") as browser:
            page = await listening_page(browser, server)
            level = await wait_for(page, "document.getElementById('level').value > 0.3")  # the meter moves
            await wait_for(page, f"document.querySelectorAll('#transcript li.final').length >= {len(truth)}",
                           timeout=45)
            items = await page.evaluate(ITEMS)
            # the file loops: the next utterance shows as a partial, styled apart from the finals
            await wait_for(page, "document.querySelector('#transcript li.partial')?.dataset.partials >= 1")
            styles = await page.evaluate(STYLES)
            await page.screenshot(path=tmp_path / "page.png", full_page=True)
            await page.click("#toggle")  # stop: `end`, the last finals, close 1000
            await wait_for(page, f"{STATE} === 'idle'")
            return items, level, styles, console_of(page)

    with ThreadedServer(lambda: real_engine(tiny_model_dir), web_root=WEB_ROOT, defaults=defaults) as server:
        items, level, styles, console = run(main(server))
    finals = [item for item in items if item["kind"].startswith("final")]
    assert [item["segment"] for item in finals[:len(truth)]] == list(range(len(truth)))
    for item, (start, end) in zip(finals, truth):
        assert item["partials"] >= 1, item  # it was shown as a partial before its final replaced it
        shown_start, shown_end = map(float, re.fullmatch(r"([\d.]+)–([\d.]+) s", item["time"]).groups())
        assert shown_end - shown_start == pytest.approx(end - start + 0.3, abs=0.6)  # + pre-roll
        assert re.fullmatch(r"server \d+ ms · \d+ ms after the speech ended", item["latency"]), item
        assert item["language"]  # a language name, or "—" when the model named none (random weights)
    assert level is True
    assert styles["partial"] != styles["final"] and styles["partial"]["style"] == "italic"
    assert not [line for line in console if line.startswith("exception")], console
    if os.environ.get("QASR_UPDATE_SCREENSHOT"):
        SCREENSHOT.write_bytes((tmp_path / "page.png").read_bytes())


def test_a_denied_microphone_and_a_dropped_socket_show_their_states(tmp_path):
    audio, _ = speech_like([("silence", 0.5), ("speech", 1.0), ("silence", 1.0)])
    soundfile.write(str(tmp_path / "bursts.wav"), audio, 16000, subtype="PCM_16")

    async def main():
        with ThreadedServer(lambda: FakeEngine(delay_s=0.005), web_root=WEB_ROOT) as first:
            port, origin = first.port, first.http_url
            # no --use-fake-ui-for-media-stream: the page gets what the permission says, nothing is auto-accepted
            async with launch(fake_audio=tmp_path / "bursts.wav", fake_ui=False) as browser:
                page = await browser.new_page()
                await page.goto(origin + "/")
                await browser.clear_permissions()  # not granted, and no UI to ask: the request is denied
                await page.click("#toggle")
                await wait_for(page, f"{STATE} === 'denied'")
                denied = await page.evaluate("document.getElementById('status').textContent")
                assert first.num_connections() == 0  # no stream without a microphone

                await browser.grant_permissions(["microphone"], origin=origin)
                await page.click("#toggle")
                await wait_for(page, f"{STATE} === 'listening'")
                await asyncio.to_thread(first.stop)  # the server goes away mid-stream (1001)
                await wait_for(page, f"{STATE} === 'dropped'")
                dropped = await page.evaluate("document.getElementById('status').textContent")
                reconnect_shown = await page.evaluate("!document.getElementById('reconnect').hidden")
                await page.screenshot(path=tmp_path / "dropped.png", full_page=True)

                with ThreadedServer(lambda: FakeEngine(delay_s=0.005), web_root=WEB_ROOT, port=port):
                    await page.click("#reconnect")
                    await wait_for(page, f"{STATE} === 'listening'")
                    await wait_for(page, "document.querySelectorAll('#transcript li.final').length >= 1",
                                   timeout=20)
                    await page.click("#toggle")
                    await wait_for(page, f"{STATE} === 'idle'")
                return denied, dropped, reconnect_shown

    denied, dropped, reconnect_shown = run(main())
    assert "denied" in denied
    assert "lost" in dropped and "1001" in dropped and "shutting down" in dropped and reconnect_shown


RESAMPLE = """(async () => {
  // one second of a tone at `rate` through the capture worklet, offline; the RMS of its 16 kHz s16le output
  const rms = async (rate, frequency) => {
    const context = new OfflineAudioContext({numberOfChannels: 1, length: rate, sampleRate: rate});
    await context.audioWorklet.addModule('capture-worklet.js');
    const node = new AudioWorkletNode(context, 'qasr-capture', {processorOptions: {targetRate: 16000, chunkMs: 100}});
    const chunks = [];
    node.port.onmessage = ({data}) => chunks.push(new Int16Array(data.pcm));
    const buffer = context.createBuffer(1, rate, rate);
    const samples = buffer.getChannelData(0);
    for (let i = 0; i < rate; i++) samples[i] = 0.5 * Math.sin(2 * Math.PI * frequency * i / rate);
    const source = new AudioBufferSourceNode(context, {buffer});
    source.connect(node).connect(context.destination);
    source.start();
    await context.startRendering();
    await new Promise(resolve => setTimeout(resolve, 100));  // the last chunks' messages
    const out = chunks.flatMap(chunk => [...chunk]).slice(800);  // past the filter's start-up
    return {count: chunks.length, rms: Math.sqrt(out.reduce((sum, x) => sum + (x / 32768) ** 2, 0) / out.length)};
  };
  return {pass48: await rms(48000, 1000), stop48: await rms(48000, 12000),
          pass44: await rms(44100, 1000), stop44: await rms(44100, 12000), same16: await rms(16000, 1000)};
})()"""


def test_the_capture_worklet_downsamples_to_16k_without_aliasing():
    async def main():
        with ThreadedServer(lambda: FakeEngine(), web_root=WEB_ROOT) as server:
            async with launch() as browser:
                page = await browser.new_page()
                await page.goto(server.http_url + "/")
                return await page.evaluate(RESAMPLE)

    result = run(main())
    tone_rms = 0.5 / 2 ** 0.5
    for rate in ("48", "44"):
        assert result[f"pass{rate}"]["count"] >= 9  # ~10 chunks of 100 ms from one second
        assert result[f"pass{rate}"]["rms"] == pytest.approx(tone_rms, rel=0.02)  # speech band passes as is
        assert result[f"stop{rate}"]["rms"] < tone_rms / 100  # 12 kHz would alias to 4 kHz: at least -40 dB
    assert result["same16"]["rms"] == pytest.approx(tone_rms, rel=0.01)  # 16 kHz in: passed through


def test_a_microphone_context_below_16k_is_declared_at_its_own_rate(tmp_path):
    """An AudioContext under 16 kHz (a Bluetooth headset in call mode runs at 8 kHz) cannot be downsampled: the page
    must tell the server the real rate, or the model hears the speech at double speed and every time is halved."""
    audio, truth = speech_like([("silence", 1.0), ("speech", 1.5), ("silence", 1.5)], sample_rate=16000)
    soundfile.write(tmp_path / "burst.wav", audio, 16000, subtype="PCM_16")
    force_8k = """(() => {
      const Original = window.AudioContext;
      window.AudioContext = function () { return new Original({sampleRate: 8000}); };
      return true;
    })()"""

    async def main(server: ThreadedServer):
        async with launch(fake_audio=tmp_path / "burst.wav") as browser:
            page = await listening_page(browser, server, force_8k)
            await wait_for(page, "document.querySelectorAll('#transcript li.final').length >= 1", timeout=30)
            items = await page.evaluate(ITEMS)
            await page.click("#toggle")
            await wait_for(page, f"{STATE} === 'idle'")
            return items

    with ThreadedServer(lambda: FakeEngine(delay_s=0.005), web_root=WEB_ROOT) as server:
        items = run(main(server))
    final = next(item for item in items if item["kind"].startswith("final"))
    heard_s = float(final["text"].rstrip("s"))  # the fake engine's transcript is the length of the audio it got
    (start, end), = truth
    assert heard_s == pytest.approx(end - start + 0.3, abs=0.4)  # + pre-roll


# Test instruments, installed before Start: a tap worklet beside the capture worklet counts the input frames the
# capture was handed (same graph, same render quanta) until frozen; the socket's received events are kept.
INSTRUMENT = """(() => {
  const tapModule = URL.createObjectURL(new Blob([`
    registerProcessor('qasr-test-tap', class extends AudioWorkletProcessor {
      constructor() {
        super();
        this.frames = 0;
        this.frozen = false;
        this.port.onmessage = () => { this.frozen = true; this.port.postMessage(this.frames); };
      }
      process(inputs) {
        if (!this.frozen && inputs[0].length) this.frames += inputs[0][0].length;
        return true;
      }
    });`], {type: 'text/javascript'}));
  const addModule = AudioWorklet.prototype.addModule;
  AudioWorklet.prototype.addModule = async function (url, options) {
    await addModule.call(this, tapModule);
    return addModule.call(this, url, options);
  };
  const OriginalNode = window.AudioWorkletNode;
  window.AudioWorkletNode = class extends OriginalNode {
    constructor(context, name, options) {
      super(context, name, options);
      if (name !== 'qasr-capture') return;
      window.qasrCapture = this;
      window.qasrTap = new OriginalNode(context, 'qasr-test-tap');
      window.qasrTap.connect(context.destination);  // rendered like the capture; it outputs silence
    }
  };
  const connect = AudioNode.prototype.connect;
  AudioNode.prototype.connect = function (destination, ...rest) {
    if (destination === window.qasrCapture) connect.call(this, window.qasrTap);
    return connect.call(this, destination, ...rest);
  };
  window.qasrEvents = [];
  const OriginalSocket = window.WebSocket;
  window.WebSocket = class extends OriginalSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', (message) => window.qasrEvents.push(JSON.parse(message.data)));
    }
  };
  return true;
})()"""

# Stop ~50 ms after a chunk left the worklet, so about half a chunk is still being filled there; the tap is frozen
# in the same task as the click: what it counted is the audio captured until stop.
STOP_MID_CHUNK = """(async () => {
  await new Promise((resolve) => window.qasrCapture.port.addEventListener('message',
                                                                         () => setTimeout(resolve, 50), {once: true}));
  const counted = new Promise((resolve) => { window.qasrTap.port.onmessage = ({data}) => resolve(data); });
  window.qasrTap.port.postMessage('freeze');
  document.getElementById('toggle').click();
  return {frames: await counted, rate: window.qasrTap.context.sampleRate};
})()"""


def test_stop_sends_every_captured_sample_before_end(tmp_path):
    """Stop mid-chunk: the worklet's partly filled chunk and any chunk still on its way to the page are sent
    before `end`, so the server hears everything the microphone captured until Stop (within one 10 ms frame).
    The test's tap freezes its count a moment before the capture hears Stop (their messages reach the audio thread
    in different render quanta, ~3 ms each, more on a loaded host), so the server may hear a little more than
    counted, never less; half a 100 ms chunk still catches a chunk sent twice."""
    audio, _ = speech_like([("silence", 0.5), ("speech", 3.0), ("silence", 0.5)])
    soundfile.write(str(tmp_path / "speech.wav"), audio, 16000, subtype="PCM_16")

    async def main(server: ThreadedServer):
        async with launch(fake_audio=tmp_path / "speech.wav") as browser:
            page = await listening_page(browser, server, INSTRUMENT)
            await asyncio.sleep(1.5)
            captured = await page.evaluate(STOP_MID_CHUNK)
            await wait_for(page, f"{STATE} === 'idle'")
            events = await page.evaluate("window.qasrEvents")
            return captured, events, console_of(page)

    with ThreadedServer(lambda: FakeEngine(delay_s=0.005), web_root=WEB_ROOT) as server:
        captured, events, console = run(main(server))
    summary = events[-1]
    assert summary["type"] == "summary", events[-3:]
    captured_s = captured["frames"] / captured["rate"]
    assert captured_s > 1.0
    heard_s = summary["audio_seconds"]
    assert captured_s - 0.01 <= heard_s <= captured_s + 0.05, (summary, captured, console)


KEY = "browser-test-key-0123456789"
STATUS = "document.getElementById('status').textContent"
FINALS = "document.querySelectorAll('#transcript li.final').length"
# Before the page's own script: the subprotocol each socket the page opens was answered with, once open.
RECORD_PROTOCOLS = """window.qasrProtocols = [];
const RecordingSocket = window.WebSocket;
window.WebSocket = class extends RecordingSocket {
  constructor(...args) {
    super(...args);
    this.addEventListener('open', () => window.qasrProtocols.push(this.protocol));
  }
};"""


def mint_token(server: ThreadedServer) -> str:
    request = urllib.request.Request(server.http_url + "/v1/tokens?ttl_s=60", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["token"]


async def refused(page, says: str) -> str:
    """Start, then wait until the page says why the server refused it."""
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'unauthorized' && {STATUS}.includes({json.dumps(says)})")
    return await page.evaluate(STATUS)


async def streams(page, at_least_finals: int) -> None:
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'listening'")
    await wait_for(page, f"{FINALS} >= {at_least_finals}", timeout=20)
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'idle'")


def test_a_server_that_requires_a_key_asks_for_one_and_streams_with_a_key_or_a_token(tmp_path):
    audio, _ = speech_like([("silence", 0.5), ("speech", 1.0), ("silence", 1.0)])
    soundfile.write(str(tmp_path / "burst.wav"), audio, 16000, subtype="PCM_16")

    async def main(server: ThreadedServer):
        async with launch(fake_audio=tmp_path / "burst.wav") as browser:
            await browser.add_init_script(RECORD_PROTOCOLS)
            page = await browser.new_page()
            await page.goto(server.http_url + "/")
            seen = {"field hidden at first": await page.evaluate("document.getElementById('credential-field').hidden")}
            seen["no key"] = await refused(page, "requires an API key")
            seen["field shown"] = not await page.evaluate("document.getElementById('credential-field').hidden")
            seen["connections"] = server.num_connections()
            await page.fill("#credential", "wrong-key-0123456789abc")
            seen["wrong key"] = await refused(page, "did not accept this API key")
            await page.fill("#credential", "a key, with spaces")
            seen["unsendable"] = await refused(page, "cannot send this key")

            await page.fill("#credential", KEY)
            await streams(page, 1)
            seen["stored"] = await page.evaluate(
                "[sessionStorage.getItem('qasr.credential'), localStorage.length, document.cookie]")
            seen["key protocols"] = await page.evaluate("window.qasrProtocols")
            await page.reload()  # the same tab keeps the key (sessionStorage), and shows the field with it
            seen["after reload"] = await page.evaluate(
                "[document.getElementById('credential').value, document.getElementById('credential-field').hidden]")

            token = await asyncio.to_thread(mint_token, server)
            await page.fill("#credential", token)
            await streams(page, 1)
            await page.fill("#credential", "v1.eyJrIjoiYSIsImUiOjF9.forged")
            seen["bad token"] = await refused(page, "did not accept this token")
            seen["protocols"] = await page.evaluate("window.qasrProtocols")
            seen["token"] = token
            seen["console"] = console_of(page)
            return seen

    with ThreadedServer(lambda: FakeEngine(delay_s=0.005), web_root=WEB_ROOT, security=requiring_key(KEY)) as server:
        seen = run(main(server))
    assert seen["field hidden at first"] and seen["field shown"] and seen["connections"] == 0
    assert seen["no key"].startswith("This server requires an API key: paste a key or a token")
    assert "(401)" in seen["wrong key"] and "wrong-key" not in seen["wrong key"]
    assert "token from POST /v1/tokens" in seen["unsendable"]
    assert seen["stored"] == [KEY, 0, ""]  # this tab only: no localStorage, no cookie
    assert seen["after reload"] == [KEY, False]
    assert seen["key protocols"] == [f"qasr.key.{KEY}"]  # the server echoed the subprotocol that carried the key
    assert seen["protocols"] == [f"qasr.token.{seen['token']}"]  # since the reload: the token's stream
    assert "expired" in seen["bad token"]
    assert not [line for line in seen["console"] if line.startswith("exception")], seen["console"]


# Before the page's own script: every text frame the page sends (start, end), parsed.
RECORD_SENT = """window.qasrSent = [];
const sendFrame = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === 'string') window.qasrSent.push(JSON.parse(data));
  return sendFrame.call(this, data);
};"""
WORDS = """[...document.querySelectorAll('#transcript li.final')].map(li => ({
    time: li.querySelector('.time').textContent,
    words: [...li.querySelectorAll('.word')].map(w => ({
        text: w.textContent, title: w.title, start: Number(w.dataset.start), end: Number(w.dataset.end)}))}))"""
TOGGLE = """({checked: document.getElementById('words').checked, disabled: document.getElementById('words').disabled,
           title: document.getElementById('words-field').title})"""


async def stream_with_word_times(browser, server: ThreadedServer) -> dict:
    """A fresh page: tick "Word times", stream until a final, stop. What the page showed and sent."""
    page = await browser.new_page()
    await page.goto(server.http_url + "/")
    seen = {"toggle before": await page.evaluate(TOGGLE)}
    await page.check("#words")
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'listening'")
    seen["toggle while listening"] = await page.evaluate(TOGGLE)
    seen["status"] = await page.evaluate(STATUS)
    await wait_for(page, f"{FINALS} >= 1", timeout=20)
    await page.hover("#transcript li.final .word, #transcript li.final .text")
    await page.click("#toggle")
    await wait_for(page, f"{STATE} === 'idle'")
    seen.update(finals=await page.evaluate(WORDS), sent=await page.evaluate("window.qasrSent"),
                toggle=await page.evaluate(TOGGLE), console=console_of(page))
    return seen


def test_word_times_show_on_each_final_and_a_server_without_an_aligner_disables_the_toggle(tmp_path):
    audio, _ = speech_like([("silence", 0.5), ("speech", 1.2), ("silence", 1.0)])
    soundfile.write(str(tmp_path / "burst.wav"), audio, 16000, subtype="PCM_16")

    async def main(timed: ThreadedServer, untimed: ThreadedServer):
        async with launch(fake_audio=tmp_path / "burst.wav") as browser:
            await browser.add_init_script(RECORD_SENT)
            return await stream_with_word_times(browser, timed), await stream_with_word_times(browser, untimed)

    fake = lambda: FakeEngine(delay_s=0.005)  # noqa: E731 (its words: the transcript's, spread over the segment)
    with ThreadedServer(fake, web_root=WEB_ROOT, stream_limits=StreamLimits(word_times=True)) as timed, \
            ThreadedServer(fake, web_root=WEB_ROOT) as untimed:
        with_aligner, without = run(main(timed, untimed))

    title = with_aligner["toggle"]["title"]
    assert with_aligner["toggle before"] == {"checked": False, "disabled": False, "title": title}
    assert with_aligner["toggle while listening"]["disabled"]  # a stream's words are fixed at its start
    assert with_aligner["toggle"] == {"checked": True, "disabled": False, "title": title} and "hover" in title
    assert [frame["type"] for frame in with_aligner["sent"]] == ["start", "end"]
    assert with_aligner["sent"][0]["words"] is True
    for final in with_aligner["finals"]:
        start, end = map(float, re.fullmatch(r"([\d.]+)–([\d.]+) s", final["time"]).groups())
        assert final["words"], final  # the fake engine's transcript is one word: the segment's length
        for word in final["words"]:
            assert start - 0.01 <= word["start"] <= word["end"] <= end + 0.01
            assert word["title"] == f"{word['start']:.2f}–{word['end']:.2f} s"
    assert not [line for line in with_aligner["console"] if line.startswith("exception")], with_aligner["console"]

    # no aligner: the start that asked is refused (1003), the page asks again without words and says so
    assert [(frame["type"], frame.get("words")) for frame in without["sent"]] == [("start", True), ("start", None),
                                                                                 ("end", None)]
    assert "Word times are off: this server has no aligner." in without["status"]
    assert without["toggle"]["checked"] is False and without["toggle"]["disabled"] is True
    assert "no forced aligner" in without["toggle"]["title"] and "--aligner" in without["toggle"]["title"]
    assert without["finals"] and not any(final["words"] for final in without["finals"])
    assert not [line for line in without["console"] if line.startswith("exception")], without["console"]
