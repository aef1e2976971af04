"""A tiny random-weight Llama and its tokenizer, built locally for the vLLM tests.

No model hub is reachable from tests or CI, so the model is made here: a byte-level
BPE tokenizer trained on a few sentences (with a chat template), and a two-layer
Llama whose head size (256 / 4 heads = 64) is one the vLLM CPU attention backend
supports. The weights are random: the text is gibberish, the engine work is real.

    python -m tests.vllm_model DIR     # build into DIR (what the bench and scripts use)
"""

from __future__ import annotations

import sys
from pathlib import Path

# Bump when the recipe changes, so a cached copy is rebuilt.
VERSION = "2"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a proxy that routed requests to healthy units.",
    "A unit is one model replica spread over a leader and its followers.",
    "Hello, how are you today? I am fine, thank you, and you?",
    "Load balancing picks the least outstanding requests among serving units.",
    "Tokens stream back to the client one delta at a time.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @",
]


def build(target: Path) -> Path:
    """Write the model and tokenizer into ``target`` unless this version is there."""
    stamp = target / "unitproxy-tiny-llama.version"
    if stamp.exists() and stamp.read_text() == VERSION:
        return target
    target.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(target)
    _save_model(target, vocab_size)
    stamp.write_text(VERSION)
    return target


def _save_tokenizer(target: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=_SPECIALS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    fast.save_pretrained(target)
    return len(fast)


def _save_model(target: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(target)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.vllm_model DIR")
    print(build(Path(sys.argv[1])))
