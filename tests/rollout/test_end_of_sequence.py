"""End-of-sequence handling of the HF engine: real Qwen3-VL checkpoints list two ids ([151645, 151643])."""

from __future__ import annotations

import pytest

from visionrl.rollout.hf_engine import HFEngine, end_of_sequence_ids


def test_end_of_sequence_ids_take_a_list_an_int_or_the_tokenizer_default() -> None:
    assert end_of_sequence_ids([151645, 151643], 151645) == [151645, 151643]
    assert end_of_sequence_ids(7, 3) == [7]
    assert end_of_sequence_ids(None, 3) == [3]
    with pytest.raises(ValueError, match="names no end-of-sequence token"):
        end_of_sequence_ids(None, None)


def test_completions_stop_at_the_first_of_several_end_ids() -> None:
    engine = object.__new__(HFEngine)  # _trim needs only the ids; no model is loaded
    engine.eos_ids = [151645, 151643]
    # the second id ends it too, and what follows (padding) is cut; the end token itself is kept, as vLLM does
    assert engine._trim([5, 6, 151643, 0, 0]) == ([5, 6, 151643], "stop")
    assert engine._trim([5, 151645, 151643]) == ([5, 151645], "stop")
    assert engine._trim([5, 6, 7]) == ([5, 6, 7], "length")
