"""Test helpers: a byte-level BPE tokenizer trained here, in-process, and a ChatML chat template of the
project's own that renders tools the way Qwen2.5 / Qwen3 do.

The tokenizer's pre-tokenizer keeps a run of punctuation together with the newlines after it (as
Qwen's does), so BPE learns tokens that merge a call's closing text with what follows: ``)]`` +
newline, ``).``, ``>`` + newline. ``added`` makes ``<tool_call>`` etc. single added tokens (as Qwen's
vocabulary has them); without it ``</tool_call>`` is ordinary text, split and merged like any other.

The template: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``); with ``tools`` a system block holding a
``# Tools`` section with one JSON schema per line inside ``<tools></tools>``; an assistant message's
``tool_calls`` as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks (newline
separated), its ``reasoning_content`` as a ``<think>`` block; consecutive tool messages gathered in
one ``user`` block, one ``<tool_response>`` each.
"""

from __future__ import annotations

import functools

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# letters / a digit / punctuation with the newlines after it / newlines / other spaces
PRE_TOKENS = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CHATML_TOOLS = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nFunctions you may call, one JSON signature per line:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>'"
    " + '<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set text = m.content if m.content is string else '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content -%}"
    "{%- set text = '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' + text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + text -}}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}"
    "{%- for call in m.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + (fn.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Text the BPE is trained on: calls in both formats followed by what a model writes after them.
_CORPUS = [
    "[calc(12+7)]\n", "[calc(3*4)].", "[calc(5-1)] done", "f(x).", "g(y)]\nok", "see (a).", "[search(cats)]\n\n",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n',
    '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n<tool_call>\n',
    "<think>\nthe sum is needed\n</think>\n\n", "<tool_response>\n19\n</tool_response>\n", "The answer is 19.\n",
    "<p>\n</p>\n", "a > b\n", "x.\n", ").\n", ")]\n", ">\n",
]


@functools.cache
def _trained() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 50, trainer=trainer)
    return tok.to_str()


def build_bpe(added: bool = False) -> PreTrainedTokenizerFast:
    """The byte-level BPE with the ChatML tools template; ``added``: the tool tags are added tokens."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained()), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    if added:
        tok.add_tokens(TOOL_TOKENS)
    tok.chat_template = CHATML_TOOLS
    return tok
