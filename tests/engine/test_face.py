"""Each engine the server can drive implements the engine's face (qasr.engine.face.SpeechEngine) member for member:
the same names, properties where the face has properties, coroutines where it has coroutines, and the same
parameters (names, kinds, order; an implementation may only add defaults). isinstance on a runtime_checkable
Protocol would check names only."""

import inspect
import typing

import pytest

from qasr.engine.engine import AsyncEngine
from qasr.engine.engine_client import EngineClient
from qasr.engine.engine_process import EngineProcess
from qasr.engine.face import SpeechEngine
from qasr.engine.fake import FakeEngine
from qasr.engine.pool import EnginePool

IMPLEMENTATIONS = [AsyncEngine, EngineProcess, EngineClient, FakeEngine, EnginePool]


def face_members() -> dict[str, object]:
    return {name: value for name, value in vars(SpeechEngine).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def parameters(function) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def test_the_face_is_what_the_brief_declares():
    assert set(face_members()) == {"ready", "error", "start", "close", "transcribe", "release_stream",
                                   "check_context", "stats"}
    assert typing.get_type_hints(SpeechEngine)["model_name"] is str


@pytest.mark.parametrize("engine_class", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implements_every_member_of_the_face(engine_class):
    assert typing.get_type_hints(engine_class).get("model_name") is str, "model_name: str is declared"
    for name, member in face_members().items():
        implemented = inspect.getattr_static(engine_class, name, None)
        assert implemented is not None, f"{engine_class.__name__} lacks {name}"
        if isinstance(member, property):
            assert isinstance(implemented, property), f"{engine_class.__name__}.{name} is not a property"
            continue
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(member), \
            f"{engine_class.__name__}.{name}: async on one side only"
        assert parameters(implemented) == parameters(member), \
            f"{engine_class.__name__}.{name}{inspect.signature(implemented)}"
        extra_required = [p.name for p in inspect.signature(implemented).parameters.values()
                          if p.default is inspect.Parameter.empty and p.name != "self"
                          and inspect.signature(member).parameters[p.name].default is not inspect.Parameter.empty]
        assert not extra_required, f"{engine_class.__name__}.{name} requires {extra_required}"


def test_the_check_catches_a_wrong_signature():
    class Wrong(FakeEngine):
        def check_context(self, context, language=None, max_audio_seconds=30.0):  # sync, and not keyword-only
            pass

    with pytest.raises(AssertionError, match="async on one side only"):
        test_implements_every_member_of_the_face(Wrong)

    class Renamed(FakeEngine):
        async def transcribe(self, req):
            pass

    with pytest.raises(AssertionError, match="transcribe"):
        test_implements_every_member_of_the_face(Renamed)
