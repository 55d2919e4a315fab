"""The score head of a reward model: a `score.weight` tensor of shape [1, hidden] beside a VLM's weights.

Public VLM reward models ship as the VLM's checkpoint plus a sequence-classification head (`score`, a linear
layer without bias from the last token's final hidden state to one number), whether or not transformers has a
ForSequenceClassification class for the architecture (it has none for Qwen3-VL or Qwen2.5-VL). `read_score_head`
finds that tensor in a checkpoint's safetensors files; the classifier judge (`judge.classifier`) runs the VLM and
applies it.

`add_score_head` makes such a checkpoint out of a generative yes/no judge: the head is the lm_head row of the
yes word minus that of the no word, so the head's output is logit(yes) - logit(no) and its sigmoid is exactly the
judge's P(yes) / (P(yes) + P(no)), the `yes_probability` the generative backends read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from visionrl.errors import InputError

if TYPE_CHECKING:
    import torch

SCORE_HEAD = "score.weight"
LM_HEAD_KEYS = ("lm_head.weight", "model.language_model.embed_tokens.weight")  # the second when tied


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"'{model_dir}' has no *.safetensors files; is it a complete checkpoint directory?")
    return files


def read_score_head(model_dir: str | Path) -> torch.Tensor:
    """The [1, hidden] score head of the reward model in `model_dir`; raises InputError saying what is wrong."""
    from safetensors import safe_open

    path = Path(model_dir)
    for file in _safetensors_files(path):
        with safe_open(str(file), "pt") as f:
            if SCORE_HEAD in f.keys():
                head = f.get_tensor(SCORE_HEAD)
                break
    else:
        raise InputError(
            f"'{path}' has no score head (a `{SCORE_HEAD}` tensor in its safetensors files), so it is not a reward "
            "model with a sequence-classification head; for a generative judge use backend vllm (or engine), or "
            "give the head with `visionrl init-tiny-model DIR --recipe judge-color --score-head` for the tiny judge"
        )
    if head.dim() != 2 or head.shape[0] != 1:
        raise InputError(
            f"'{path}': `{SCORE_HEAD}` has shape {list(head.shape)}; the classifier judge reads one number per "
            "answer, a head of shape [1, hidden] (num_labels 1)"
        )
    return head


def add_score_head(model_dir: str | Path, yes: str = "yes", no: str = "no") -> None:
    """Write `score.weight` = lm_head[yes] - lm_head[no] into the checkpoint in `model_dir` (one safetensors file),
    and note it in its `visionrl_tiny.json`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = Path(model_dir)
    files = _safetensors_files(path)
    if len(files) != 1:
        raise InputError(
            f"'{path}' has {len(files)} safetensors files; a score head is added to a single-file one"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = []
    for word in (yes, no):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise InputError(
                f"'{word}' is {len(encoded)} tokens of '{path}'s tokenizer; a score word is one token"
            )
        ids.append(encoded[0])
    weights = load_file(str(files[0]))
    lm_head = next((weights[k] for k in LM_HEAD_KEYS if k in weights), None)
    if lm_head is None:
        raise InputError(f"'{path}' has no {' or '.join(LM_HEAD_KEYS)} to derive a score head from")
    weights[SCORE_HEAD] = (lm_head[ids[0]] - lm_head[ids[1]]).unsqueeze(0).contiguous()
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    info_path = path / "visionrl_tiny.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    info["score_head"] = f"lm_head[{yes!r}] - lm_head[{no!r}]"
    info_path.write_text(json.dumps(info, indent=2) + "\n")
