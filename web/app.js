// The qasr demo page: microphone -> AudioWorklet (16 kHz s16le) -> WebSocket /v1/stream -> transcript.
// The protocol is docs/protocol.md: a `start` text frame, binary PCM frames, `end`; events come back as JSON.
// A server that requires API keys (docs/security.md): a browser cannot set headers, so the key or token the
// person pastes goes as the `qasr.key.KEY` / `qasr.token.TOKEN` subprotocol; it is kept in sessionStorage only.
// Word times (a server started with --aligner): `ready.limits.words` says whether the server has an aligner; until
// a stream has told the page, a checked "Word times" asks, and a server without one (it refuses the stream with
// 1003 unsupported) is asked again at once without words, the toggle then disabled with a tooltip saying why.

const SAMPLE_RATE = 16000;
const CHUNK_MS = 100;
const FLUSH_TIMEOUT_MS = 1000; // for the worklet's last samples at Stop
const KEY_PREFIX = "qasr.key.";
const TOKEN_PREFIX = "qasr.token.";
const TOKEN_START = "v1."; // what tokens from POST /v1/tokens look like
const CREDENTIAL_STORE = "qasr.credential"; // sessionStorage: gone when the tab closes, never sent elsewhere
const SUBPROTOCOL_CHARS = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/; // what a Sec-WebSocket-Protocol value can carry
const LANGUAGES = ["Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese",
  "Indonesian", "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish", "Hindi", "Malay",
  "Dutch", "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino", "Persian", "Greek", "Romanian",
  "Hungarian", "Macedonian"];

const $ = (id) => document.getElementById(id);
const ui = {
  toggle: $("toggle"), reconnect: $("reconnect"), language: $("language"), context: $("context"),
  level: $("level"), status: $("status"), transcript: $("transcript"), empty: $("empty"),
  credential: $("credential"), credentialField: $("credential-field"), words: $("words"),
  wordsField: $("words-field"),
};
const WORDS_TITLE = {
  available: "Time each word of a final: hover a word for when it was spoken",
  unavailable: "This server has no forced aligner (qasr-server --aligner): word times are not available",
};

// Same host as the page, ws: for http and wss: for https (so it works behind a TLS reverse proxy).
export function streamUrl(location = window.location) {
  return `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/v1/stream`;
}

let stream = null; // the running session: {socket, capture, sentLog, ...}
let wordsAvailable = null; // what the last `ready` said of word times (limits.words); null: no stream yet
let wordsNotice = ""; // said once the stream that asked for word times in vain is listening without them

// -- states --------------------------------------------------------------------------------------------------

const STATES = {
  idle: "Press Start and allow the microphone.",
  connecting: "Connecting…",
  listening: "Listening. Speak; press Stop when you are done.",
  stopping: "Finishing: waiting for the last transcript…",
  denied: "Microphone access was denied. Allow it in the browser's site settings, then press Start.",
  nomic: "No microphone was found. Connect one, then press Start.",
  dropped: "The connection to the server was lost.",
  unauthorized: "", // one of REFUSED
  error: "Something went wrong.",
};

// Why the server refused the page (HTTP 401), by what the page sent.
const REFUSED = {
  none: "This server requires an API key: paste a key or a token into the API key field, then press Start.",
  key: "The server did not accept this API key (401): check it, or paste a token instead, then press Start.",
  token: "The server did not accept this token (401): it may have expired. Paste a new token or a key, then " +
    "press Start.",
  unsendable: "A browser cannot send this key (it has spaces, commas or other characters a WebSocket " +
    "subprotocol cannot carry): paste a token from POST /v1/tokens instead.",
};

function setState(state, detail = "") {
  document.body.dataset.state = state;
  ui.status.textContent = [STATES[state], detail].filter(Boolean).join(" ");
  const busy = state === "connecting" || state === "listening" || state === "stopping";
  ui.toggle.textContent = busy ? "Stop" : "Start microphone";
  ui.toggle.setAttribute("aria-pressed", String(busy));
  ui.toggle.disabled = state === "connecting" || state === "stopping";
  ui.reconnect.hidden = state !== "dropped";
  ui.language.disabled = ui.context.disabled = ui.credential.disabled = busy;
  ui.words.disabled = busy || wordsAvailable === false;
  ui.credentialField.hidden = state !== "unauthorized" && !ui.credential.value;
  if (state === "unauthorized") ui.credential.focus();
  if (!busy) ui.level.value = 0;
}

