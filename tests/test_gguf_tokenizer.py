"""The tokenizer and chat template of a GGUF file against transformers' GGUF loader.

Strings: over 10,000, drawn from the texts the environments show (the ALFWorld games of
ALFWORLD_DATA: their grammar's sentences, walkthrough commands and PDDL problems; the WebShop
fixture catalog; the SWE fixtures' sources), and Unicode edge cases.

SmolLM2's file names the "smollm" pre-tokenizer: every number character stands alone, then
GPT-2's split (llama.cpp's SMOLLM pre-type; SmolLM2's own tokenizer.json writes it as a `Digits`
step before the byte-level one). transformers' GGUF reader does not know the name and splits
with GPT-2's pattern only. The two agree except where a number character follows two or more
whitespace characters (GPT-2's pattern hands the last space to the number: "  1" is " ", " 1")
or is not an ASCII digit and joins a neighbour; our ids must equal transformers' on every other
string, and on all of them the ids of transformers' tokenizer with SmolLM2's pre-tokenizer.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import unicodedata
from pathlib import Path

import pytest
from gguf_fixtures import write_tiny_gguf
from tokenizers import Tokenizer, pre_tokenizers

from bpo_jax.tokenizer import load_tokenizer
from bpo_jax.tokenizer.gguf import load_gguf_tokenizer

TESTS = Path(__file__).resolve().parent
ALFWORLD_STRINGS = 9000
UNICODE_CASES = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n",
    "a\u00a0b",
    "zero\u200bwidth",
    "e\u0301",
    "naïve café résumé",
    "日本語のテキスト",
    "中文 测试",
    "한국어 문장",
    "Привет, мир",
    "مرحبا بالعالم",
    "שלום עולם",
    "ελληνικά",
    "🙂",
    "👩\u200d👩\u200d👧\u200d👦 family",
    "🇫🇷🇩🇪",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\x00",
    "\x7f",
    "\ufeffBOM",
    "\ufffd",
    "  leading",
    "trailing  ",
    "a\u3000b",
    "don’t “quote”",
    "don't I'M it's you'll we've",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "a<|im_end|>b",
    "<|im_start",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<repo_name>x<file_sep>",
    "<think> I should go to the drawer 2. </think> <action>go to drawer 2</action>",
    "price: $12.99 (3 left), 4.5/5 stars",
    "x = 1_000_000; y = 0xFF; z = 3.14e-10",
    "def f(x):\n\treturn x**2  # ok\n",
    "    10,\n        20,",
    "a" * 500,
    " ".join(["word"] * 200),
    "https://example.com/a?b=1&c=2#d",
    # Non-ASCII numbers: where transformers' split and SmolLM2's differ.
    "١٢٣",
    "٣ apples",
    "x١",
    "عدد ١٢٣",
    "price ３４５ yen",
    "Ⅻ chapters",
    "½ cup",
    "E = mc²",
    "３４５",
    "১২৩ টাকা",
    "१२३",
]


def _alfworld() -> list[str]:
    games = sorted(
        glob.glob(os.path.join(os.environ["ALFWORLD_DATA"], "**/*.tw-pddl"), recursive=True)
    )
    assert len(games) > 100, f"ALFWorld games not found under {os.environ['ALFWORLD_DATA']}"
    shown, files = set(), set()
    rhs = re.compile(r'"rhs":\s*"((?:[^"\\]|\\.)*)"')
    for path in games:
        with open(path, encoding="utf-8") as f:
            game = json.load(f)
        shown.update(game["walkthrough"])
        shown.update(json.loads(f'"{m}"') for m in rhs.findall(game["grammar"]))
        files.update(line for line in game["pddl_problem"].splitlines() if line.strip())
    rest = random.Random(0).sample(sorted(files), ALFWORLD_STRINGS - len(shown))
    return sorted(shown) + rest


def _webshop() -> list[str]:
    out = set()

    def walk(x):
        if isinstance(x, str):
            out.add(x)
            out.update(p for p in re.split(r"(?<=[.!?])\s+|\n", x) if p.strip())
        elif isinstance(x, dict):
            for k, v in x.items():
                out.add(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    with open(TESTS / "fixtures/webshop/items_shuffle_fixture.json", encoding="utf-8") as f:
        walk(json.load(f))
    return sorted(out)


def _swe() -> list[str]:
    out = set()
    for name in ("swe_fixtures.py", "swebench_fixtures.py", "swe_docker_fixtures.py"):
        lines = (TESTS / name).read_text(encoding="utf-8").splitlines(keepends=True)
        out.update(line for line in lines if line.strip())
        # Blocks of five lines: indentation, newlines and code as a file view shows them.
        out.update("".join(lines[i : i + 5]) for i in range(0, len(lines), 3))
    return sorted(out)


@pytest.fixture(scope="module")
def strings() -> list[str]:
    return _alfworld() + _webshop() + _swe() + UNICODE_CASES


def _explained(text: str) -> bool:
    """Where GPT-2's split alone and SmolLM2's differ (see the module docstring)."""
    other = any(unicodedata.category(c)[0] == "N" and not c.isascii() for c in text)
    return other or re.search(r"\s\s\d", text) is not None


def test_ids_match_transformers(strings, our_smollm_tokenizer, hf_smollm_tokenizer):
    assert len(strings) >= 10_000
    ours = our_smollm_tokenizer.encode_batch(strings)
    backend = hf_smollm_tokenizer.backend_tokenizer
    theirs = [e.ids for e in backend.encode_batch(strings, add_special_tokens=False)]
    # transformers' tokenizer with SmolLM2's own pre-tokenizer (its tokenizer.json's).
    smollm = Tokenizer.from_str(backend.to_str())
    smollm.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    reference = [e.ids for e in smollm.encode_batch(strings, add_special_tokens=False)]
    differ = [s for s, a, b in zip(strings, ours, theirs) if a != b]
    print(
        f"{len(strings)} strings; ids differ from transformers' GGUF tokenizer on {len(differ)} "
        f"(all where a number follows 2+ spaces or is non-ASCII); from SmolLM2's split on "
        f"{sum(a != b for a, b in zip(ours, reference))}"
    )
    assert ours == reference
    unexplained = [s for s in differ if not _explained(s)]
    assert not unexplained, unexplained[:5]
    assert len(differ) < len(strings) // 100
    # Byte-level BPE loses nothing; special tokens decode when asked to.
    for text, ids in zip(strings, ours):
        assert our_smollm_tokenizer.decode(ids, skip_special=False) == text


def test_special_tokens_match_transformers(our_smollm_tokenizer, hf_smollm_tokenizer):
    tok, hf = our_smollm_tokenizer, hf_smollm_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert tok.stop_ids == (hf.eos_token_id,)
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.vocab_size == len(hf) == 49_152
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


CONVERSATIONS = [
    [{"role": "user", "content": "Your task is to: put a clean mug in coffeemachine."}],
    [
        {"role": "system", "content": "You are an expert agent in ALFWorld."},
        {"role": "user", "content": "You arrive at drawer 2. The drawer 2 is closed."},
    ],
    [
        {"role": "user", "content": "search for a 6.76 fl oz bottle, price lower than 100.00"},
        {"role": "assistant", "content": "<think>search</think><action>search[l'eau]</action>"},
        {"role": "user", "content": "[SEP] Back to Search [SEP] Page 1 (Total results: 50)"},
    ],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_apply_chat_template(
    generation_prompt, our_smollm_tokenizer, hf_smollm_tokenizer
):
    tok, hf = our_smollm_tokenizer, hf_smollm_tokenizer
    for chat in CONVERSATIONS:
        text = tok.chat_template.render(chat, add_generation_prompt=generation_prompt)
        want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == want
        ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tok.encode(text) == list(ids)
    assert text.startswith("<|im_start|>user") or "SmolLM" in text


def test_load_tokenizer_reads_gguf_names_and_paths(smollm_path, our_smollm_tokenizer):
    text = "go to countertop 1"
    assert load_tokenizer("smollm2_135m_instruct").encode(text) == our_smollm_tokenizer.encode(text)
    assert load_tokenizer(smollm_path).encode(text) == our_smollm_tokenizer.encode(text)


# ----------------------------------------------------------------------------- refused files


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"add_tokenizer_pre": "qwen2"}, r"tokenizer\.ggml\.pre='qwen2' is not supported"),
        ({"add_tokenizer_model": "llama"}, r"tokenizer\.ggml\.model='llama' is not supported"),
        ({"add_eos_token_id": 100_000}, r"eos_token_id=100000 is outside the vocabulary"),
    ],
    ids=["pre", "model", "eos"],
)
def test_unsupported_tokenizers_are_refused(tmp_path, metadata, message):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf_tokenizer(path)


def test_tiny_file_tokenizer_matches_transformers(tmp_path):
    """A file whose pre-tokenizer transformers also reads ("gpt2"): ids equal on every string."""
    import transformers

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, metadata={"add_tokenizer_pre": "gpt2"})
    ours = load_gguf_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = UNICODE_CASES + ["the cat sat on a mat", "go to drawer 12   3"]
    assert ours.encode_batch(texts) == [hf.encode(t, add_special_tokens=False) for t in texts]
