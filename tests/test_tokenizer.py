"""Tests for bpo_jax.tokenizer: SentencePiece training and Hugging Face tokenizer.json loading."""

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from bpo_jax import tokenizer as tok_lib

TURN_MARKERS = ("<obs>", "<act>", "</act>")


def alfworld_lines(n: int = 300, seed: int = 0) -> list[str]:
    """Synthetic ALFWorld-like observations and actions."""
    rng = random.Random(seed)
    places = ["dresser", "countertop", "cabinet", "drawer", "fridge", "sinkbasin", "shelf"]
    things = ["apple", "mug", "knife", "bowl", "pan", "spatula", "keychain", "creditcard"]
    lines = []
    for _ in range(n):
        place = f"{rng.choice(places)} {rng.randint(1, 12)}"
        seen = ", ".join(f"a {rng.choice(things)} {rng.randint(1, 4)}" for _ in range(3))
        lines.append(
            rng.choice(
                [
                    f"go to {place}",
                    f"take {rng.choice(things)} {rng.randint(1, 4)} from {place}",
                    f"You arrive at {place}. On the {place}, you see {seen}.",
                    f"<obs>You arrive at {place}.\nNothing happens.<act>open {place}</act>",
                ]
            )
        )
    return lines


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "alfworld"
    return tok_lib.train_sentencepiece(
        alfworld_lines(), out, vocab_size=400, user_defined_symbols=TURN_MARKERS
    )


def test_sentencepiece_ids_and_files(sp_tok):
    assert sp_tok.path.name == "alfworld.model" and sp_tok.path.is_file()
    assert (sp_tok.pad_id, sp_tok.bos_id, sp_tok.eos_id) == (0, 2, 3)
    assert sp_tok.stop_ids == (3,)
    assert 300 < sp_tok.vocab_size <= 400
    assert sp_tok.token_to_id("<unk>") == 1
    assert sp_tok.token_to_id("no-such-piece-xyz") is None


@pytest.mark.parametrize(
    "text",
    [
        "go to dresser 1",
        "You arrive at countertop 2. On the countertop 2, you see a apple 1, a mug 3.",
        # Characters never seen in training go through byte fallback; whitespace is verbatim.
        "  Ünïcödé ☃ 你好\tand\nnewlines  ",
        "",
    ],
)
def test_sentencepiece_round_trip(sp_tok, text):
    ids = sp_tok.encode(text)
    assert sp_tok.decode(ids) == text
    assert 1 not in ids  # byte fallback means nothing maps to <unk>.


def test_sentencepiece_segments_concatenate(sp_tok):
    # Prompts are built from separately encoded pieces; no space may appear at the seams.
    parts = ["<obs>", "You see a mug 1.", "<act>", "take mug 1", "</act>"]
    ids = [i for p in parts for i in sp_tok.encode(p)]
    assert sp_tok.decode(ids) == "".join(parts)


def test_sentencepiece_special_symbols_single_tokens(sp_tok):
    marker_ids = [sp_tok.token_to_id(m) for m in TURN_MARKERS]
    assert marker_ids == [4, 5, 6]
    for marker, mid in zip(TURN_MARKERS, marker_ids):
        assert sp_tok.encode(marker) == [mid]
    ids = sp_tok.encode("<act>go to dresser 1</act>")
    assert ids[0] == marker_ids[1] and ids[-1] == marker_ids[2]


def test_sentencepiece_bos_eos_and_decode_specials(sp_tok):
    ids = sp_tok.encode("go to dresser 1", add_bos=True, add_eos=True)
    assert ids[0] == 2 and ids[-1] == 3
    assert ids.count(2) == 1 and ids.count(3) == 1
    assert sp_tok.decode(ids) == "go to dresser 1"
    assert sp_tok.decode(ids, skip_special=False) == "<s>go to dresser 1</s>"
    # decode does not stop at EOS; truncation is the caller's job.
    more = ids + sp_tok.encode(" more")
    assert sp_tok.decode(np.asarray(more)) == "go to dresser 1 more"


def test_sentencepiece_encode_batch(sp_tok):
    texts = ["go to dresser 1", "take mug 2 from fridge 1"]
    assert sp_tok.encode_batch(texts) == [sp_tok.encode(t) for t in texts]
    batch = sp_tok.encode_batch(texts, add_bos=True)
    assert all(row[0] == 2 for row in batch)


