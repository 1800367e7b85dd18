"""The critic as a Hugging Face folder: a ``*ForTokenClassification`` model with one label, and its loader.

The PPO critic (:class:`rlpad.core.value.ValueModel`) is a causal LM's backbone plus ``Linear(hidden, 1)``.
Its folder is the backbone under the architecture's ``base_model_prefix`` and the head as ``score``, with
``num_labels`` 1: ``AutoModelForTokenClassification.from_pretrained`` loads it (verl's critic class), and its
``config.json`` says ``"rlpad_role": "critic"``. Reading it: ``logits[b, i, 0]`` is the value of the state
after token i, which rlpad's trainer uses as the value of token i + 1 (the value of response token t is read
at column t - 1, :mod:`rlpad.core.value`); :func:`load_value_model` gives back the critic itself.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["CRITIC_ROLE", "ROLE_KEY", "load_value_model", "value_layout"]

ROLE_KEY, CRITIC_ROLE = "rlpad_role", "critic"  # config.json of a critic folder: {"rlpad_role": "critic"}


def value_layout(config: Any) -> tuple[str, str, str]:
    """``(architecture, base_model_prefix, head name)`` of the ``*ForTokenClassification`` model of
    ``config``'s type (built on the meta device); ValueError when transformers has none."""
    from transformers import AutoModelForTokenClassification

    labels = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
    cfg = config.__class__.from_dict({**labels, "num_labels": 1})
    try:
        with torch.device("meta"):
            model = AutoModelForTokenClassification.from_config(cfg)
    except ValueError as e:
        raise ValueError(f"model type {config.model_type!r} has no ForTokenClassification class in transformers: "
                         "its critic cannot be written as a Hugging Face folder") from e
    prefix = model.base_model_prefix
    heads = sorted({k.rsplit(".", 1)[0] for k in model.state_dict() if not k.startswith(prefix + ".")})
    if len(heads) != 1:
        raise ValueError(f"{type(model).__name__}: expected one head module beside {prefix}, got {heads}")
    return type(model).__name__, prefix, heads[0]


def load_value_model(path: str, *, dtype: str = "float32", device: str = "cpu", use_remove_padding: bool = True) -> Any:
    """The critic saved at ``path`` (``trainer``'s ``hf_critic/step_<k>`` or ``rlpad export --role critic``) as
    a :class:`rlpad.core.value.ValueModel`: ``model(input_ids, attention_mask, position_ids, response_length)``
    gives the values ``(B, R)`` of the response tokens exactly as the trainer's critic did. ValueError
    naming what ``path`` is when it is not a critic folder."""
    from transformers import AutoModelForTokenClassification

    from rlpad.core.models import load_pretrained
    from rlpad.core.value import ValueModel

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path!r} is not a Hugging Face model folder (no config.json)")
    with open(config_file) as f:
        config = json.load(f)
    if config.get(ROLE_KEY) != CRITIC_ROLE or config.get("num_labels", len(config.get("id2label", {}))) != 1:
        arch = (config.get("architectures") or ["?"])[0]
        raise ValueError(f"{path!r} is not an rlpad critic folder: its config.json is a {arch} without "
                         f"\"{ROLE_KEY}\": \"{CRITIC_ROLE}\" and one label (write one with "
                         "`rlpad export CHECKPOINT OUT --role critic`)")
    model = load_pretrained(AutoModelForTokenClassification, path, dtype=dtype, device=device,
                            use_remove_padding=use_remove_padding)
    _, _, head = value_layout(model.config)
    value = ValueModel(model)
    with torch.no_grad():
        source = getattr(model, head)
        value.value_head.weight.copy_(source.weight)
        value.value_head.bias.copy_(source.bias)
    return value.eval()
