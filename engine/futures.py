"""Completing asyncio futures from the engine's threads (torch-free: the server process's EngineProcess uses it)."""

from __future__ import annotations

import asyncio


def settle(future: asyncio.Future, result) -> None:
    """Complete `future` with a result or an exception (on its loop), unless it is done already."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
