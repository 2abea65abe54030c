"""Draft-layer training: the loss falls, checkpoint/resume is exact, outputs load as draft layers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.model.draft_layers import DraftLayers
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig, process_logits
from tokenswift_trt.training.train_heads import (
    HEADS_FILE,
    HeadsTrainer,
    TrainHeadsConfig,
    TrainingError,
    base_hidden,
    coupled_hit,
    draft_accuracy,
    lr_at,
    sampled_teacher,
    save_heads,
    write_combined,
)

from conftest import quiet_load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=2)


def _periodic_ids(length: int = 4000) -> torch.Tensor:
    pattern = torch.tensor([17, 40, 99, 3, 250, 61, 8])
    return pattern.repeat(length // len(pattern) + 1)[:length]


def _trained_and_saved(model_dir, tmp_path):
    """(engine, config, trainer) after 2 steps, its layers saved as tmp_path / HEADS_FILE."""
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(steps=2, seq_len=32, grad_accum=1, warmup_steps=1)
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    trainer.run()
    save_heads(trainer.draft_layers, tmp_path / HEADS_FILE)
    return engine, config, trainer


@pytest.mark.parametrize("loss", ["tokens", "distill", "sampled", "coupled"])
def test_loss_decreases_within_a_few_steps(model_dir, tmp_path, loss):
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(
        steps=25, seq_len=48, batch=2, grad_accum=1, lr=5e-3, warmup_steps=3, checkpoint_every=100, loss=loss
    )
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    before = draft_accuracy(engine, trainer.draft_layers, [_periodic_ids(200)])
    losses = []
    trainer.run(lambda step, loss: losses.append(loss))
    assert len(losses) == 25
    after = draft_accuracy(engine, trainer.draft_layers, [_periodic_ids(200)])
    if loss == "tokens":
        assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
        assert min(after.layers) > 0.3  # chance is 1/258: a periodic sequence is learnable at every depth
    else:  # the target is the random base model's own (periodic) prediction, entropy included
        assert sum(losses[-3:]) < sum(losses[:3])
        # a random base is nearly flat, so its top-1 is hard to hit; training still moves every layer
        assert all(a > b + 0.05 for a, b in zip(after.agreement, before.agreement))


def test_agreement_counts_the_base_models_own_pick_for_the_same_token(model_dir):
    engine = quiet_load(model_dir)
    ids = _periodic_ids(100)
    accuracy = draft_accuracy(engine, engine.draft_layers, [ids])
    hidden = base_hidden(engine, ids)
    base = engine.model.logits(hidden).argmax(-1)  # [T]: the pick for x[t + 1]
    states = engine.draft_layers(hidden)
    for i, state in enumerate(states, start=1):
        pick = engine.model.lm_head(state).argmax(-1)  # layer i at t: x[t + 1 + i]
        expected = (pick[: -(i + 1)] == base[i:-1]).float().mean().item()
        assert accuracy.agreement[i - 1] == pytest.approx(expected)


def test_training_can_start_from_trained_layers_and_refuses_a_wrong_file(model_dir, tmp_path):
    engine, config, first = _trained_and_saved(model_dir, tmp_path)
    warm = HeadsTrainer(engine, _periodic_ids(), config, tmp_path, init_heads=tmp_path / HEADS_FILE)
    for key, value in first.draft_layers.state_dict().items():
        assert torch.equal(warm.draft_layers.state_dict()[key], value)
    with pytest.raises(TrainingError, match="does not exist"):
        HeadsTrainer(engine, _periodic_ids(), config, tmp_path, init_heads=tmp_path / "missing.safetensors")
    small = DraftLayers(replace(engine.config, hidden_size=8), 3)
    save_heads(small, tmp_path / "small.safetensors")
    with pytest.raises(TrainingError, match="hidden size"):
        HeadsTrainer(engine, _periodic_ids(), config, tmp_path, init_heads=tmp_path / "small.safetensors")
    with pytest.raises(TrainingError, match="loss must be one of"):
        TrainHeadsConfig(loss="mse").validate()
    with pytest.raises(TrainingError, match="teacher: min-p must be"):
        TrainHeadsConfig(loss="sampled", teacher_min_p=1.5).validate()
    with pytest.raises(TrainingError, match="teacher: penalty must be"):
        TrainHeadsConfig(loss="sampled", teacher_penalty=0.5).validate()


def test_the_sampled_teacher_is_what_decoding_samples_from():
    """Row t of the "sampled" teacher is the softmax of decoding's own transforms (penalty over the
    W tokens before x[t + 1], then min-p) of the base logits for x[t + 1]; within a draft vocabulary,
    the same over its columns, with tokens outside it ignored by the penalty."""
    generator = torch.Generator().manual_seed(0)
    vocab_size, length, window = 60, 40, 6
    logits = torch.randn(length, vocab_size, generator=generator) * 3
    ids = torch.randint(0, 12, (length,), generator=generator)  # few distinct tokens: windows repeat them
    sampling = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.5, penalty_window=window)
    teacher = sampled_teacher(logits, ids, None, sampling)[0]
    for t in range(length):
        recent = ids[max(0, t + 1 - window) : t + 1]
        expected = torch.softmax(process_logits(logits[t : t + 1], recent, sampling)[0], dim=-1)
        torch.testing.assert_close(teacher[t], expected)
    assert (teacher == 0).any(dim=-1).all()  # min-p dropped tokens in every row
    # the raw softmax the "distill" loss uses is a different target
    assert not torch.allclose(teacher, torch.softmax(logits, dim=-1), atol=1e-3)

    vocab = torch.tensor([3, 0, 7, 11, 25, 40, 41, 59, 2, 5, *range(12, 24)])  # 22 columns, without 1, 4, 6
    restricted = sampled_teacher(logits[:, vocab], ids, vocab, sampling)[0]
    for t in range(length):
        recent = ids[max(0, t + 1 - window) : t + 1]
        penalised = process_logits(logits[t : t + 1], recent, replace(sampling, min_p=0.0))[0, vocab]
        cut = process_logits(penalised[None], ids[:0], replace(sampling, penalty=1.0))[0]  # min-p alone
        torch.testing.assert_close(restricted[t], torch.softmax(cut, dim=-1))


def test_the_coupled_loss_scores_how_often_a_draft_ranked_with_the_targets_noise_is_its_sample():
    """`coupled_hit` in closed form against counting: the target samples argmax(log p + g), the draft
    ranks argmax(log q + g) with the same Gumbel noise g (decoding's coupled drafting), over many g."""
    generator = torch.Generator().manual_seed(0)
    rows, vocab_size, draws = 5, 80, 40_000
    target = torch.randn(rows, vocab_size, generator=generator) * 3
    cut = SamplingConfig(min_p=0.1, penalty=1.0, penalty_window=0)
    teacher = sampled_teacher(target, torch.zeros(rows, dtype=torch.long), None, cut)[0]  # min-p cut
    student = 0.6 * target + torch.randn(rows, vocab_size, generator=generator) * 2
    hits = coupled_hit(teacher, student)
    noise = -torch.log(
        -torch.log(torch.rand(draws, rows, vocab_size, generator=generator, dtype=torch.float64))
    )
    sampled = (teacher.double().log() + noise).argmax(-1)  # [draws, rows]
    drafted = (torch.log_softmax(student.double(), -1) + noise).argmax(-1)
    counted = (sampled == drafted).double().mean(0)
    torch.testing.assert_close(hits.double(), counted, atol=0.01, rtol=0)
    assert hits.min() > 0.02 and hits.max() < 0.9  # neither trivial case
    torch.testing.assert_close(coupled_hit(teacher, teacher.log()), torch.ones(rows))  # q = p: always
    # truncated to the teacher's few likely tokens, the same value (the rest enters through q's mass)
    torch.testing.assert_close(coupled_hit(teacher, student, support=int((teacher > 0).sum(-1).max())), hits)


def test_held_out_acceptance_is_how_often_decodings_own_sampler_draws_the_first_draft(model_dir, tmp_path):
    """`coupled_acceptance` against counting with decoding's sampler: the target's sample and layer
    1's draft (over a draft vocabulary) both through `TorchSampler`, penalty window and min-p
    included, with the same noise row, over many rows; `draft_accuracy` reports its mean."""
    from tokenswift_trt.model.sampling import TorchSampler
    from tokenswift_trt.training.train_heads import (
        base_logits,
        coupled_acceptance,
        draft_logits,
        head_weight,
        root_embeddings,
    )

    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(steps=2, seq_len=32, grad_accum=1, warmup_steps=1, draft_vocab=64)
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    trainer.run()
    layers = trainer.draft_layers.eval()
    ids = torch.cat(
        (_periodic_ids(40), torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(1)))
    )
    sampling = SamplingConfig(min_p=0.1, penalty=1.5, penalty_window=8)
    with torch.no_grad():
        hidden = base_hidden(engine, ids)
        weight = head_weight(engine)
        base = base_logits(engine, weight, hidden)  # [T, V]
        draft = draft_logits(weight, layers, hidden, root_embeddings(engine, layers, ids))[
            0
        ]  # layer 1, [T, K]
        accuracy = draft_accuracy(engine, layers, [ids], sampling)
        targets = sampled_teacher(base, ids, None, sampling)
        mean = float(coupled_acceptance(layers.vocab, targets, draft, 1, sampling).mean())
    assert accuracy.acceptance[0] == pytest.approx(mean, abs=1e-5)
    assert draft_accuracy(engine, layers, [ids]).acceptance == []  # greedy (no settings): not scored

    # a random base is nearly flat: sharpen it, and give the draft a noisy copy of the row it drafts
    generator = torch.Generator().manual_seed(2)
    base = base * 8
    vocab = layers.vocab
    draft = base.roll(-1, 0)[:, vocab] + torch.randn(base.shape[0], vocab.numel(), generator=generator) * 2
    acceptance = coupled_acceptance(
        vocab, sampled_teacher(base, ids, None, sampling), draft, 1, sampling
    )  # [T - 2]
    full = draft.new_full(base.shape, float("-inf"))
    full[:, vocab] = draft
    sampler, draws = TorchSampler(sampling), 6000
    checked = []
    order = acceptance.argsort().tolist()
    for t in order[:: len(order) // 4]:  # from least to most likely: layer 1 at t drafts x[t + 2], the
        # base's row t + 1, with the window before it
        window = ids[max(0, t + 2 - 8) : t + 2]
        noise = -torch.log(
            -torch.log(torch.rand(draws, base.shape[1], generator=generator, dtype=torch.float64))
        )
        sampled = sampler.sample_rows(base[t + 1].expand(draws, -1), window, noise)
        drafted = sampler.sample_rows(full[t].expand(draws, -1), window, noise)
        counted = float((sampled == drafted).double().mean())
        assert float(acceptance[t]) == pytest.approx(counted, abs=0.025), t
        checked.append(counted)
    assert max(checked) - min(checked) > 0.3  # positions that differ: not one constant


def test_checkpoint_resume_gives_identical_weights(model_dir, tmp_path):
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(steps=6, seq_len=32, batch=1, grad_accum=2, warmup_steps=2, checkpoint_every=3)
    straight = HeadsTrainer(engine, _periodic_ids(), config, tmp_path / "a")
    (tmp_path / "a").mkdir()
    straight.run()

    (tmp_path / "b").mkdir()
    first = HeadsTrainer(engine, _periodic_ids(), config, tmp_path / "b")
    for _ in range(3):
        first.train_step()
    first.save_checkpoint()
    resumed = HeadsTrainer(engine, _periodic_ids(), config, tmp_path / "b")
    resumed.load_checkpoint()
    assert resumed.step == 3
    resumed.run()
    for key, value in straight.draft_layers.state_dict().items():
        assert torch.equal(value, resumed.draft_layers.state_dict()[key]), key

    changed = TrainHeadsConfig(
        steps=6, seq_len=32, batch=1, grad_accum=2, warmup_steps=2, checkpoint_every=3, lr=1e-3
    )
    with pytest.raises(TrainingError, match="lr"):
        HeadsTrainer(engine, _periodic_ids(), changed, tmp_path / "b").load_checkpoint()


def test_heads_file_and_combined_checkpoint_load_as_trained_draft_layers(model_dir, tmp_path):
    _, _, trainer = _trained_and_saved(model_dir, tmp_path)
    with_heads = load_engine(model_dir, heads_file=tmp_path / HEADS_FILE)
    combined = load_engine(write_combined(model_dir, tmp_path / HEADS_FILE, tmp_path / "combined"))
    for engine_with in (with_heads, combined):
        assert engine_with.trained_draft_layers
        for key, value in trainer.draft_layers.state_dict().items():
            assert torch.equal(engine_with.draft_layers.state_dict()[key], value)


def test_schedule_warms_up_then_decays_to_zero():
    config = TrainHeadsConfig(steps=100, lr=1.0, warmup_steps=10)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(10, config) == pytest.approx(1.0)
    assert lr_at(55, config) == pytest.approx(0.5)
    assert lr_at(100, config) == pytest.approx(0.0)


def test_cli_trains_resumes_and_refuses_bad_input(model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join('{"text": "the cat sat on the mat. the dog sat on the log."}' for _ in range(40))
    )
    out = tmp_path / "run"
    args = [
        "train-heads",
        "--model-dir",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--checkpoint-every",
        "2",
        "--grad-accum",
        "1",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (out / HEADS_FILE).is_file() and "layer 3 (+4)" in result.stdout

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "--resume" in again.stderr
    resumed = CliRunner().invoke(
        main,
        [
            *args[:-8],
            "--seq-len",
            "32",
            "--steps",
            "6",
            "--warmup-steps",
            "1",
            "--checkpoint-every",
            "2",
            "--grad-accum",
            "1",
            "--resume",
        ],
    )
    assert resumed.exit_code == 2 and "steps" in resumed.stderr  # settings differ from the checkpoint

    missing = CliRunner().invoke(
        main,
        [
            "train-heads",
            "--model-dir",
            str(model_dir),
            "--data",
            str(tmp_path / "none.txt"),
            "--out",
            str(out),
        ],
    )
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    malformed = CliRunner().invoke(
        main, ["train-heads", "--model-dir", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "x")]
    )
    assert malformed.exit_code == 2 and "bad.jsonl: no 'text' column (it has txt)" in malformed.stderr
    assert "--field" in malformed.stderr and "Generating" not in malformed.stderr
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"text": "a"}\n{"text": \n')
    unreadable = CliRunner().invoke(
        main,
        ["train-heads", "--model-dir", str(model_dir), "--data", str(torn), "--out", str(tmp_path / "x")],
    )
    assert unreadable.exit_code == 2 and unreadable.stderr.count("\n") == 1, unreadable.stderr
    assert "cannot read" in unreadable.stderr and "torn.jsonl" in unreadable.stderr

    cached_out = tmp_path / "cached"
    cached = CliRunner().invoke(main, [*args[:6], str(cached_out), *args[7:], "--state-cache", "2"])
    assert cached.exit_code == 0, cached.output
    assert "base states" in cached.stderr and (cached_out / HEADS_FILE).is_file()
    written = json.loads((cached_out / "train_heads.json").read_text())
    assert written["config"]["state_cache"] == 2
    command = written["meta"]["command"]  # the command as given: a repeatable option once per value
    assert command.startswith("tokenswift-trt train-heads --model-dir ") and "--state-cache 2" in command
    assert f"--data {args[4]}" in command and "PosixPath" not in command and written["meta"]["date"]
    negative = CliRunner().invoke(main, [*args[:6], str(tmp_path / "y"), *args[7:], "--state-cache", "-1"])
    assert negative.exit_code == 2 and "state cache" in negative.stderr


def _pair_ids(length: int = 4000, seed: int = 0) -> torch.Tensor:
    """a1 f(a1) a2 f(a2) ...: each a random among five tokens, f(a) = a + 100. The token after a
    is fixed by a, but a itself is unpredictable: only a layer that reads the root (a) can know it."""
    firsts = torch.randint(10, 15, (length // 2,), generator=torch.Generator().manual_seed(seed))
    return torch.stack((firsts, firsts + 100), dim=1).flatten()


def test_root_conditioned_layers_learn_what_follows_the_root(model_dir, tmp_path):
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(
        steps=40,
        seq_len=64,
        batch=2,
        grad_accum=1,
        lr=1e-2,
        warmup_steps=3,
        checkpoint_every=100,
        loss="tokens",
    )
    plain = HeadsTrainer(engine, _pair_ids(), config, tmp_path)
    rooted = HeadsTrainer(engine, _pair_ids(), replace(config, root_conditioned=True), tmp_path)
    assert rooted.draft_layers.root_conditioned and not plain.draft_layers.root_conditioned
    for trainer in (plain, rooted):
        trainer.run()
    held_out = [_pair_ids(400, seed=1)]
    plain_top1 = draft_accuracy(engine, plain.draft_layers, held_out).layers[0]
    rooted_top1 = draft_accuracy(engine, rooted.draft_layers, held_out).layers[0]
    # layer 1 at t predicts x[t + 2]: half the time it follows the root x[t + 1] = a (knowable
    # from the root only), otherwise it is a fresh a (1 in 5 at best)
    assert plain_top1 < 0.35 < 0.5 < rooted_top1

    save_heads(rooted.draft_layers, tmp_path / "rooted.safetensors")
    loaded = load_engine(model_dir, heads_file=tmp_path / "rooted.safetensors")
    assert loaded.draft_layers.root_conditioned
    for key, value in rooted.draft_layers.state_dict().items():
        assert torch.equal(loaded.draft_layers.state_dict()[key], value)
    # plain layers start root-conditioned training (the root input starts at zero); not the reverse
    save_heads(plain.draft_layers, tmp_path / "plain.safetensors")
    warm = HeadsTrainer(
        engine,
        _pair_ids(),
        replace(config, root_conditioned=True),
        tmp_path,
        init_heads=tmp_path / "plain.safetensors",
    )
    assert torch.equal(warm.draft_layers.layers[1].linear.weight, plain.draft_layers.layers[1].linear.weight)
    assert not warm.draft_layers.root.linear.weight.any()
    with pytest.raises(TrainingError, match="--root-conditioned"):
        HeadsTrainer(engine, _pair_ids(), config, tmp_path, init_heads=tmp_path / "rooted.safetensors")

    # a root MLP learns the same, goes on from layers with a linear root input (its own root input
    # starting at zero output), and round-trips through a heads file
    wide = HeadsTrainer(
        engine,
        _pair_ids(),
        replace(config, root_conditioned=True, root_width=32),
        tmp_path,
        init_heads=tmp_path / "rooted.safetensors",
    )
    assert wide.draft_layers.root_width == 32 and not wide.draft_layers.root.down.weight.any()
    assert torch.equal(wide.draft_layers.layers[0].linear.weight, rooted.draft_layers.layers[0].linear.weight)
    wide.run()
    assert draft_accuracy(engine, wide.draft_layers, held_out).layers[0] > 0.5
    save_heads(wide.draft_layers, tmp_path / "wide.safetensors")
    loaded = load_engine(model_dir, heads_file=tmp_path / "wide.safetensors")
    assert loaded.draft_layers.root_width == 32
    for key, value in wide.draft_layers.state_dict().items():
        assert torch.equal(loaded.draft_layers.state_dict()[key], value)


def test_training_counts_a_draft_vocabulary_that_the_heads_file_and_engine_carry(model_dir, tmp_path):
    from tokenswift_trt.training.train_heads import frequent_tokens

    counts = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])
    assert frequent_tokens(counts, 12, 3).tolist() == [5, 7, 9]
    assert frequent_tokens(counts, 12, 6).tolist() == [0, 1, 2, 5, 7, 9]  # unseen ids fill up, lowest first
    assert frequent_tokens(counts, 12, 0) is None and frequent_tokens(counts, 12, 12) is None

    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(steps=1, seq_len=32, grad_accum=1, warmup_steps=1, draft_vocab=16)
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    assert set([17, 40, 99, 3, 250, 61, 8]) <= set(trainer.draft_layers.vocab.tolist())
    trainer.run()
    save_heads(trainer.draft_layers, tmp_path / HEADS_FILE)
    loaded = load_engine(model_dir, heads_file=tmp_path / HEADS_FILE)
    assert torch.equal(loaded.draft_layers.vocab, trainer.draft_layers.vocab)
    assert loaded.draft_layers.vocab.dtype == torch.int64 and loaded.draft_layers.vocab_head is not None
    combined = load_engine(write_combined(model_dir, tmp_path / HEADS_FILE, tmp_path / "combined"))
    assert torch.equal(combined.draft_layers.vocab, trainer.draft_layers.vocab)
    # a warm start keeps the vocabulary of its own training text
    other = HeadsTrainer(
        engine, _periodic_ids() + 1, config, tmp_path / "b", init_heads=tmp_path / HEADS_FILE
    )
    assert 18 in other.draft_layers.vocab.tolist() and 17 not in other.draft_layers.vocab.tolist()
    with pytest.raises(TrainingError, match="draft vocabulary size"):
        TrainHeadsConfig(draft_vocab=-1).validate()


def test_cli_gives_a_heads_file_a_draft_vocabulary(model_dir, tmp_path):
    _, _, trainer = _trained_and_saved(model_dir, tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat. " * 50)
    out = tmp_path / "with-vocab.safetensors"
    args = [
        "draft-vocab",
        "--model-dir",
        str(model_dir),
        "--heads",
        str(tmp_path / HEADS_FILE),
        "--data",
        str(data),
    ]
    result = CliRunner().invoke(main, [*args, "--size", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "draft vocabulary of 20 tokens" in result.stdout and "covers 100.0%" in result.stdout
    engine = load_engine(model_dir, heads_file=out)
    assert engine.draft_layers.vocab.numel() == 20
    for key, value in trainer.draft_layers.state_dict().items():  # the layers themselves are unchanged
        assert torch.equal(engine.draft_layers.state_dict()[key], value)
    for bad, message in (
        (["--size", "0"], "--size must be positive"),
        (["--data", str(tmp_path / "no.txt")], "does not exist"),
    ):
        failed = CliRunner().invoke(main, [*args, *bad])
        assert failed.exit_code == 2 and message in failed.stderr and "Traceback" not in failed.output


@pytest.mark.parametrize("loss", ["tokens", "distill"])
def test_layers_with_a_draft_vocabulary_train_and_are_scored_over_its_rows_only(model_dir, tmp_path, loss):
    from tokenswift_trt.training.train_heads import draft_logits, head_weight, vocab_targets

    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(
        steps=25, seq_len=48, batch=2, grad_accum=1, lr=5e-3, warmup_steps=3, draft_vocab=16, loss=loss
    )
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    layers = trainer.draft_layers
    vocab = layers.vocab.tolist()
    outside = next(token for token in range(engine.config.vocab_size) if token not in vocab)
    assert vocab_targets(layers, torch.tensor([vocab[3], outside, vocab[0]])).tolist() == [3, -100, 0]
    hidden = base_hidden(engine, _periodic_ids(40))
    logits = draft_logits(head_weight(engine), layers, hidden, None)
    assert [tuple(item.shape) for item in logits] == [(40, 16)] * len(layers)  # the vocabulary's rows
    losses = []
    trainer.run(lambda step, value: losses.append(value))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2  # (distill: a teacher's entropy is its floor)
    if loss == "tokens":  # chance is 1/16 within the vocabulary
        assert min(draft_accuracy(engine, layers, [_periodic_ids(200)]).layers) > 0.3
    # the scores are those of the engine's own drafting (its vocabulary head over the same rows)
    save_heads(layers, tmp_path / HEADS_FILE)
    loaded = load_engine(model_dir, heads_file=tmp_path / HEADS_FILE)
    with torch.inference_mode():
        ids = _periodic_ids(64)
        states = base_hidden(loaded, ids)
        picks = loaded.model.draft_logits(states, loaded.draft_layers, 1).argmax(-1)[0]  # [T]: x[t + 2]
    expected = (picks[:-2] == ids[2:]).float().mean().item()
    assert draft_accuracy(loaded, loaded.draft_layers, [ids]).layers[0] == pytest.approx(expected)


def test_a_state_cache_trains_from_base_states_computed_once(model_dir, tmp_path, monkeypatch):
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(
        steps=25, seq_len=48, batch=2, grad_accum=1, lr=5e-3, warmup_steps=3, loss="tokens", state_cache=3
    )
    forwards = []
    model_forward = type(engine.model).forward
    monkeypatch.setattr(
        type(engine.model),
        "forward",
        lambda self, *a, **k: forwards.append(1) or model_forward(self, *a, **k),
    )
    trainer = HeadsTrainer(engine, _periodic_ids(), config, tmp_path)
    built = []
    trainer.cache_states(built.append)
    assert built == [1, 2, 3] and len(forwards) == 3
    cached = trainer.cached
    assert cached is not None and cached.states.dtype == torch.float16
    assert cached.ids.shape == (3, 48) and cached.states.shape == (3, 48, engine.config.hidden_size)
    for ids, states in zip(cached.ids, cached.states):  # the base's own states, rounded to float16
        torch.testing.assert_close(states.float(), base_hidden(engine, ids), atol=2e-3, rtol=1e-3)
    losses = []
    forwards.clear()
    trainer.run(lambda step, loss: losses.append(loss))
    assert not forwards  # no base forward per step
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    assert min(draft_accuracy(engine, trainer.draft_layers, [_periodic_ids(200)]).layers) > 0.3

    # a resumed run rebuilds the same cache and continues identically
    (tmp_path / "b").mkdir()
    first = HeadsTrainer(engine, _periodic_ids(), replace(config, steps=6), tmp_path / "b")
    for _ in range(3):
        first.train_step()
    first.save_checkpoint()
    resumed = HeadsTrainer(engine, _periodic_ids(), replace(config, steps=6), tmp_path / "b")
    resumed.load_checkpoint()
    resumed.run()
    first.run()
    for key, value in first.draft_layers.state_dict().items():
        assert torch.equal(value, resumed.draft_layers.state_dict()[key]), key
    with pytest.raises(TrainingError, match="state cache"):
        replace(config, state_cache=-1).validate()


def test_a_path_input_learns_what_follows_the_drafted_token_on_top_of_frozen_layers(model_dir, tmp_path):
    """Path drafting (model/draft_layers.PathInput): depth 2 at t reads the token drafted at depth
    1, x[t + 2]. In a1 f(a1) a2 f(a2) ... x[t + 3] = f(x[t + 2]) half the time, which the chained
    layer 2 (reading h_t and x[t + 1] only) cannot know and the path input can."""
    engine = quiet_load(model_dir)
    config = TrainHeadsConfig(
        steps=40, seq_len=64, batch=2, grad_accum=1, lr=1e-2, warmup_steps=3, loss="tokens", root_width=32
    )
    rooted = HeadsTrainer(engine, _pair_ids(), config, tmp_path)
    rooted.run()
    save_heads(rooted.draft_layers, tmp_path / "rooted.safetensors")
    held_out = [_pair_ids(400, seed=1)]
    chained = draft_accuracy(engine, rooted.draft_layers, held_out)
    assert chained.path_layers == [] and chained.layers[1] < 0.35

    path_config = replace(config, path_width=32, path_only=True)
    (tmp_path / "path").mkdir()
    rooted_file = tmp_path / "rooted.safetensors"
    trainer = HeadsTrainer(engine, _pair_ids(), path_config, tmp_path / "path", rooted_file)
    layers = trainer.draft_layers
    # it starts as a copy of the root MLP and layer 1 (same width), the layers as trained
    assert torch.equal(layers.path.input.up.weight, rooted.draft_layers.root.up.weight)
    assert torch.equal(layers.path.layer.linear.weight, rooted.draft_layers.layers[0].linear.weight)
    trainer.run()
    after = layers.state_dict()
    frozen = {k: v for k, v in rooted.draft_layers.state_dict().items()}
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # only the path input trained
    assert not torch.equal(after["path.input.down.weight"], frozen["root.down.weight"])
    accuracy = draft_accuracy(engine, layers, held_out)
    assert len(accuracy.path_layers) == 2 and accuracy.path_layers[0] > 0.5 > 0.35 > chained.layers[1]

    save_heads(layers, tmp_path / "path.safetensors")
    loaded = load_engine(model_dir, heads_file=tmp_path / "path.safetensors")
    assert loaded.draft_layers.path_width == 32
    for key, value in after.items():
        assert torch.equal(loaded.draft_layers.state_dict()[key], value)
    with pytest.raises(TrainingError, match="--path-width 32"):  # trained on without one
        HeadsTrainer(engine, _pair_ids(), config, tmp_path, init_heads=tmp_path / "path.safetensors")
    with pytest.raises(TrainingError, match="--init-heads"):
        HeadsTrainer(engine, _pair_ids(), path_config, tmp_path)
    # trained on as they are, the layers keep their draft vocabulary: another size is refused
    (tmp_path / "vocab").mkdir()
    small = HeadsTrainer(engine, _pair_ids(), replace(config, draft_vocab=8, steps=1), tmp_path / "vocab")
    small_file = tmp_path / "vocab" / "small.safetensors"
    save_heads(small.draft_layers, small_file)
    for other in (16, 0):  # another size, or none
        with pytest.raises(TrainingError, match="--draft-vocab 8"):
            HeadsTrainer(engine, _pair_ids(), replace(path_config, draft_vocab=other), tmp_path, small_file)

    # the command line: a path input trained on the saved layers, reported per depth
    data = tmp_path / "pairs.txt"
    data.write_text(" ".join(f"{a} {a + 100}" for a in _pair_ids(400).tolist()[::2]))
    args = ["train-heads", "--model-dir", str(model_dir), "--data", str(data), "--out", str(tmp_path / "cli")]
    args += ["--seq-len", "32", "--steps", "2", "--warmup-steps", "1", "--grad-accum", "1"]
    args += ["--root-width", "32", "--path-width", "32", "--path-only"]
    result = CliRunner().invoke(main, args + ["--init-heads", str(tmp_path / "rooted.safetensors")])
    assert result.exit_code == 0, result.output
    assert "path depth 2" in result.stdout and "path depth 3" in result.stdout
    report = json.loads((tmp_path / "cli" / "train_heads.json").read_text())
    assert len(report["path_top1"]) == 2 and report["config"]["path_only"]
    refused = CliRunner().invoke(main, args + ["--force"])  # no --init-heads
    assert refused.exit_code != 0 and "--init-heads" in refused.output and "Traceback" not in refused.output
    for bad, match in (
        (replace(config, path_only=True), "--path-width"),
        (replace(config, root_width=0, path_width=8), "root-conditioned"),
        (replace(config, path_width=-1), "path input width"),
    ):
        with pytest.raises(TrainingError, match=match):
            bad.validate()
