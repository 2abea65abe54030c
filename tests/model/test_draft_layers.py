"""Draft layers: chained formula, released TokenSwift checkpoint keys, heads files, untrained fallback."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenswift_trt.model.draft_layers import (
    Q4_GROUP,
    DraftLayers,
    DraftLayout,
    draft_key,
    draft_layout,
    quantized_q4,
    read_heads_file,
)
from tokenswift_trt.model.engine import UntrainedDraftLayersWarning, WeightsError, load_engine
from tokenswift_trt.model.linear import pack_linears, tiled_kernels
from tokenswift_trt.training.train_heads import save_heads

from conftest import quiet_load


def _random_draft_tensors(hidden: int, prefix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(3):
        tensors[f"{prefix}{i}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
        tensors[f"{prefix}{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
        tensors[f"{prefix}{i}.post_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    return tensors


def _rmsnorm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _chained_logits(h, heads, eps, model) -> torch.Tensor:
    """The three chained layers of `heads` (float64) from h_0 [T, hidden] -> logits [3, T, V]."""
    expected = []
    for i in range(3):
        h = h + _rmsnorm(h, heads[f"draft_layers.{i}.input_layernorm.weight"].double(), eps) @ (
            heads[f"draft_layers.{i}.linear.weight"].double().T
        )
        expected.append(
            model.lm_head(_rmsnorm(h, heads[f"draft_layers.{i}.post_layernorm.weight"].double(), eps))
        )
    return torch.stack(expected)


def test_released_checkpoint_keys_load_and_layers_are_chained(llama_dir, tmp_path):
    directory, _ = llama_dir
    base = load_file(str(directory / "model.safetensors"))
    draft = _random_draft_tensors(64, "model.medusa_layers.")
    save_file({**base, **draft}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrainedDraftLayersWarning)  # trained layers: no warning
        engine = load_engine(tmp_path)
    assert engine.trained_draft_layers and len(engine.draft_layers) == 3

    hidden = torch.randn(5, 64)
    eps = engine.config.rms_norm_eps
    expected, h = [], hidden
    for i in range(3):  # h_i = h_{i-1} + W_i rmsnorm_a_i(h_{i-1}); output rmsnorm_b_i(h_i)
        h = (
            h
            + _rmsnorm(h, draft[f"model.medusa_layers.{i}.input_layernorm.weight"], eps)
            @ draft[f"model.medusa_layers.{i}.linear.weight"].T
        )
        expected.append(_rmsnorm(h, draft[f"model.medusa_layers.{i}.post_layernorm.weight"], eps))
    with torch.no_grad():
        got = engine.draft_layers(hidden)
    for g, e in zip(got, expected):
        assert (g - e).abs().max() < 1e-5


def test_heads_file_overrides_and_shape_mismatch_is_refused(llama_dir, tmp_path):
    directory, _ = llama_dir
    heads = _random_draft_tensors(64, "draft_layers.", seed=5)
    save_file(heads, str(tmp_path / "heads.safetensors"))
    engine = load_engine(directory, heads_file=tmp_path / "heads.safetensors")
    assert engine.trained_draft_layers
    assert torch.equal(engine.draft_layers.layers[2].linear.weight, heads["draft_layers.2.linear.weight"])

    wrong = _random_draft_tensors(32, "draft_layers.")
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(WeightsError, match="draft layers.*shape"):
        load_engine(directory, heads_file=tmp_path / "wrong.safetensors")
    with pytest.raises(WeightsError, match="does not exist"):
        load_engine(directory, heads_file=tmp_path / "absent.safetensors")


def test_model_without_draft_layers_warns_and_uses_zero_layers(llama_dir):
    with pytest.warns(UntrainedDraftLayersWarning, match="acceptance will be low"):
        engine = load_engine(llama_dir[0])
    assert not engine.trained_draft_layers
    hidden = torch.randn(2, 64)
    with torch.no_grad():
        outputs = engine.draft_layers(hidden)
    # W = 0: every layer's output is the plain normalised base state
    for out in outputs:
        assert torch.allclose(out, _rmsnorm(hidden, torch.ones(64), engine.config.rms_norm_eps), atol=1e-6)
    assert quiet_load(llama_dir[0]).trained_draft_layers is False


def test_heads_file_inside_the_model_dir_is_picked_up(llama_dir, tmp_path):
    directory, _ = llama_dir
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    heads = _random_draft_tensors(64, "draft_layers.", seed=8)
    save_file(heads, str(tmp_path / "heads.safetensors"))
    engine = load_engine(tmp_path)
    assert engine.trained_draft_layers
    assert torch.equal(engine.draft_layers.layers[0].linear.weight, heads["draft_layers.0.linear.weight"])


def _root_tensors(hidden: int, seed: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "draft_layers.root.linear.weight": torch.randn(hidden, hidden, generator=generator) * 0.3,
        "draft_layers.root.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
    }


def test_root_conditioned_layers_start_from_the_root_tokens_embedding(llama_dir, tmp_path):
    directory, _ = llama_dir
    heads = {**_random_draft_tensors(64, "draft_layers.", seed=5), **_root_tensors(64)}
    save_file(heads, str(tmp_path / "heads.safetensors"))
    engine = load_engine(directory, heads_file=tmp_path / "heads.safetensors", dtype=torch.float64)
    layers, model = engine.draft_layers, engine.model.torch_model
    assert layers.root_conditioned and len(layers) == 3
    eps = engine.config.rms_norm_eps

    hidden = torch.randn(4, 64, dtype=torch.float64)
    roots = torch.tensor([5, 9, 5, 70])
    embedding = model.model.embed_tokens.weight[roots]
    # h_0 = h + U rmsnorm_r(embed(root)), then the chained layers
    h = hidden + _rmsnorm(embedding, heads["draft_layers.root.norm.weight"].double(), eps) @ (
        heads["draft_layers.root.linear.weight"].double().T
    )
    got = engine.model.draft_logits(hidden, layers, 3, roots)  # [3, T, V]
    # the norms compute in float32
    assert torch.allclose(got, _chained_logits(h, heads, eps, model), atol=1e-5)
    assert torch.allclose(got[:, 2], engine.model.draft_logits(hidden[2:3], layers, 3, roots[2:3])[:, 0])
    other_root = engine.model.draft_logits(hidden[:1], layers, 3, torch.tensor([9]))[:, 0]
    assert (other_root - got[:, 0]).abs().max() > 0.1  # the same state after another root drafts otherwise
    with pytest.raises(ValueError, match="root token"):
        layers(hidden)
    # no root known (the paper's draft pass): the base head's own pick stands in
    base = engine.model.logits(hidden)  # [T, V]
    heads_out = engine.model.head_logits(hidden, layers)  # [1 + 3, T, V]
    assert torch.allclose(heads_out[0], base, atol=1e-9)
    assert torch.allclose(
        heads_out[1:], engine.model.draft_logits(hidden, layers, 3, base.argmax(-1)), atol=1e-9
    )


@pytest.mark.parametrize("root_width", [0, 32])  # a linear root input, a root MLP
def test_a_new_root_input_repeats_the_plain_layers(llama_engine64, root_width):
    config = replace(llama_engine64.config, hidden_size=16)
    plain = DraftLayers(config, 3)
    rooted = DraftLayers(config, 3, root_conditioned=True, root_width=root_width).zero_()
    generator = torch.Generator().manual_seed(1)
    state = {
        key: torch.randn(value.shape, generator=generator) if "linear" in key else value
        for key, value in plain.state_dict().items()
    }
    plain.load_state_dict(state)
    rooted.load_state_dict({**rooted.state_dict(), **state})
    hidden, embedding = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        for a, b in zip(plain(hidden), rooted(hidden, None, embedding)):
            assert torch.equal(a, b)  # U = 0 (a root MLP: D = 0): the root adds nothing
    assert draft_layout(rooted.state_dict()) == DraftLayout(3, True, 0, root_width)
    assert draft_layout(plain.state_dict()) == DraftLayout(3, False, 0)
    assert draft_key("draft_layers.root.linear.weight") == "root.linear.weight"
    assert draft_key("model.medusa_layers.2.linear.weight") == "layers.2.linear.weight"
    if root_width:  # ... but U is not zero, so D gets a gradient
        assert rooted.root.up.weight.abs().sum() > 0
        loss = sum(out.square().sum() for out in rooted(hidden, None, embedding))
        loss.backward()
        assert rooted.root.down.weight.grad.abs().sum() > 0
        with pytest.raises(ValueError, match="root-conditioned"):
            DraftLayers(config, 3, root_width=32)


def test_a_draft_vocabulary_drafts_only_its_tokens_and_leaves_the_output_unchanged(llama_dir, tmp_path):
    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.model.sampling import SamplingConfig

    directory, _ = llama_dir
    vocab = torch.arange(0, 96, 3)  # every third id of the model's 96
    heads = {**_random_draft_tensors(64, "draft_layers.", seed=5), **_root_tensors(64)}
    save_file(heads, str(tmp_path / "plain.safetensors"))
    save_file({**heads, "draft_layers.vocab": vocab}, str(tmp_path / "vocab.safetensors"))
    whole = load_engine(directory, heads_file=tmp_path / "plain.safetensors")
    engine = load_engine(directory, heads_file=tmp_path / "vocab.safetensors")
    layers = engine.draft_layers
    assert draft_layout(layers.state_dict()) == DraftLayout(3, True, vocab.numel())
    assert torch.equal(layers.vocab, vocab) and layers.vocab_head is not None

    hidden, roots = torch.randn(4, 64), torch.tensor([5, 9, 5, 70])
    full = whole.model.draft_logits(hidden, whole.draft_layers, 3, roots)  # [3, T, V]
    restricted = engine.model.draft_logits(hidden, layers, 3, roots)
    outside = torch.ones(96, dtype=torch.bool)
    outside[vocab] = False
    # the same rows of the LM head; the draft vocabulary's are packed in float16 (drafts only)
    assert torch.allclose(restricted[..., vocab], full[..., vocab], atol=5e-3)
    assert torch.isneginf(restricted[..., outside]).all()
    heads_out = engine.model.head_logits(hidden, layers)  # the base row keeps the whole vocabulary
    assert torch.allclose(heads_out[0], whole.model.logits(hidden), atol=1e-6)
    assert torch.isneginf(heads_out[1:][..., outside]).all()

    prompt = list(range(3, 40))  # ids < 96
    for sampling in (
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.0, min_p=0.05, penalty=1.2),
    ):
        settings = dict(max_new_tokens=48, sampling=sampling, seed=3, ignore_eos=True)
        ar = generate(engine, prompt, GenerationConfig(**settings, method="ar"))[0]
        swift = GenerationConfig(**settings, tree="3,2,1", draft_source="verify")
        assert generate(engine, prompt, swift)[0] == ar  # drafting reads fewer tokens; output is AR's

    save_file({**heads, "draft_layers.vocab": torch.tensor([1, 2, 96])}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="draft vocabulary holds ids outside 0..95"):
        load_engine(directory, heads_file=tmp_path / "bad.safetensors")


def test_a_root_mlp_reads_the_state_and_the_root_and_loads_from_a_heads_file(llama_dir, tmp_path):
    directory, _ = llama_dir
    generator = torch.Generator().manual_seed(7)
    width = 48
    root = {
        "draft_layers.root.up.weight": torch.randn(width, 128, generator=generator) * 0.2,
        "draft_layers.root.down.weight": torch.randn(64, width, generator=generator) * 0.2,
        "draft_layers.root.hidden_norm.weight": 1 + 0.1 * torch.randn(64, generator=generator),
        "draft_layers.root.norm.weight": 1 + 0.1 * torch.randn(64, generator=generator),
    }
    heads = {**_random_draft_tensors(64, "draft_layers.", seed=6), **root}
    save_file(heads, str(tmp_path / "heads.safetensors"))
    engine = load_engine(directory, heads_file=tmp_path / "heads.safetensors", dtype=torch.float64)
    layers, model = engine.draft_layers, engine.model.torch_model
    assert layers.root_conditioned and layers.root_width == width
    assert draft_layout(layers.state_dict()) == DraftLayout(3, True, 0, width)
    eps = engine.config.rms_norm_eps

    hidden = torch.randn(4, 64, dtype=torch.float64)
    roots = torch.tensor([5, 9, 5, 70])
    embedding = model.model.embed_tokens.weight[roots]
    # h_0 = h + D silu(U [rmsnorm_h(h); rmsnorm_r(embed(root))]), then the chained layers
    both = torch.cat(
        (
            _rmsnorm(hidden, root["draft_layers.root.hidden_norm.weight"].double(), eps),
            _rmsnorm(embedding, root["draft_layers.root.norm.weight"].double(), eps),
        ),
        dim=-1,
    )
    up = torch.nn.functional.silu(both @ root["draft_layers.root.up.weight"].double().T)
    h = hidden + up @ root["draft_layers.root.down.weight"].double().T
    got = engine.model.draft_logits(hidden, layers, 3, roots)  # [3, T, V]
    assert torch.allclose(got, _chained_logits(h, heads, eps, model), atol=1e-5)
    other_root = engine.model.draft_logits(hidden[:1], layers, 3, torch.tensor([9]))[:, 0]
    assert (other_root - got[:, 0]).abs().max() > 0.1


def test_four_bit_weights_round_to_half_a_scale_and_load_as_the_weights_they_stand_for(llama_dir, tmp_path):
    """A heads file may hold its large weights in 4 bits (the committed SmolLM2 heads' root MLP):
    every reader gets float weights back, within half a group's scale of the originals."""
    directory, _ = llama_dir
    generator = torch.Generator().manual_seed(3)
    heads = {
        **_random_draft_tensors(64, "draft_layers.", seed=4),
        "draft_layers.root.up.weight": torch.randn(128, 128, generator=generator) * 0.2,
        "draft_layers.root.down.weight": torch.randn(64, 128, generator=generator) * 0.2,
        "draft_layers.root.hidden_norm.weight": torch.ones(64),
        "draft_layers.root.norm.weight": torch.ones(64),
        "draft_layers.vocab": torch.arange(3, 40),
    }
    packed = quantized_q4(
        heads, min_numel=8000
    )  # the root matrices (16,384 and 8,192), not the 64 x 64 layers
    up, down = "draft_layers.root.up.weight", "draft_layers.root.down.weight"
    assert {up + ".q4", up + ".q4_scales", down + ".q4", down + ".q4_scales"} <= set(packed)
    assert up not in packed and packed[up + ".q4"].dtype == torch.uint8
    assert packed[up + ".q4"].shape == (128, 64) and packed[up + ".q4_scales"].shape == (128, 128 // Q4_GROUP)
    small = [k for k in heads if k not in (up, down)]
    assert all(torch.equal(packed[k], heads[k]) for k in small)  # small and integer tensors as they were
    packed["draft_layers.vocab"] = heads["draft_layers.vocab"].int()  # ids may be stored in 32 bits
    save_file(packed, str(tmp_path / "q4.safetensors"))
    restored = read_heads_file(tmp_path / "q4.safetensors")
    assert set(restored) == set(heads) and restored["draft_layers.vocab"].dtype == torch.int64
    for key in (up, down):
        scale = packed[key + ".q4_scales"].float().repeat_interleave(Q4_GROUP, dim=1)
        error = (restored[key] - heads[key]).abs()
        assert (error <= scale / 2 + 1e-6).all() and error.max() > 0  # rounded, by at most half a step
    engine = load_engine(directory, heads_file=tmp_path / "q4.safetensors")
    assert torch.equal(engine.draft_layers.root.up.weight, restored[up])
    wider = quantized_q4(heads, min_numel=8000, group=64)  # another group: readers take it from the shapes
    assert wider[up + ".q4_scales"].shape == (128, 2)
    save_file(wider, str(tmp_path / "q4-64.safetensors"))
    error = (read_heads_file(tmp_path / "q4-64.safetensors")[up] - heads[up]).abs()
    assert (error <= wider[up + ".q4_scales"].float().repeat_interleave(64, dim=1) / 2 + 1e-6).all()
    broken = {k: v for k, v in packed.items() if k != up + ".q4_scales"}
    save_file(broken, str(tmp_path / "broken.safetensors"))
    with pytest.raises(WeightsError, match="has no draft_layers.root.up.weight.q4_scales"):
        load_engine(directory, heads_file=tmp_path / "broken.safetensors")


def test_a_path_input_drafts_from_the_state_and_token_before_and_loads_from_a_heads_file(
    path_engine64, llama_dir, tmp_path
):
    """s' = s + M(s, embed(t)), s'' = s' + W rmsnorm_a(s'), logits lm_head(rmsnorm_b(s'')); the
    heads file's layout says its width; a path input without a root input is refused."""
    engine = path_engine64
    layers, model = engine.draft_layers, engine.model.torch_model
    assert layers.path_width == 24 and draft_layout(layers.state_dict()).path_width == 24
    eps = engine.config.rms_norm_eps
    weights = {k: v.double() for k, v in layers.path.state_dict().items()}
    state = torch.randn(3, 64, dtype=torch.float64)
    tokens = torch.tensor([4, 50, 4])
    both = torch.cat(
        (
            _rmsnorm(state, weights["input.hidden_norm.weight"], eps),
            _rmsnorm(model.model.embed_tokens.weight[tokens], weights["input.norm.weight"], eps),
        ),
        dim=-1,
    )
    up = torch.nn.functional.silu(both @ weights["input.up.weight"].T)
    s1 = state + up @ weights["input.down.weight"].T
    s2 = s1 + _rmsnorm(s1, weights["layer.input_layernorm.weight"], eps) @ weights["layer.linear.weight"].T
    expected = model.lm_head(_rmsnorm(s2, weights["layer.post_layernorm.weight"], eps))
    next_state, logits = engine.model.path_logits(state, layers, tokens, first=False)
    torch.testing.assert_close(next_state, s2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    # first level: layer 1 of the chain from the verify pass's state and the root
    first_state, first_logits = engine.model.path_logits(state, layers, tokens, first=True)
    assert torch.allclose(first_logits, engine.model.draft_logits(state, layers, 1, tokens)[0], atol=1e-9)
    assert torch.allclose(first_state, layers.chain(state, 1, model.model.embed_tokens(tokens))[0][0])

    save_heads(layers, tmp_path / "path.safetensors")
    loaded = load_engine(llama_dir[0], heads_file=tmp_path / "path.safetensors", dtype=torch.float64)
    for key, value in layers.state_dict().items():
        assert torch.equal(loaded.draft_layers.state_dict()[key], value), key
    saved = load_file(str(tmp_path / "path.safetensors"))
    save_file({k: v for k, v in saved.items() if ".root." not in k}, str(tmp_path / "no-root.safetensors"))
    with pytest.raises(WeightsError, match="path input needs a root input"):
        load_engine(llama_dir[0], heads_file=tmp_path / "no-root.safetensors")


@pytest.mark.skipif(tiled_kernels() is None, reason="needs the tiled CPU kernel (x86, AVX2)")
@pytest.mark.parametrize(
    "layout",
    [{}, {"root_conditioned": True}, {"root_conditioned": True, "root_width": 40, "path_width": 24}],
    ids=["plain", "root-linear", "root-mlp-path"],
)
def test_the_compiled_draft_chain_computes_what_the_modules_do(llama_dir, monkeypatch, layout):
    """CPU inference in float32 runs the chain (root input, layers; a path input's step) in one
    compiled call; its states equal the PyTorch modules' on the same packed products."""
    from tokenswift_trt.model import draft_layers as module

    config = quiet_load(llama_dir[0]).config
    layers = DraftLayers(config, 3, **layout)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, value in layers.state_dict().items():
            if value.is_floating_point():
                scale, offset = (0.1, 1.0) if "norm" in name else (0.3, 0.0)
                value.copy_(torch.randn(value.shape, generator=generator) * scale + offset)
    assert pack_linears(layers, half=True) > 0
    hidden = torch.randn(5, config.hidden_size, generator=generator)
    embedding = torch.randn(5, config.hidden_size, generator=generator) if layers.root_conditioned else None
    with torch.inference_mode():
        assert module.compiled_chain(layers.root, list(layers.layers), hidden, embedding) is not None
        fused = layers.chain(hidden, 2, embedding)
        path = layers.path(hidden, embedding) if layers.path is not None else None
        monkeypatch.setattr(module, "compiled_chain", lambda *args: None)
        plain = layers.chain(hidden, 2, embedding)
        assert len(fused) == len(plain) == 2
        for (state, normed), (state_ref, normed_ref) in zip(fused, plain):
            torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(normed, normed_ref, atol=1e-5, rtol=1e-5)
        if path is not None:
            for got, want in zip(path, layers.path(hidden, embedding)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # training and export keep the modules
        assert module.compiled_chain(layers.root, list(layers.layers), hidden, embedding) is None