def test_sentencepiece_decode_rejects_out_of_vocab(sp_tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sp_tok.decode([5, sp_tok.vocab_size])
    with pytest.raises(ValueError, match="1-D"):
        sp_tok.decode(np.zeros((2, 3), np.int32))


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_training_is_deterministic(tmp_path, model_type):
    lines = alfworld_lines(120)
    a = tok_lib.train_sentencepiece(lines, tmp_path / "a", 320, model_type=model_type)
    b = tok_lib.train_sentencepiece(lines, tmp_path / "b.model", 320, model_type=model_type)
    assert b.path.name == "b.model"
    assert a.path.read_bytes() == b.path.read_bytes()


def test_sentencepiece_numbers_with_their_space_when_digits_are_not_split(tmp_path):
    """split_digits=False: a receptacle's number is one piece with its space, so an ALFWorld
    name is two tokens; by default each digit (and the space before it) is a piece."""
    lines = alfworld_lines(300)
    split = tok_lib.train_sentencepiece(lines, tmp_path / "split", 400)
    joined = tok_lib.train_sentencepiece(lines, tmp_path / "joined", 400, split_digits=False)
    pieces = lambda tok, text: [tok.decode([i]) for i in tok.encode(text)]  # noqa: E731
    assert pieces(split, " drawer 12") == [" drawer", " ", "1", "2"]
    assert pieces(joined, " drawer 3") == [" drawer", " 3"]
    for text in (" take mug 4 from shelf 11", "drawer 123456 99"):
        assert joined.decode(joined.encode(text)) == text


def test_sentencepiece_training_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        tok_lib.train_sentencepiece(["go to dresser 1"], tmp_path / "x", 100)
    with pytest.raises(ValueError, match="no non-empty texts"):
        tok_lib.train_sentencepiece(["", ""], tmp_path / "x", 300)
    with pytest.raises(ValueError, match="model_type"):
        tok_lib.train_sentencepiece(["a"], tmp_path / "x", 300, model_type="wordpiece")


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# --------------------------------------------------------------------------------------------


def build_hf_tokenizer(folder, tokenizer_config=None, **side_files):
    """Trains a small byte-level BPE whose post-processor prepends <s>, and writes its files."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<pad>", "<s>", "</s>", "<|eot|>", "<obs>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(alfworld_lines(200), trainer)
    tok.add_tokens(["<act>", "</act>"])  # Plain added tokens: kept by skip_special decode.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
            ),
        ]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in side_files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    config = {
        # AddedToken dict form, as transformers writes it, for one of them.
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
    }
    build_hf_tokenizer(folder, config)
    return folder


def test_hf_load_and_specials(hf_dir):
    tok = tok_lib.load_tokenizer(hf_dir)
    assert isinstance(tok, tok_lib.HFTokenizer)
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.bos_id == raw.token_to_id("<s>")
    assert tok.eos_id == raw.token_to_id("</s>")
    assert tok.pad_id == tok.eos_id  # No pad_token configured.
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.token_to_id("<act>") is not None and tok.token_to_id("nope-nope") is None
    # The json file itself loads the same way, reading the configs beside it.
    same = tok_lib.load_tokenizer(hf_dir / "tokenizer.json")
    assert (same.bos_id, same.eos_id) == (tok.bos_id, tok.eos_id)


@pytest.mark.parametrize(
    "text",
    ["go to dresser 1", "  Ünïcödé ☃ 你好\tand\nnewlines  ", "<act>take mug 1</act>", ""],
)
def test_hf_round_trip(hf_dir, text):
    tok = tok_lib.load_tokenizer(hf_dir)
    assert tok.decode(tok.encode(text)) == text


def test_hf_no_double_bos(hf_dir):
    tok = tok_lib.load_tokenizer(hf_dir)
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    # The post-processor really does add a BOS, so the test would catch a doubled one.
    assert raw.encode("go to dresser 1").ids[0] == tok.bos_id

    plain = tok.encode("go to dresser 1")
    assert tok.bos_id not in plain
    with_bos = tok.encode("go to dresser 1", add_bos=True, add_eos=True)
    assert with_bos == [tok.bos_id, *plain, tok.eos_id]
    # Text that already starts with the BOS string is not given a second one.
    assert tok.encode("<s>go to dresser 1", add_bos=True) == [tok.bos_id, *plain]
    assert tok.encode_batch(["go to dresser 1"], add_bos=True) == [[tok.bos_id, *plain]]
    assert tok.decode(with_bos) == "go to dresser 1"
    assert tok.decode(with_bos, skip_special=False) == "<s>go to dresser 1</s>"


def test_hf_turn_markers_single_tokens(hf_dir):
    tok = tok_lib.load_tokenizer(hf_dir)
    for marker in ("<obs>", "<act>", "</act>"):
        assert tok.encode(marker) == [tok.token_to_id(marker)]


def test_hf_qwen_style_no_bos(tmp_path):
    # Qwen2: tokenizer_config says bos_token null even though config.json has a bos_token_id;
    # several eos ids come from config.json and generation_config.json.
    build_hf_tokenizer(
        tmp_path,
        {"bos_token": None, "eos_token": "<|eot|>", "pad_token": "<pad>"},
        config={"bos_token_id": 1, "eos_token_id": 2},
        generation_config={"eos_token_id": [3, 2]},
    )
    tok = tok_lib.load_tokenizer(tmp_path)
    assert tok.bos_id is None
    assert (tok.eos_id, tok.pad_id) == (3, 0)
    assert tok.stop_ids == (3, 2)
    assert tok.encode("go to dresser 1", add_bos=True) == tok.encode("go to dresser 1")


def test_hf_without_configs_uses_post_processor_and_names(tmp_path):
    build_hf_tokenizer(tmp_path)
    tok = tok_lib.load_tokenizer(tmp_path)
    assert tok.bos_id == tok.token_to_id("<s>")
    assert tok.eos_id == tok.token_to_id("</s>")


def test_hf_config_naming_unknown_token(tmp_path):
    build_hf_tokenizer(tmp_path, {"eos_token": "<|not-there|>"})
    with pytest.raises(ValueError, match="not-there"):
        tok_lib.load_tokenizer(tmp_path)


def test_load_tokenizer_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        tok_lib.load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="vocab.txt is not a recognised tokenizer"):
        tok_lib.load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match="tokenizer.json"):
        tok_lib.load_tokenizer(tmp_path)  # A directory without tokenizer files.