// What the server said of word times: without an aligner the toggle is off and disabled, its tooltip says why.
function setWordsAvailable(available) {
  wordsAvailable = available;
  if (!available) ui.words.checked = false;
  ui.words.disabled = !available || Boolean(stream);
  ui.wordsField.classList.toggle("unavailable", !available);
  ui.wordsField.title = WORDS_TITLE[available ? "available" : "unavailable"];
}

// -- the API key or token ------------------------------------------------------------------------------------

// What the field holds: {kind: "key" | "token", secret} or null. A pasted `qasr.key.`/`qasr.token.` subprotocol
// (POST /v1/tokens answers one) is taken as it is.
function readCredential() {
  const text = ui.credential.value.trim();
  if (!text) return null;
  if (text.startsWith(TOKEN_PREFIX)) return { kind: "token", secret: text.slice(TOKEN_PREFIX.length) };
  if (text.startsWith(KEY_PREFIX)) return { kind: "key", secret: text.slice(KEY_PREFIX.length) };
  return { kind: text.startsWith(TOKEN_START) ? "token" : "key", secret: text };
}

function subprotocolsFor(credential) {
  if (!credential) return [];
  return [(credential.kind === "token" ? TOKEN_PREFIX : KEY_PREFIX) + credential.secret];
}

function storeCredential() {
  try {
    if (ui.credential.value.trim()) sessionStorage.setItem(CREDENTIAL_STORE, ui.credential.value.trim());
    else sessionStorage.removeItem(CREDENTIAL_STORE);
  } catch { /* storage disabled: the field still works for this page */ }
}

function restoreCredential() {
  try {
    ui.credential.value = sessionStorage.getItem(CREDENTIAL_STORE) || "";
  } catch { /* storage disabled */ }
}

// A browser never tells a page why its handshake failed: the socket just closes (1006). POST /v1/tokens answers
// 401 exactly when the server requires a key and has none that works from the page (a token cannot mint tokens,
// so with a token it is asked without one: 401 then means the server requires a key and refused the token).
async function refusedForAuth(credential) {
  const headers = credential?.kind === "key" ? { Authorization: `Bearer ${credential.secret}` } : {};
  try {
    const answer = await fetch("/v1/tokens?ttl_s=1", {
      method: "POST", headers, cache: "no-store", signal: AbortSignal.timeout(5000),
    });
    return answer.status === 401;
  } catch {
    return false; // the server is not there at all
  }
}

// -- starting and stopping -----------------------------------------------------------------------------------

async function start() {
  const credential = readCredential();
  if (credential && !SUBPROTOCOL_CHARS.test(credential.secret)) {
    setState("unauthorized", REFUSED.unsendable);
    return;
  }
  setState("connecting");
  let capture;
  try {
    capture = await openMicrophone();
  } catch (error) {
    if (error.name === "NotAllowedError" || error.name === "SecurityError") setState("denied");
    else if (error.name === "NotFoundError" || error.name === "OverconstrainedError") setState("nomic");
    else setState("error", error.message);
    return;
  }
  const socket = new WebSocket(streamUrl(), subprotocolsFor(credential));
  socket.binaryType = "arraybuffer";
  // The worklet downsamples to 16 kHz but cannot upsample: a slower context (8 kHz Bluetooth headsets) streams at
  // its own rate, which the server resamples.
  const rate = Math.min(SAMPLE_RATE, capture.context.sampleRate);
  const session = {
    socket, capture, rate, credential, opened: false, ready: false, ending: false, samplesSent: 0, sentLog: [],
    fatal: null, words: ui.words.checked && wordsAvailable !== false, wordsRefused: false,
  };
  stream = session;
  socket.onopen = () => {
    session.opened = true; // past the handshake: a later close is not a refusal
    socket.send(JSON.stringify({
      type: "start", sample_rate: rate, encoding: "s16le",
      language: ui.language.value || null, context: ui.context.value, ...(session.words ? { words: true } : {}),
    }));
  };
  socket.onmessage = (message) => onEvent(session, JSON.parse(message.data));
  socket.onclose = (close) => onClose(session, close);
  capture.node.port.onmessage = ({ data }) => onChunk(session, data);
}

