"""Create the tiny local test model (random-weight Llama + locally trained BPE tokenizer).

No model hub is reachable here, so the vLLM tests use this model. It is cached: rebuilt only
when its directory is missing or incomplete. The location is `$TOOLENV_TEST_MODEL`, by default
`~/.cache/toolenv/models/tiny-llama`.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = (
    "the of and to in is was for on with as by at from that this which search query answer "
    "python code run test result tool call return value error time step turn model token "
    "what who when where how why document title wikipedia retrieve number list print def "
    "import for while if else true false none class self sum max min sort range len"
).split()
DONE_MARKER = "toolenv-model-complete"


def default_model_dir() -> Path:
    return Path(
        os.environ.get("TOOLENV_TEST_MODEL", Path.home() / ".cache/toolenv/models/tiny-llama")
    )


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the CPU attention needs >= 64
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir()
    if (out / DONE_MARKER).exists():
        return 0
    print(f"[setup] creating the tiny test model in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
