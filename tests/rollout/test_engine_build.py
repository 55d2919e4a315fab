"""The vLLM engine's build on a GPU with sleep mode: the first sleep and wake-up happen at the build, not in the
first update (vLLM stood in by a recorder; sleep mode exists on GPUs only)."""

from __future__ import annotations

from typing import Any

import pytest

from visionrl.rollout.vllm_adapters import VLLMAdapters
from visionrl.rollout.vllm_engine import VLLMEngine


class _RecordingLLM:
    calls: list[str] = []

    def __init__(self, **kwargs: Any) -> None:
        self.calls.append("start")
        self.llm_engine = self

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake up")

    def add_lora(self, request: Any) -> bool:
        self.calls.append(f"add {request}")
        return True


def _engine(sleep_mode: bool, lora: Any, monkeypatch: pytest.MonkeyPatch) -> VLLMEngine:
    import vllm

    monkeypatch.setattr(vllm, "LLM", _RecordingLLM)
    _RecordingLLM.calls = []
    engine = VLLMEngine.__new__(VLLMEngine)  # the build alone: no model, no scratch folder
    engine._llm_kwargs, engine._sleep_mode = {}, sleep_mode
    engine._adapters = VLLMAdapters.__new__(VLLMAdapters)
    engine._adapters.served, engine._adapters.merged = lora, False
    return engine


def test_sleep_mode_is_warmed_at_the_build_before_the_adapter_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _engine(True, "v3", monkeypatch)._build()  # a rebuild: the version served is added back after the warm-up
    assert _RecordingLLM.calls == ["start", "sleep 1", "wake up", "add v3"]


def test_without_sleep_mode_the_build_only_starts_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    _engine(False, None, monkeypatch)._build()
    assert _RecordingLLM.calls == ["start"]
