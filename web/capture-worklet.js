// Microphone capture on the audio thread: downsample to 16 kHz mono, convert to 16-bit PCM (s16le) and post
// one chunk per `chunkMs` to the page, with the chunk's RMS level for the meter. The message "flush" ends capture:
// the rest is posted as a shorter chunk, then `{flushed: true}`.
//
// Downsampling is a windowed-sinc low-pass evaluated at fractional input positions, so any input rate works
// (48000, 44100, ...) without aliasing speech harmonics above 8 kHz into the band the model hears.

const KERNEL_ZEROS = 8; // sinc zero crossings on each side of the centre, in output-rate samples
const TABLE_STEPS = 64; // kernel table entries per input sample

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate = 16000, chunkMs = 100 } = options.processorOptions || {};
    this.step = sampleRate / targetRate; // input samples per output sample (3 for 48 kHz)
    this.chunk = new Int16Array(Math.round((targetRate * chunkMs) / 1000));
    this.filled = 0;
    this.sumSquares = 0; // of the input samples behind the current chunk
    this.inputCount = 0;
    this.buffer = new Float32Array(0); // input not yet consumed
    this.position = 0; // fractional index in `buffer` of the next output sample
    this.stopped = false;
    if (this.step > 1) {
      this.halfWidth = Math.ceil(KERNEL_ZEROS * this.step); // in input samples
      this.table = lowPassTable(0.92 / (2 * this.step), this.halfWidth);
    }
    this.port.onmessage = (message) => {
      if (message.data === "stop") this.stopped = true;
      else if (message.data === "flush") this.flush();
    };
  }

  // Stop: post the partly filled last chunk, then `{flushed: true}`, so the page sends all of it before `end`.
  flush() {
    if (!this.stopped) {
      this.stopped = true;
      if (this.step > 1) this.resample(new Float32Array(this.halfWidth + 1)); // the filter's held-back samples
      if (this.filled > 0) {
        const level = Math.sqrt(this.sumSquares / Math.max(1, this.inputCount));
        const pcm = this.chunk.slice(0, this.filled).buffer;
        this.port.postMessage({ pcm, level }, [pcm]);
        this.filled = 0;
      }
    }
    this.port.postMessage({ flushed: true });
  }

  process(inputs) {
    const channels = inputs[0];
    if (this.stopped) return false;
    if (!channels || channels.length === 0) return true;
    const mono = mixDown(channels);
    for (const sample of mono) this.sumSquares += sample * sample;
    this.inputCount += mono.length;
    if (this.step <= 1) {
      for (const sample of mono) this.emit(sample);
    } else {
      this.resample(mono);
    }
    return true;
  }

  resample(mono) {
    const joined = new Float32Array(this.buffer.length + mono.length);
    joined.set(this.buffer);
    joined.set(mono, this.buffer.length);
    const width = this.halfWidth;
    while (this.position + width < joined.length) {
      const centre = this.position;
      let sum = 0;
      for (let k = Math.max(0, Math.ceil(centre - width)); k <= Math.floor(centre + width); k++) {
        sum += joined[k] * this.table[Math.round(Math.abs(centre - k) * TABLE_STEPS)];
      }
      this.emit(sum);
      this.position += this.step;
    }
    const keepFrom = Math.max(0, Math.floor(this.position - width));
    this.buffer = joined.slice(keepFrom);
    this.position -= keepFrom;
  }

  emit(sample) {
    const clipped = Math.max(-1, Math.min(1, sample));
    this.chunk[this.filled++] = Math.round(clipped * 32767);
    if (this.filled === this.chunk.length) {
      const level = Math.sqrt(this.sumSquares / Math.max(1, this.inputCount));
      const pcm = this.chunk.slice().buffer;
      this.port.postMessage({ pcm, level }, [pcm]);
      this.filled = 0;
      this.sumSquares = 0;
      this.inputCount = 0;
    }
  }
}

function mixDown(channels) {
  if (channels.length === 1) return channels[0];
  const out = new Float32Array(channels[0].length);
  for (const channel of channels) for (let i = 0; i < out.length; i++) out[i] += channel[i] / channels.length;
  return out;
}

// Blackman-windowed sinc with cutoff `cutoff` (cycles per input sample), tabulated at 1/TABLE_STEPS sample
// resolution for distances 0..halfWidth; normalised to unit DC gain.
function lowPassTable(cutoff, halfWidth) {
  const table = new Float32Array(halfWidth * TABLE_STEPS + 2);
  for (let i = 0; i < table.length; i++) {
    const d = i / TABLE_STEPS;
    const sinc = d === 0 ? 1 : Math.sin(2 * Math.PI * cutoff * d) / (2 * Math.PI * cutoff * d);
    const x = Math.min(1, d / halfWidth); // 0 at the centre, 1 at the edge
    const window = 0.42 + 0.5 * Math.cos(Math.PI * x) + 0.08 * Math.cos(2 * Math.PI * x);
    table[i] = 2 * cutoff * sinc * window;
  }
  let dc = table[0];
  for (let k = 1; k <= halfWidth; k++) dc += 2 * table[k * TABLE_STEPS];
  for (let i = 0; i < table.length; i++) table[i] /= dc;
  return table;
}

registerProcessor("qasr-capture", CaptureProcessor);
