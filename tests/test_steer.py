"""Finding llama.cpp's CPU backend in a context object (backends/llama/steer.py), on memory laid
out here: the scan must find the one pointer to a backend, and survive every other word."""

from __future__ import annotations

import ctypes

import pytest

from localinfer.backends.llama import steer

pytestmark = pytest.mark.skipif(not steer.available(), reason="no /proc/self/mem or no switch")


def _address(obj) -> int:
    return ctypes.addressof(obj)


def _context(words: list[int]):
    return (ctypes.c_uint64 * 512)(*words)


def test_the_backend_pointer_is_found_among_hostile_words():
    guid = ctypes.create_string_buffer(steer._CPU_GUID, 16)
    backend = (ctypes.c_uint64 * 4)(_address(guid), 0, 0, 0)
    wrong_guid = ctypes.create_string_buffer(bytes(16), 16)
    other = (ctypes.c_uint64 * 4)(_address(wrong_guid), 0, 0, 0)
    # Null, small, unmapped, kernel-space and odd words, a pointer to a pointer to a wrong GUID,
    # then the backend; and a second backend further on, which must not win.
    words = [0, 16, 0x7FFF_0000_0000, 0xFFFF_8000_0000_0000, 2 ** 64 - 1, _address(other),
             _address(backend), _address(other)]
    second = (ctypes.c_uint64 * 4)(_address(guid), 0, 0, 0)
    context = _context(words + [0] * 20 + [_address(second)])
    assert steer.find(ctypes.c_void_p(_address(context))) == _address(backend)


def test_a_context_without_a_backend_gives_none():
    context = _context([0, 1, 2, 0xDEAD_BEEF_0000])
    assert steer.find(ctypes.c_void_p(_address(context))) is None


def test_a_real_context_is_steered_and_its_cache_is_f16(smollm_path):
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama.session import LlamaCppSession
    session = LlamaCppSession(smollm_path, LoadOptions(n_ctx=512))
    try:
        assert session._steer is not None and session._kv_types == (1, 1)
        assert "reference kernels" in session.kv_path
        assert session.state_identity()["steered"] is True
    finally:
        session.close()