function stop() {
  const session = stream;
  if (!session || session.ending) return;
  session.ending = true;
  if (session.socket.readyState !== WebSocket.OPEN) {
    closeMicrophone(session.capture);
    session.socket.close();
    return;
  }
  setState("stopping");
  // The worklet still holds the partly filled last chunk, and chunks may be on their way here: ask it for the
  // rest and send `end` on its acknowledgement, which comes after them; the timeout covers a worklet that died.
  session.capture.node.port.postMessage("flush");
  session.flushTimer = setTimeout(() => endStream(session), FLUSH_TIMEOUT_MS);
}

function endStream(session) {
  if (session.ended) return;
  session.ended = true;
  clearTimeout(session.flushTimer);
  closeMicrophone(session.capture);
  if (session.socket.readyState === WebSocket.OPEN) session.socket.send(JSON.stringify({ type: "end" }));
}

function onChunk(session, { pcm, level, flushed }) {
  if (flushed) return endStream(session);
  ui.level.value = Math.max(0, Math.min(1, (20 * Math.log10(level + 1e-9) + 60) / 60)); // -60..0 dBFS
  if (!session.ready || session.ended || session.socket.readyState !== WebSocket.OPEN) return;
  session.socket.send(pcm);
  session.samplesSent += pcm.byteLength / 2;
  session.sentLog.push([session.samplesSent, performance.now()]); // for the page-side latency of finals
  if (session.sentLog.length > 3000) session.sentLog.splice(0, 1000); // keep the last ~5 minutes
}

function onClose(session, close) {
  closeMicrophone(session.capture);
  if (stream === session) stream = null;
  for (const item of ui.transcript.querySelectorAll("li.partial")) item.remove(); // no final will replace them
  if (session.wordsRefused && !session.ending) {
    start(); // the same stream again, without words (the toggle is now disabled)
  } else if (session.ending && close.code === 1000) {
    setState("idle");
  } else if (!session.opened && !session.ending) {
    whyRefused(session.credential, close); // stays "connecting" until the server says
  } else if (close.code === 1000 || close.code === 1001 || close.code === 1006 || !session.ready) {
    const why = session.fatal ? session.fatal.message : close.code === 1006 ? "" : close.reason;
    setState("dropped", why ? `(${close.code}: ${why})` : `(code ${close.code})`);
  } else {
    setState("error", `The server closed the stream (${close.code}: ${session.fatal?.message || close.reason}).`);
  }
}

async function whyRefused(credential, close) {
  if (await refusedForAuth(credential)) setState("unauthorized", REFUSED[credential?.kind || "none"]);
  else setState("dropped", `(code ${close.code})`);
}

// -- the microphone ------------------------------------------------------------------------------------------

async function openMicrophone() {
  const media = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  const context = new AudioContext();
  try {
    await context.audioWorklet.addModule("capture-worklet.js");
    const source = context.createMediaStreamSource(media);
    const node = new AudioWorkletNode(context, "qasr-capture", {
      processorOptions: { targetRate: SAMPLE_RATE, chunkMs: CHUNK_MS },
    });
    const mute = context.createGain(); // the graph must reach the destination to be rendered; keep it silent
    mute.gain.value = 0;
    source.connect(node).connect(mute).connect(context.destination);
    await context.resume();
    return { media, context, node };
  } catch (error) {
    media.getTracks().forEach((track) => track.stop());
    context.close();
    throw error;
  }
}

function closeMicrophone(capture) {
  if (capture.closed) return;
  capture.closed = true;
  capture.node.port.postMessage("stop");
  capture.media.getTracks().forEach((track) => track.stop());
  capture.context.close();
}

// -- events --------------------------------------------------------------------------------------------------

