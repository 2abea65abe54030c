"""`eval-heads`: how fast a model's draft layers will make it, predicted on held-out text and checked
with `generate` on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import CliError, dataset_option, fail, field_option, given_command, load_source, source_options

SAMPLING = ("temperature", "min_p", "penalty", "penalty_window", "seed")


@click.command("eval-heads")
@source_options
@dataset_option("--data", "held-out text (best: a `train-data` output from prompts the layers never saw)")
@field_option
@click.option("--sequences", type=click.IntRange(1), default=8, show_default=True, help="held-out sequences")
@click.option("--seq-len", type=click.IntRange(8), default=512, show_default=True, help="tokens per sequence")
@click.option(
    "--measure-prompts",
    type=click.IntRange(0),
    default=2,
    show_default=True,
    help="held-out prompts `generate` runs with the layers' chain and with AR steps (0: predict only)",
)
@click.option(
    "--measure-tokens", type=click.IntRange(2), default=256, show_default=True, help="tokens per run"
)
@click.option(
    "--measure-tree",
    multiple=True,
    help="a tree `generate` measures (candidates per depth, at most 4 wide and as deep as the layers; "
    "drafted from the verify pass), repeatable: two or more make the trees' modeled costs follow their "
    "node counts [the layers' chain, 1,1,...]",
)
@click.option("--prompt-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--temperature", type=float, default=None, help="0 = greedy [the model's, else 1.0]")
@click.option("--min-p", type=float, default=None, help="[the model's]")
@click.option("--penalty", type=float, default=None, help="contextual penalty θ [the model's]")
@click.option("--penalty-window", type=int, default=None, help="W [the model's]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", default=None, help="float32 on a CPU, bfloat16 on a GPU")
@click.option("--device", default="cpu", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write the figures here (JSON)")
def eval_heads(
    model,
    model_dir,
    engine_dir,
    heads,
    data,
    field,
    sequences,
    seq_len,
    measure_prompts,
    measure_tokens,
    measure_tree,
    prompt_tokens,
    dtype,
    device,
    out,
    **sampling,
) -> None:
    """Predict the acceptance of a model's draft layers on held-out text (per layer and per depth of
    their chain, greedy and under the sampling), then measure it with `generate` on held-out prompts
    (the chain and AR steps, decode time on this machine) and give the modeled and the measured speedup."""
    import torch

    from tokenswift_trt.decode.config import GenerationError
    from tokenswift_trt.decode.request import config_from
    from tokenswift_trt.decode.tuner_costs import tree_text
    from tokenswift_trt.training.data import read_records, record_ids
    from tokenswift_trt.training.errors import TrainingError
    from tokenswift_trt.training.evaluate import (
        evaluation_report,
        measure_chain,
        measure_verify_costs,
        predict_chain,
    )
    from tokenswift_trt.training.train_heads import evaluation_sequences

    try:
        records = read_records(list(data), field)
    except TrainingError as error:
        raise fail(error) from None
    source = load_source(model, model_dir, engine_dir, heads, dtype, device, quiet=False)
    loaded = source.model
    given = {name: value for name, value in sampling.items() if value is not None}
    try:
        config = config_from(loaded.defaults, {**given, "max_new_tokens": measure_tokens})
    except (GenerationError, ValueError) as error:
        raise fail(error) from None
    engine = loaded.engine
    layers = len(engine.draft_layers)
    trees = [_measured_tree(text, layers) for text in measure_tree or [",".join(["1"] * layers)]]
    ids = record_ids(records, loaded.codec.encode, engine.config.eos_token_ids[:1])
    chosen = evaluation_sequences(ids, seq_len, sequences)
    prediction = predict_chain(engine, engine.draft_layers, chosen, config.sampling, trees=trees)
    measured, on_measured_text, costs = [], [], None
    if measure_prompts:
        stride = max(1, (ids.numel() - prompt_tokens) // measure_prompts)
        prompts = [ids[i * stride : i * stride + prompt_tokens].tolist() for i in range(measure_prompts)]
        settings = {name: getattr(config.sampling, name) for name in SAMPLING if name != "seed"}
        settings["seed"] = config.seed if config.seed is not None else 0
        starts = [len(prompt) for prompt in prompts]  # the generated tokens only: what the runs drafted
        for tree in trees:
            run = measure_chain(loaded, prompts, measure_tokens, layers, settings, tree_text(tree))
            texts = [torch.tensor(text) for text in run.texts]
            measured.append(run)
            on_measured_text.append(
                predict_chain(engine, engine.draft_layers, texts, config.sampling, starts, trees)
            )
        # verify forwards at each tree's rows, at the context halfway through the first run
        context = measured[0].texts[0][: len(prompts[0]) + measure_tokens // 2]
        costs = measure_verify_costs(
            engine, context, sorted({tree["nodes"] + 1 for tree in prediction.trees})
        )
    from tokenswift_trt.environment import machine_meta

    meta = {**machine_meta(), "command": given_command("tokenswift-trt eval-heads")}
    report = evaluation_report(prediction, measured, config.sampling, on_measured_text, meta, costs)
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as error:
            raise CliError(f"cannot write {out} ({error.strerror}): choose another --out") from None
    _print(report, len(chosen))


def _measured_tree(text: str, layers: int):
    """--measure-tree as a TreeSpec, or a one-line error naming the limit it breaks."""
    from tokenswift_trt.decode.tree import TreeSpec
    from tokenswift_trt.training.evaluate import MAX_RANK

    try:
        tree = TreeSpec.parse(text)
    except ValueError as error:
        raise CliError(f"--measure-tree {text}: {error}") from None
    if tree.auto or len(tree.branching) > layers or max(tree.branching) > MAX_RANK:
        raise CliError(
            f"--measure-tree {text}: a static tree at most {MAX_RANK} wide and {layers} deep (the draft "
            "layers), e.g. 3,3"
        )
    return tree


def _print(report: dict, sequences: int) -> None:
    from tokenswift_trt.training.evaluate import tokens_key

    predicted = report["predicted"]

    def rates(values: list[float]) -> str:
        return " ".join(f"{value:.3f}" for value in values) or "-"

    click.echo(f"held-out: {sequences} sequences, {predicted['positions']:,} positions (teacher-forced)")
    click.echo(f"  acceptance per layer, greedy:  {rates(predicted['greedy_acceptance'])}")
    click.echo(f"  acceptance per layer, sampled: {rates(predicted['sampled_acceptance'])}")
    sampled = bool(predicted["sampled_acceptance"])
    by_depth = predicted["sampled_by_depth"] if sampled else predicted["greedy_by_depth"]
    click.echo(f"  chain acceptance by depth (given the depths before): {rates(by_depth)}")
    per_iteration = tokens_key(sampled)
    best = sorted(predicted["trees"], key=lambda tree: -tree[per_iteration])[:4]
    click.echo(
        "  tokens per iteration of the tuner's trees (most first): "
        + ", ".join(f"{tree['tree']} {tree[per_iteration]:.2f}" for tree in best)
    )
    measured = report.get("measured")
    if measured is None:
        return
    click.echo(
        f"generate --tree {measured['tree']} --draft-source verify --ngram-topk 0, "
        f"{len(measured['runs'])} prompts x {measured['new_tokens']} tokens:"
    )
    click.echo(
        f"  acceptance by depth {rates(measured['acceptance_by_depth'])}, "
        f"{measured['tokens_per_iteration']:.2f} tokens per iteration"
    )
    click.echo(
        f"  {measured['seconds_per_iteration'] * 1e3:.1f} ms per iteration, "
        f"{measured['seconds_per_ar_step'] * 1e3:.1f} ms per AR step: measured speedup "
        f"{measured['speedup']:.2f}x"
    )
    same = report["predicted_on_measured_text"]
    key = "sampled_by_depth" if sampled else "greedy_by_depth"
    click.echo(f"  predicted on the text these runs wrote: acceptance by depth {rates(same[key])}")
    for run in report["measured_trees"]:
        click.echo(
            f"  tree {run['tree']}: {run['tokens_per_iteration']:.2f} tokens per iteration (predicted on "
            f"its text {run['predicted_on_its_text']:.2f}), {run['seconds_per_iteration'] * 1e3:.1f} ms "
            f"each, measured speedup {run['speedup']:.2f}x"
        )
    modeled = report["modeled"]
    click.echo(
        f"  modeled from the prediction: {modeled['tokens_per_iteration']:.2f} tokens per iteration at "
        f"{modeled['iteration_cost_in_ar_steps']:.2f} AR steps each: {modeled['speedup']:.2f}x"
    )
    if modeled.get("trees"):
        click.echo(
            "  modeled for the tuner's trees (fastest first; verify forwards timed here, the rest of an "
            "iteration from the measured trees): "
            + ", ".join(f"{tree['tree']} {tree['speedup']:.2f}x" for tree in modeled["trees"][:4])
        )
