"""qasr.client: stream audio to a qasr server and receive its transcripts.

    from qasr.client import Final, file_source, stream_audio

    async for event in stream_audio("ws://127.0.0.1:8765/v1/stream", file_source("talk.wav")):
        if isinstance(event, Final):
            print(f"[{event.start:.2f}-{event.end:.2f}] {event.text}")

A server that requires API keys: `stream_audio(url, source, api_key=os.environ["QASR_API_KEY"])`.

Events are the server's (`Ready`, `SpeechStarted`, `Partial`, `Final`, `Error`, `Summary`, from
`qasr.streaming.events`; a Final's `words` are `Word`s when the stream asked with `words=True`) plus the client's
own `Reconnecting` and `AudioDropped` (a microphone that fell too far behind). The wire format lives in
`qasr.client.protocol`, errors in `qasr.client.errors`. `qasr-mic` (qasr.client.mic) is the terminal client built on
this.
"""

from qasr.client.errors import (AccessDenied, AudioSourceError, AuthenticationFailed, ClientError, ConnectionLost,
                                HandshakeRefused, ProtocolMismatch, ServerUnreachable, ServiceUnavailable,
                                StreamClosed, TooManyConnections)
from qasr.client.protocol import Credentials, StreamOptions
from qasr.client.sources import (FileSource, InputDevice, MicrophoneSource, file_source, list_input_devices,
                                 microphone_source)
from qasr.client.stream import AudioDropped, AudioStream, Reconnecting, StreamClient, StreamEvent, stream_audio
from qasr.streaming.events import Error, Final, Partial, Ready, SpeechStarted, Summary, Word

__all__ = [
    "stream_audio", "AudioStream", "StreamClient", "StreamOptions", "Credentials", "StreamEvent",
    "file_source", "microphone_source", "list_input_devices", "FileSource", "MicrophoneSource", "InputDevice",
    "Ready", "SpeechStarted", "Partial", "Final", "Word", "Error", "Summary", "Reconnecting", "AudioDropped",
    "ClientError", "ServerUnreachable", "StreamClosed", "ConnectionLost", "ProtocolMismatch", "AudioSourceError",
    "HandshakeRefused", "AuthenticationFailed", "AccessDenied", "TooManyConnections", "ServiceUnavailable",
]