function onEvent(session, event) {
  switch (event.type) {
    case "ready":
      session.ready = true;
      setWordsAvailable(Boolean(event.limits?.words));
      setState("listening", `Model: ${event.model}.${wordsNotice}`);
      wordsNotice = "";
      break;
    case "speech_started":
      segmentItem(event.segment_id);
      break;
    case "partial": {
      const item = segmentItem(event.segment_id);
      if (!item.classList.contains("partial")) break; // its final is already shown
      item.querySelector(".text").textContent = event.text || "…";
      item.querySelector(".time").textContent = `${event.start.toFixed(2)} s …`;
      item.dataset.partials = String(Number(item.dataset.partials || 0) + 1);
      break;
    }
    case "final":
      showFinal(session, event);
      break;
    case "error":
      if (event.fatal && wordsRefused(session, event)) {
        session.wordsRefused = true; // asked again without words once the server closes this stream
        wordsNotice = " Word times are off: this server has no aligner.";
        setWordsAvailable(false);
      } else if (event.fatal) session.fatal = event;
      else console.warn(`qasr: ${event.code}: ${event.message}`);
      break;
  }
}

// The server turned the stream away because it cannot time words (no --aligner): 1003 unsupported, before ready.
function wordsRefused(session, error) {
  return session.words && !session.ready && error.code === "unsupported" && /word/i.test(error.message);
}

// The list item of a segment, created in place (as a partial) the first time the segment is heard of.
function segmentItem(segmentId) {
  let item = ui.transcript.querySelector(`li[data-segment="${segmentId}"]`);
  if (!item) {
    item = document.createElement("li");
    item.dataset.segment = String(segmentId);
    item.className = "partial";
    item.innerHTML = '<span class="time"></span><span class="language"></span><span class="text">…</span>' +
      '<span class="latency"></span>';
    item.setAttribute("aria-hidden", "true"); // announced once final, not at every partial
    ui.transcript.append(item);
    ui.empty.hidden = true;
  }
  return item;
}

function showFinal(session, event) {
  const item = segmentItem(event.segment_id);
  item.className = "final";
  item.removeAttribute("aria-hidden");
  item.querySelector(".time").textContent = `${event.start.toFixed(2)}–${event.end.toFixed(2)} s`;
  item.querySelector(".language").textContent = event.language || "—"; // "" when the model named none
  item.querySelector(".text").textContent = event.text;
  const pageMs = sinceSent(session, event.end);
  item.querySelector(".latency").textContent = `server ${Math.round(event.latency_ms)} ms` +
    (pageMs === null ? "" : ` · ${Math.round(pageMs)} ms after the speech ended`);
  item.title = `segment ${event.segment_id}, closed by ${event.reason}`;
  if (!event.text) item.classList.add("silent");
  if (Array.isArray(event.words)) item.append(wordTimes(event));
}

// A final's words, each with its time (seconds from the start of the stream) on hover; or why it has none.
function wordTimes(event) {
  const line = document.createElement("span");
  line.className = "words";
  if (!event.words.length) {
    line.classList.add("none");
    line.textContent = event.text ? `no word times: ${event.words_reason || "none given"}` : "";
    return line;
  }
  event.words.forEach(({ word, start, end }, index) => {
    const span = document.createElement("span");
    span.className = "word";
    span.textContent = word;
    span.title = `${start.toFixed(2)}–${end.toFixed(2)} s`;
    span.dataset.start = String(start);
    span.dataset.end = String(end);
    line.append(...(index ? [" ", span] : [span]));
  });
  return line;
}

// Milliseconds since the chunk holding the segment's last sample was sent: what the person waited, including
// the pause the server needs to decide the segment has ended.
function sinceSent(session, endSeconds) {
  const sample = endSeconds * session.rate;
  const entry = session.sentLog.find(([sent]) => sent >= sample);
  return entry ? performance.now() - entry[1] : null;
}

// -- wiring --------------------------------------------------------------------------------------------------

for (const language of LANGUAGES) ui.language.append(new Option(language, language));
ui.toggle.addEventListener("click", () => (stream ? stop() : start()));
ui.reconnect.addEventListener("click", () => start());
ui.credential.addEventListener("input", storeCredential);
ui.credential.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !stream && !ui.toggle.disabled) start();
});
restoreCredential();
if (!window.isSecureContext || !navigator.mediaDevices) {
  setState("error", "The microphone needs a secure page: open it as http://localhost or over https.");
  ui.toggle.disabled = true;
} else {
  setState("idle");
}
