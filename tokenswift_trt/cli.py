"""`tokenswift-trt` command line: parses, calls the runtime/builder, prints. No algorithm here."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import click

DTYPES = ("float32", "bfloat16", "float16", "float64")


class CliError(click.ClickException):
    exit_code = 2


class OneLineErrors(click.Group):
    """Every usage or input error becomes one line on stderr with exit code 2, never a traceback."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Abort:
            click.echo("tokenswift-trt: aborted", err=True)
            sys.exit(130)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.ClickException as error:
            message = error.format_message().replace("\n", " ")
            click.echo(f"tokenswift-trt: error: {message}", err=True)
            sys.exit(2)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="tokenswift-trt")
def main() -> None:
    """Lossless TokenSwift acceleration of ultra-long generation."""


def _fail(error: Exception) -> CliError:
    return CliError(str(error).splitlines()[0] if str(error) else type(error).__name__)


# options that decide the generated tokens (a resumed journal keeps its own) / only its speed
OUTPUT_DECIDING = ("temperature", "top_k", "top_p", "min_p", "eta", "penalty", "penalty_window", "seed", "ignore_eos",
                   "max_length")
DEMO_TURN_TOKENS = 256  # `demo`: new tokens each method decodes per turn
SPEED_ONLY = ("tree", "ngram_topk", "kv_budget", "kv_recent", "draft_source")

SAMPLING_DEFAULTS = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "eta": 0.0, "penalty": 1.0,
    "penalty_window": 1024, "ngram_topk": 20, "tree": "1,3,3,3", "kv_budget": 4096, "draft_source": "partial",
    "dtype": None,
}


def _load(model_dir: Path | None, engine_dir: Path | None, heads: Path | None, dtype: str | None, device: str, quiet: bool):
    """(engine, codec, defaults): from a Hugging Face dir, or from a built engine dir and its manifest."""
    import torch

    from tokenswift_trt.runtime.config import ConfigError
    from tokenswift_trt.runtime.engine import (
        KernelFallbackWarning,
        UntrainedDraftLayersWarning,
        WeightsError,
        load_engine,
    )
    from tokenswift_trt.runtime.engine_dir import EngineDirError, load_engine_dir
    from tokenswift_trt.runtime.text import TextCodec, TokenizerError

    if (model_dir is None) == (engine_dir is None):
        raise CliError("give exactly one of --model-dir DIR or --engine DIR")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("--device cuda but no CUDA GPU is visible to PyTorch: use --device cpu")
    source = model_dir if model_dir is not None else engine_dir
    assert source is not None
    if not source.is_dir():
        raise CliError(f"{'model' if model_dir else 'engine'} directory {source} does not exist")
    defaults = dict(SAMPLING_DEFAULTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntrainedDraftLayersWarning)
        warnings.simplefilter("always", KernelFallbackWarning)
        try:
            if engine_dir is not None:
                if heads is not None:
                    raise CliError("--heads applies to --model-dir; an engine carries its draft layers")
                engine, manifest = load_engine_dir(engine_dir, device=device, dtype=getattr(torch, dtype) if dtype else None)
                defaults.update(manifest.sampling, tree=manifest.tree)
                codec = TextCodec.from_dir(engine_dir / "model")
            else:
                if dtype is None:  # the kernel's element types on GPUs (bf16 needs compute capability 8.0+)
                    dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if device.startswith(
                        "cuda") else "float32"
                engine = load_engine(model_dir, heads, dtype=getattr(torch, dtype), device=device)
                codec = TextCodec.from_dir(model_dir)
        except (ConfigError, WeightsError, TokenizerError, EngineDirError, OSError, RuntimeError) as error:
            raise _fail(error) from None
    for warning in caught:
        # an untrained-heads note can be silenced; running without the CUDA kernel is always said
        if issubclass(warning.category, KernelFallbackWarning) or (
                issubclass(warning.category, UntrainedDraftLayersWarning) and not quiet):
            click.echo(f"warning: {warning.message}", err=True)
    return engine, codec, defaults


def source_options(function):
    options = [
        click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Hugging Face model directory"),
        click.option("--engine", "engine_dir", type=click.Path(path_type=Path), default=None, help="engine directory from `build`"),
        click.option("--heads", type=click.Path(path_type=Path), default=None, help="draft-layer heads file (safetensors)"),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def sampling_options(function):
    """Sampling/decoding options; unset ones take the engine's defaults (--engine) or the global ones."""
    options = [
        click.option("--temperature", type=float, default=None, help="0 = greedy [default: 1.0 or the engine's]"),
        click.option("--top-k", type=int, default=None, help="0 = off"),
        click.option("--top-p", type=float, default=None, help="1 = off"),
        click.option("--min-p", type=float, default=None, help="0 = off; keeps >= 20 tokens"),
        click.option("--eta", type=float, default=None, help="η-sampling; 0 = off"),
        click.option("--penalty", type=float, default=None, help="contextual penalty θ; 1 = off"),
        click.option("--penalty-window", type=int, default=None, help="W: tokens the penalty looks back [1024]"),
        click.option("--ngram-topk", type=int, default=None, help="n-gram branches per first token [20]"),
        click.option("--tree", default=None, help="candidates per depth, or auto [1,3,3,3]"),
        click.option("--kv-budget", type=int, default=None, help="partial KV cache budget B [4096]"),
        click.option("--kv-recent", type=int, default=None,
                     help="partial cache recent region; the selection is redone when it fills [B/4]"),
        click.option("--draft-source", type=click.Choice(["partial", "verify"]), default=None,
                     help="partial: separate draft pass on the partial KV cache (paper); verify: draft layers read the verify pass [partial]"),
        click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None, help="default: random (reported)"),
        click.option("--ignore-eos", is_flag=True, help="do not stop at EOS"),
        click.option("--max-length", type=int, default=None, help="engine maximum length (default: model's)"),
        click.option("--dtype", type=click.Choice(DTYPES), default=None, help="default: float32 on a CPU, bfloat16 on CUDA, or the engine's"),
        click.option("--device", default="cpu", show_default=True),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _generation_config(max_new_tokens: int, method: str, opts: dict, defaults: dict | None = None):
    from tokenswift_trt.runtime.decoding import GenerationConfig, GenerationError
    from tokenswift_trt.runtime.sampling import SamplingConfig

    merged = dict(defaults or SAMPLING_DEFAULTS)
    merged.update({k: v for k, v in opts.items() if v is not None})
    sampling = SamplingConfig(
        temperature=merged["temperature"], top_k=merged["top_k"], top_p=merged["top_p"], min_p=merged["min_p"],
        eta=merged["eta"], penalty=merged["penalty"], penalty_window=merged["penalty_window"],
    )
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, method=method, sampling=sampling, tree=merged["tree"],
        ngram_topk=merged["ngram_topk"], kv_budget=merged["kv_budget"], kv_recent=merged.get("kv_recent"), draft_source=merged["draft_source"],
        seed=merged.get("seed"),
        ignore_eos=merged.get("ignore_eos", False), max_length=merged.get("max_length"),
    )
    try:
        config.validate()
    except GenerationError as error:
        raise _fail(error) from None
    return config


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise CliError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CliError(f"cannot read prompt file {prompt_file}: {error}") from None
    assert prompt is not None
    if not prompt.strip():
        raise CliError("the prompt is empty: give some text")
    return prompt


@main.command()
@source_options
@click.option("--prompt", default=None, help="prompt text")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="file holding the prompt")
@click.option("--max-new-tokens", type=int, default=None, help="tokens to generate (required unless --resume)")
@click.option("--method", type=click.Choice(["tokenswift", "ar"]), default="tokenswift", show_default=True)
@click.option("--stream", is_flag=True, help="print text as it is accepted")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object at the end")
@click.option("--journal", type=click.Path(path_type=Path), default=None, help="append committed tokens to this journal (crash-safe)")
@click.option("--journal-every", type=click.IntRange(1), default=64, show_default=True, help="tokens per journal record")
@click.option("--resume", type=click.Path(path_type=Path), default=None, help="continue the generation recorded in this journal")
@click.option("--memory-budget", type=float, default=None, help="GiB the caches may use (default: the memory free now)")
@sampling_options
def generate(model_dir, engine_dir, heads, prompt, prompt_file, max_new_tokens, method, stream, as_json, journal,
             journal_every, resume, memory_budget, **opts) -> None:
    """Generate a continuation of a prompt with TokenSwift (or the AR baseline); journal and resume long runs."""
    import dataclasses
    import random

    from tqdm import tqdm

    from tokenswift_trt.runtime.decoding import GenerationError
    from tokenswift_trt.runtime.decoding import generate as run_generate
    from tokenswift_trt.runtime.journal import JournalError, JournalWriter, journal_header, read_journal, truncate_to_valid
    from tokenswift_trt.runtime.text import StreamDecoder

    done_ids: list[int] = []
    if resume is not None:
        if journal is not None or prompt is not None or prompt_file is not None:
            raise CliError("--resume continues a journal: it takes no --prompt, --prompt-file or --journal")
        deciding = [f"--{name.replace('_', '-')}" for name in OUTPUT_DECIDING if opts.get(name) not in (None, False)]
        if max_new_tokens is not None:
            deciding.insert(0, "--max-new-tokens")
        if deciding:
            raise CliError(f"--resume continues with the journal's own settings: drop {', '.join(deciding)}")
        try:
            state = read_journal(resume)
        except JournalError as error:
            raise _fail(error) from None
        header = state.header
        if model_dir is None and engine_dir is None:
            model_dir = Path(header["source"]["model_dir"]) if header["source"].get("model_dir") else None
            engine_dir = Path(header["source"]["engine_dir"]) if header["source"].get("engine_dir") else None
            heads = Path(header["source"]["heads"]) if header["source"].get("heads") else None
        speed = {name: opts[name] for name in SPEED_ONLY if opts.get(name) is not None}
        config = dataclasses.replace(state.config(), **speed)  # these change how fast, not what is written
        prompt_ids, done_ids = list(header["prompt_ids"]), list(state.tokens)
        engine, codec, _ = _load(model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=as_json)
        if state.dropped_records and not as_json:
            click.echo(f"note: ignored {state.dropped_records} torn record(s) at the end of {resume}", err=True)
        if state.earlier_sampler and not as_json:
            click.echo(f"note: {resume} was written by an earlier version with another sampler; the continuation "
                       "is sampled correctly but differs from what the original run would have written", err=True)
        finished = state.complete(engine.config.eos_token_ids)
        truncate_to_valid(resume)
        writer = None if finished else JournalWriter(resume, every=journal_every)
        run_config = dataclasses.replace(config, max_new_tokens=max(1, config.max_new_tokens - len(done_ids)))
    else:
        if max_new_tokens is None:
            raise CliError("--max-new-tokens is required (unless --resume)")
        text = _read_prompt(prompt, prompt_file)
        _generation_config(max_new_tokens, method, opts)  # bad values fail before any loading
        engine, codec, defaults = _load(model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=as_json)
        config = _generation_config(max_new_tokens, method, opts, defaults)
        prompt_ids = codec.encode(text)
        limit = config.max_length or engine.config.max_position_embeddings
        if len(prompt_ids) + max_new_tokens > limit > len(prompt_ids) and not as_json:
            click.echo(f"note: the engine's maximum length is {limit:,} tokens: this {len(prompt_ids):,}-token prompt "
                       f"leaves room for {limit - len(prompt_ids):,} new tokens, not {max_new_tokens:,}", err=True)
        finished = False
        writer = None
        if journal is not None:
            if config.seed is None:  # the journal must know the seed to resume the same tokens
                config = dataclasses.replace(config, seed=random.SystemRandom().randrange(2**63))
            source = {"model_dir": str(model_dir) if model_dir else None, "engine_dir": str(engine_dir) if engine_dir else None,
                      "heads": str(heads) if heads else None}
            writer = JournalWriter(journal, journal_header(prompt_ids, config, source), every=journal_every)
        run_config = config
    if memory_budget is not None:
        run_config = dataclasses.replace(run_config, memory_budget=int(memory_budget * (1 << 30)))

    stream_decoder = StreamDecoder(codec)
    if stream and done_ids:
        click.echo(stream_decoder.push(done_ids), nl=False)
    progress = tqdm(total=config.max_new_tokens, initial=len(done_ids), unit="tok", file=sys.stderr,
                    disable=True if (as_json or stream) else None)

    def on_tokens(ids: list[int]) -> None:
        progress.update(len(ids))
        if writer is not None:
            writer.add(ids)
        if stream:
            click.echo(stream_decoder.push(ids), nl=False)

    stats = None
    try:
        if not finished:
            new_ids, stats = run_generate(engine, prompt_ids + done_ids, run_config, on_tokens=on_tokens)
            done_ids = done_ids + new_ids
    except GenerationError as error:
        raise _fail(error) from None
    finally:
        progress.close()
        if writer is not None:
            writer.close(finished=stats is not None or finished)
    output = codec.decode(done_ids)
    if stream:
        click.echo(stream_decoder.flush())
    if stats is not None and stats.stop_reason == "max_length" and not as_json:
        click.echo(f"note: stopped at the engine's maximum length after {len(done_ids)} new tokens", err=True)
    if as_json:
        click.echo(json.dumps({
            "text": output,
            "token_ids": done_ids,
            "new_tokens": len(done_ids),
            "acceptance_rate": stats.acceptance_rate if stats else 0.0,
            "ngram_acceptance_rate": stats.ngram_acceptance_rate if stats else 0.0,
            "tokens_per_s": stats.tokens_per_s if stats else 0.0,
            "elapsed_s": stats.elapsed_s if stats else 0.0,
            "method": config.method,
            "seed": stats.seed if stats else config.seed,
            "stop_reason": stats.stop_reason if stats else "finished",
        }))
        return
    if not stream:
        click.echo(output)
    if stats is not None:
        click.echo(
            f"[{stats.method}] {stats.new_tokens} tokens in {stats.elapsed_s:.2f}s ({stats.tokens_per_s:.1f} tok/s), "
            f"α {stats.acceptance_rate:.3f}, β {stats.ngram_acceptance_rate:.3f}, seed {stats.seed}, stop: {stats.stop_reason}",
            err=True,
        )


@main.command("bench-host")
@source_options
@click.option("--prompt-file", type=click.Path(path_type=Path), required=True, help="text the prompt is cut from")
@click.option("--prefix-len", type=int, default=512, show_default=True, help="prompt tokens")
@click.option("--max-new-tokens", type=int, default=1024, show_default=True)
@sampling_options
def bench_host(model_dir, engine_dir, heads, prompt_file, prefix_len, max_new_tokens, **opts) -> None:
    """Host overhead per TokenSwift iteration: decode time outside model calls (docs/gpu.md)."""
    from tokenswift_trt.bench.host import measure_host_overhead

    if prefix_len < 1 or max_new_tokens < 2:
        raise CliError("--prefix-len must be >= 1 and --max-new-tokens >= 2")
    if opts["seed"] is None:
        opts["seed"] = 0
    _generation_config(max_new_tokens, "tokenswift", opts)
    text = _read_prompt(None, prompt_file)
    engine, codec, defaults = _load(model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=False)
    config = _generation_config(max_new_tokens, "tokenswift", opts, defaults)
    prompt = codec.encode(text)[:prefix_len]
    try:
        result = measure_host_overhead(engine, prompt, config)
    except ValueError as error:
        raise _fail(error) from None
    click.echo(f"tree {config.tree}, k={config.ngram_topk}, {result.iterations} iterations, {result.new_tokens} tokens")
    click.echo(f"host ms/iteration: {result.host_ms_per_iteration:.3f}  model ms/iteration: "
               f"{result.model_ms_per_iteration:.3f}")
    click.echo(f"host tensor ops/iteration: {result.host_ops_per_iteration:.1f} (outside model calls, views "
               "excluded: each is a kernel launch on a GPU)")
    phases = ", ".join(f"{name} {seconds / result.iterations * 1e3:.3f}" for name, seconds in result.phase_s.items())
    click.echo(f"phases (ms/iteration, model calls included): {phases}")


@main.command("bench-kernels")
@click.option("--device", default="cuda", show_default=True, help="cuda: the CUDA kernel; cpu: the reference (smoke run)")
@click.option("--tree-sizes", default="1,64,128", show_default=True, help="tree tokens T")
@click.option("--contexts", default="4096,32768,131072", show_default=True, help="cached positions L")
@click.option("--heads", type=int, default=32, show_default=True)
@click.option("--kv-heads", type=int, default=8, show_default=True)
@click.option("--head-dim", type=click.Choice(["64", "128"]), default="128", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--repeats", type=int, default=20, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/kernels"), show_default=True)
def bench_kernels(device, tree_sizes, contexts, heads, kv_heads, head_dim, dtype, repeats, out) -> None:
    """Tree attention vs masked SDPA and vs the memory-bandwidth time; CSV + JSON (docs/kernels.md)."""
    import torch
    from tqdm import tqdm

    from tokenswift_trt.bench.kernels import bench_tree_attention, device_description, write_kernel_report
    from tokenswift_trt.runtime import kernels

    sizes, lengths = _int_list(tree_sizes, "--tree-sizes"), _int_list(contexts, "--contexts")
    if max(sizes) > kernels.MAX_TREE_TOKENS:
        raise CliError(f"--tree-sizes: the kernel takes at most {kernels.MAX_TREE_TOKENS} tree tokens")
    if heads < 1 or kv_heads < 1 or heads % kv_heads or repeats < 1:
        raise CliError("--heads must be a positive multiple of --kv-heads, and --repeats at least 1")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CliError("bench-kernels --device cuda needs a CUDA GPU and a CUDA build of torch "
                           "(use --device cpu for a smoke run of the reference)")
        status = kernels.load_cuda_kernels()
        problem = kernels.shared_memory_problem(status, int(head_dim), torch.device(device)) if status.loaded else status.reason
        if problem is not None:
            raise CliError(problem)
    target = torch.device(device)
    bar = tqdm(total=len(sizes) * len(lengths), desc="kernels", unit="case", file=sys.stderr, leave=False)
    try:
        rows, bandwidth = bench_tree_attention(
            target, sizes, lengths, heads, kv_heads, int(head_dim), getattr(torch, dtype), repeats,
            on_row=lambda _: bar.update(1),
        )
    except torch.OutOfMemoryError:
        raise CliError("out of device memory: lower --contexts") from None
    finally:
        bar.close()
    meta = {"command": "tokenswift-trt bench-kernels " + " ".join(sys.argv[2:]), "device": device_description(target),
            "heads": heads, "kv_heads": kv_heads, "head_dim": int(head_dim), "dtype": dtype, "repeats": repeats}
    written = write_kernel_report(rows, bandwidth, out, meta)
    click.echo(f"{meta['device']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    click.echo("T | L | kernel ms | SDPA ms | speedup vs SDPA | bandwidth ms | kernel / bandwidth")
    for row in rows:
        click.echo(f"{row.tree_tokens} | {row.context} | {row.kernel_ms:.3f} | {row.sdpa_ms:.3f} | "
                   f"{row.speedup_vs_sdpa:.2f} | {row.bandwidth_ms:.3f} | {row.kernel_over_bandwidth:.2f}")
    click.echo("wrote " + ", ".join(str(p) for p in written))


@main.command("train-heads")
@click.option("--model-dir", type=click.Path(path_type=Path), required=True, help="base Hugging Face model directory")
@click.option("--data", "data", type=click.Path(path_type=Path), multiple=True, required=True, help=".txt/.jsonl file or folder (repeatable)")
@click.option("--eval-data", type=click.Path(path_type=Path), multiple=True, help="held-out text (default: last 5% of --data)")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="output folder (heads file, checkpoint, report)")
@click.option("--steps", type=int, default=400, show_default=True)
@click.option("--seq-len", type=int, default=2048, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True, help="sequences per micro-batch")
@click.option("--grad-accum", type=int, default=4, show_default=True)
@click.option("--lr", type=float, default=5e-3, show_default=True)
@click.option("--warmup-steps", type=int, default=50, show_default=True)
@click.option("--checkpoint-every", type=int, default=100, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="continue from OUT/checkpoint.pt")
@click.option("--force", is_flag=True, help="start over even if OUT holds a checkpoint")
@click.option("--combined", type=click.Path(path_type=Path), default=None, help="also write base + heads in the released TokenSwift format here")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
def train_heads(model_dir, data, eval_data, out, steps, seq_len, batch, grad_accum, lr, warmup_steps,
                checkpoint_every, seed, resume, force, combined, dtype, device) -> None:
    """Train the 3 chained draft layers of a model with its base frozen."""
    import torch
    from tqdm import tqdm

    from tokenswift_trt.training.train_heads import (
        CHECKPOINT, HEADS_FILE, HeadsTrainer, TrainHeadsConfig, TrainingError, draft_accuracy,
        evaluation_sequences, read_texts, save_heads, write_combined,
    )

    config = TrainHeadsConfig(
        steps=steps, seq_len=seq_len, batch=batch, grad_accum=grad_accum, lr=lr, warmup_steps=warmup_steps,
        checkpoint_every=checkpoint_every, seed=seed,
    )
    try:
        config.validate()
        texts = read_texts(list(data))
        eval_texts = read_texts(list(eval_data)) if eval_data else []
    except TrainingError as error:
        raise _fail(error) from None
    if not model_dir.is_dir():
        raise CliError(f"model directory {model_dir} does not exist")
    if (out / CHECKPOINT).exists() and not (resume or force):
        raise CliError(f"{out} holds a checkpoint: pass --resume to continue it or --force to start over")
    engine, codec, _ = _load(model_dir, None, None, dtype, device, quiet=True)
    eos = engine.config.eos_token_ids[:1]

    def tokens_of(items: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for text in items:
            ids.extend(codec.encode(text) + list(eos))
        return torch.tensor(ids, dtype=torch.long)

    train_ids = tokens_of(texts)
    if eval_texts:
        eval_ids = tokens_of(eval_texts)
    else:
        split = int(train_ids.numel() * 0.95)
        train_ids, eval_ids = train_ids[:split], train_ids[split:]
    out.mkdir(parents=True, exist_ok=True)
    try:
        trainer = HeadsTrainer(engine, train_ids, config, out)
        if resume:
            trainer.load_checkpoint()
    except TrainingError as error:
        raise _fail(error) from None
    click.echo(f"training {len(engine.draft_layers)} draft layers on {train_ids.numel():,} tokens, from step {trainer.step}", err=True)
    with tqdm(total=steps, initial=trainer.step, desc="train-heads", unit="step", file=sys.stderr) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        trainer.run(on_step)
    heads_path = out / HEADS_FILE
    save_heads(trainer.draft_layers, heads_path)
    trainer.draft_layers.eval()
    base_acc, accuracy = draft_accuracy(engine, trainer.draft_layers, evaluation_sequences(eval_ids, seq_len, 8))
    report = {
        "steps": trainer.step, "final_loss": trainer.last_loss, "base_top1": base_acc,
        "draft_top1": accuracy, "train_tokens": train_ids.numel(), "eval_tokens": eval_ids.numel(),
        "config": {k: v for k, v in vars(config).items()},
    }
    (out / "train_heads.json").write_text(json.dumps(report, indent=2) + "\n")
    if combined is not None:
        try:
            write_combined(model_dir, heads_path, combined)
        except TrainingError as error:
            raise _fail(error) from None
        click.echo(f"combined checkpoint (released TokenSwift format): {combined}")
    click.echo(f"heads file: {heads_path}")
    click.echo("held-out top-1 accuracy: base (+1) {:.3f}, ".format(base_acc) + ", ".join(
        f"layer {i} (+{i + 1}) {a:.3f}" for i, a in enumerate(accuracy, start=1)))


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CliError(f"{name} must be comma-separated positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise CliError(f"{name} must be comma-separated positive integers, got {text!r}")
    return values


@main.command()
@source_options
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="text to cut prompts from (required unless --random-weights)")
@click.option("--gen-len", default="2048,8192", show_default=True, help="generation lengths [--random-weights: 20480,40960,61440,81920,102400]")
@click.option("--prefix-len", default="512", show_default=True, help="prompt lengths in tokens [--random-weights: 4096]")
@click.option("--prompts", type=int, default=1, show_default=True, help="prompts per prefix length")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--interleave", type=int, default=256, show_default=True,
              help="new tokens each method decodes per turn, each timed on its own clock (0: one method after another)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench"), show_default=True)
@click.option("--model", default=None, help="--random-weights: preset name or model directory whose shape is timed")
@click.option("--random-weights", is_flag=True, help="step-cost mode: time the ar/draft/verify steps of --model with random weights and model the speedup")
@click.option("--contexts", default="4096,32768,65536,102400", show_default=True, help="--random-weights: cached positions L")
@click.option("--tree-sizes", default="1,41,121", show_default=True, help="--random-weights: tokens T per verify pass")
@click.option("--accept-length", type=float, default=4.36, show_default=True, help="--random-weights: τ, tokens per iteration (4α+1; paper α 0.84)")
@click.option("--verify-accept-length", type=float, default=None, help="--random-weights: τ when drafting from the verify pass [--accept-length]")
@click.option("--acceptance-from", type=click.Path(path_type=Path), default=None,
              help="--random-weights: trained model dir whose measured τ replaces --accept-length (2,048 sampled tokens)")
@click.option("--verify-tree-size", type=int, default=None, help="--random-weights: T of the modeled verify pass [largest --tree-sizes]")
@click.option("--host-overhead-ms", type=float, default=None,
              help="--random-weights: host time per iteration (default: measured by a short generation, tree 1,3,3,3, k=20)")
@click.option("--step-repeats", type=int, default=20, show_default=True, help="--random-weights: timed runs per step (median)")
@sampling_options
def bench(model_dir, engine_dir, heads, prompt_file, gen_len, prefix_len, prompts, repeats, interleave, out, model, random_weights,
          contexts, tree_sizes, accept_length, verify_accept_length, acceptance_from, verify_tree_size, host_overhead_ms,
          step_repeats, **opts) -> None:
    """AR vs TokenSwift: tokens/s, speedup, α, β and Distinct-n per generation length; CSV + PNG.

    With --model PRESET_OR_DIR --random-weights: the cost of one AR, draft and verify step per
    context, against the memory-bandwidth floor, and the speedup those costs imply."""
    import sys as _sys

    from tqdm import tqdm

    from tokenswift_trt.bench.run import BenchSpec, run_bench, write_results

    if random_weights or model is not None:
        _bench_steps(model, random_weights, model_dir or engine_dir or prompt_file, gen_len, prefix_len, out,
                     contexts, tree_sizes, accept_length, verify_accept_length, verify_tree_size, host_overhead_ms,
                     step_repeats, opts, acceptance_from)
        return
    if prompt_file is None:
        raise CliError("bench needs --prompt-file FILE (or --model PRESET_OR_DIR --random-weights for step costs)")
    gen_lens, prefix_lens = _int_list(gen_len, "--gen-len"), _int_list(prefix_len, "--prefix-len")
    if prompts < 1 or repeats < 1:
        raise CliError("--prompts and --repeats must be at least 1")
    if interleave < 0:
        raise CliError(f"--interleave must be >= 0 (0 runs the methods one after another), got {interleave}")
    if opts["seed"] is None:
        opts["seed"] = 0
    _generation_config(max(gen_lens), "tokenswift", opts)
    text = _read_prompt(None, prompt_file)
    engine, codec, defaults = _load(model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=False)
    config = _generation_config(max(gen_lens), "tokenswift", opts, defaults)
    text_ids = codec.encode(text)
    longest = max(prefix_lens) + max(gen_lens)
    limit = opts["max_length"] or engine.config.max_position_embeddings
    if longest > limit:
        raise CliError(f"prefix {max(prefix_lens)} + generation {max(gen_lens)} exceeds the maximum length {limit}")

    def progress(label: str, total: int):
        bar = tqdm(total=total, desc=label, unit="tok", file=_sys.stderr, leave=False)

        def update(ids: list[int]) -> None:
            bar.update(len(ids))
            if bar.n >= total:
                bar.close()
        return update

    spec = BenchSpec(gen_lens, prefix_lens, prompts, repeats, config, interleave)
    try:
        rows = run_bench(engine, text_ids, spec, progress)
    except ValueError as error:
        raise _fail(error) from None
    meta = {"command": "tokenswift-trt bench " + " ".join(_sys.argv[2:]), "source": str(model_dir or engine_dir),
            "tree": config.tree, "ngram_topk": config.ngram_topk, "draft_source": config.draft_source,
            "sampling": vars(config.sampling),
            "kv_budget": config.kv_budget, "device": opts["device"], "dtype": str(engine.dtype), "interleave": interleave}
    written = write_results(rows, out, meta)
    columns = ["prefix_len", "gen_len", "ar_tokens_per_s", "tokenswift_tokens_per_s", "speedup", "alpha", "beta", "tokens_per_iteration",
               "tokens_per_forward", "distinct4_penalty", "distinct4_no_penalty", "tokens_equal_ar"]
    if "auto_vs_default_tree" in rows[0]:
        columns.insert(5, "auto_vs_default_tree")
    click.echo(" | ".join(columns))
    for row in rows:
        click.echo(" | ".join(str(row[c]) for c in columns))
    click.echo("wrote " + ", ".join(str(p) for p in written))


def _measure_host_ms(engine, kv_budget: int) -> float:
    """Host time per TokenSwift iteration (outside model calls) on this engine: bench/host.py."""
    import torch

    from tokenswift_trt.bench.host import measure_host_overhead
    from tokenswift_trt.runtime.decoding import GenerationConfig
    from tokenswift_trt.runtime.sampling import SamplingConfig

    prompt = torch.randint(3, engine.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    config = GenerationConfig(max_new_tokens=256, tree="1,3,3,3", ngram_topk=20, kv_budget=min(kv_budget, 512),
                              sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=1024), seed=0,
                              ignore_eos=True)
    return measure_host_overhead(engine, prompt, config).host_ms_per_iteration


def _bench_steps(model, random_weights, generation_input, gen_len, prefix_len, out, contexts, tree_sizes, accept_length,
                 verify_accept_length, verify_tree_size, host_overhead_ms, step_repeats, opts,
                 acceptance_from: Path | None = None) -> None:
    """`bench --model PRESET_OR_DIR --random-weights`: step costs and the speedup they imply (bench/steps.py)."""
    import torch
    from click.core import ParameterSource
    from tqdm import tqdm

    from tokenswift_trt.bench.kernels import device_description
    from tokenswift_trt.bench.steps import (
        DEFAULT_GEN_LENGTHS, DEFAULT_PROMPT_LENGTH, PAPER_A100_LLAMA31_8B, check_step_request, measure_copy_bandwidth,
        measure_step_costs, modeled_speedup, random_engine, verify_step, write_step_report,
    )
    from tokenswift_trt.runtime.engine import KernelFallbackWarning

    if not random_weights or model is None:
        raise CliError("the step-cost mode needs both --model PRESET_OR_DIR and --random-weights")
    if generation_input is not None:
        raise CliError("--random-weights times a model shape: it takes --model, not --model-dir, --engine or --prompt-file")
    device = opts["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        reason = "this torch is CPU-only" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise CliError(f"bench: --device cuda needs a CUDA GPU and a CUDA build of torch ({reason})")
    ctx = click.get_current_context()
    source = ctx.get_parameter_source
    context_list, sizes = _int_list(contexts, "--contexts"), _int_list(tree_sizes, "--tree-sizes")
    gen_lens = DEFAULT_GEN_LENGTHS if source("gen_len") == ParameterSource.DEFAULT else _int_list(gen_len, "--gen-len")
    prompt_lens = (DEFAULT_PROMPT_LENGTH,) if source("prefix_len") == ParameterSource.DEFAULT else _int_list(prefix_len, "--prefix-len")
    if len(prompt_lens) != 1:
        raise CliError("--prefix-len takes one prompt length with --random-weights")
    tree_size = verify_tree_size or max(sizes)
    if tree_size not in sizes:
        raise CliError(f"--verify-tree-size {tree_size} is not among --tree-sizes {tree_sizes}")
    verify_tau = accept_length if verify_accept_length is None else verify_accept_length
    if acceptance_from is not None:
        from tokenswift_trt.bench.steps import measure_accept_lengths

        if not acceptance_from.is_dir():
            raise CliError(f"--acceptance-from: model directory {acceptance_from} does not exist")
        try:
            accept_length, verify_tau = measure_accept_lengths(acceptance_from)
        except ValueError as error:
            raise _fail(error) from None
        click.echo(f"measured on {acceptance_from}: τ {accept_length:.3f} (partial-cache drafting, tree 1,3,3,3), "
                   f"{verify_tau:.3f} (verify-pass drafting, tree 3,3,3)", err=True)
    if min(accept_length, verify_tau) < 1 or step_repeats < 1 or (host_overhead_ms or 0) < 0:
        raise CliError("--accept-length and --verify-accept-length must be >= 1, --step-repeats >= 1, --host-overhead-ms >= 0")
    kv_budget = opts["kv_budget"] or SAMPLING_DEFAULTS["kv_budget"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        try:
            engine, dtype_name = random_engine(model, getattr(torch, opts["dtype"]) if opts["dtype"] else None, device)
        except (ValueError, RuntimeError) as error:
            raise _fail(error) from None
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)
    try:
        check_step_request(engine, context_list, sizes, kv_budget, step_repeats)
    except ValueError as error:
        raise _fail(error) from None
    bandwidth = measure_copy_bandwidth(engine.device)
    bar = tqdm(total=len(context_list) * (3 + len(sizes)), desc="step costs", unit="step", file=sys.stderr, leave=False)

    def on_step(cost) -> None:
        bar.set_postfix_str(f"L={cost.context} {cost.step}")
        bar.update(1)

    host_measured = host_overhead_ms is None
    if host_measured:
        host_overhead_ms = _measure_host_ms(engine, kv_budget)
        click.echo(f"host overhead: {host_overhead_ms:.3f} ms per iteration (measured: 256 tokens, tree 1,3,3,3, "
                   "k=20, min-p 0.1, θ 1.2)", err=True)
    try:
        costs = measure_step_costs(engine, context_list, sizes, kv_budget, step_repeats, bandwidth, on_step)
        speedups = modeled_speedup(costs, prompt_lens[0], gen_lens, accept_length, verify_tau, tree_size,
                                   host_overhead_ms / 1e3)
    except ValueError as error:
        raise _fail(error) from None
    finally:
        bar.close()
    given = [(param.opts[0], ctx.params[param.name]) for param in ctx.command.params
             if param.name and source(param.name) != ParameterSource.DEFAULT]
    command = " ".join(["tokenswift-trt bench"] + [flag if value is True else f"{flag} {value}" for flag, value in given])
    meta = {"command": command, "model": model, "random_weights": True,
            "device": device_description(engine.device), "dtype": dtype_name, "torch": torch.__version__,
            "attention_kernel": engine.model.attention_kernel, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "kv_budget": kv_budget, "step_repeats": step_repeats, "prompt_length": prompt_lens[0],
            "accept_length": round(accept_length, 4), "verify_accept_length": round(verify_tau, 4),
            "acceptance_from": str(acceptance_from) if acceptance_from else None, "verify_tree_size": tree_size,
            "host_overhead_ms": round(host_overhead_ms, 4), "host_overhead_measured": host_measured}
    written = write_step_report(costs, speedups, out, meta)
    click.echo(f"{model} ({dtype_name}, random weights) on {meta['device']}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    steps = ["ar", "draft", "heads"] + [verify_step(size) for size in sizes]
    click.echo("context | " + " | ".join(f"{step} ms (floor)" for step in steps))
    by_key = {(cost.context, cost.step): cost for cost in costs}
    for context in sorted(context_list):
        cells = [by_key[context, step] for step in steps]
        click.echo(f"{context} | " + " | ".join(f"{c.seconds * 1e3:.3f} ({c.bandwidth_seconds * 1e3:.3f})" for c in cells))
    click.echo(f"modeled: prompt {prompt_lens[0]}, T {tree_size}, τ partial {accept_length:.3f} / verify {verify_tau:.3f}, "
               f"host {host_overhead_ms:.3f} ms")
    if prompt_lens[0] + max(gen_lens) > 1.25 * max(context_list):
        click.echo(f"note: the model extrapolates step costs measured up to context {max(context_list)} to "
                   f"{prompt_lens[0] + max(gen_lens)}: measure larger --contexts for figures to trust", err=True)
    click.echo("gen_len | AR s | partial s | speedup partial | verify s | speedup verify | paper A100 8B")
    for gen_length in gen_lens:
        partial, verify = (next(s for s in speedups if s.gen_length == gen_length and s.mode == mode)
                           for mode in ("partial", "verify"))
        click.echo(f"{gen_length} | {partial.ar_seconds:.1f} | {partial.tokenswift_seconds:.1f} | {partial.speedup:.2f} | "
                   f"{verify.tokenswift_seconds:.1f} | {verify.speedup:.2f} | {PAPER_A100_LLAMA31_8B.get(gen_length, '-')}")
    click.echo("wrote " + ", ".join(str(p) for p in written))


@main.command()
@click.option("--model", required=True, help="preset name (see --list) or a Hugging Face model directory")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="engine directory to write")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="checkpoint dir (default: $TOKENSWIFT_HOME/<preset>)")
@click.option("--heads", type=click.Path(path_type=Path), default=None, help="draft layers: heads file or released checkpoint")
@click.option("--backend", type=click.Choice(["torch", "onnx", "tensorrt"]), default="torch", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="default: the preset's (bfloat16), else float32")
@click.option("--random-weights", is_flag=True, help="correctly shaped random weights (performance work)")
@click.option("--max-length", type=int, default=None, help="maximum sequence length (default: the model's)")
@click.option("--force", is_flag=True, help="replace an existing engine directory")
def build(model, out, checkpoint, heads, backend, dtype, random_weights, max_length, force) -> None:
    """Build an engine directory from a preset or checkpoint (torch, onnx or tensorrt backend)."""
    from tqdm import tqdm

    from tokenswift_trt.builder.build import BuildError, BuildRequest, build_engine

    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=stage, file=sys.stderr, leave=False)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    request = BuildRequest(model=model, out=out, checkpoint=checkpoint, heads=heads, backend=backend, dtype=dtype,
                           random_weights=random_weights, force=force, max_sequence_length=max_length)
    try:
        path = build_engine(request, progress, log=lambda message: click.echo(message, err=True))
    except (BuildError, RuntimeError, OSError) as error:
        raise _fail(error) from None
    finally:
        for bar in bars.values():
            bar.close()
    click.echo(f"engine: {path}")


@main.command("presets")
def presets() -> None:
    """List the model presets with their shapes and sampling defaults."""
    from tokenswift_trt.builder.presets import PRESETS

    for preset in PRESETS.values():
        click.echo(f"{preset.name:22s} {preset.parameter_count() / 1e9:6.2f}B  {preset.dtype:9s} {preset.hf_name}  "
                   f"sampling: {vars(preset.sampling)}")


@main.command()
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path), required=True, help="engine directory (or Hugging Face model dir)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--instances", type=click.IntRange(1, 64), default=1, show_default=True, help="model instances (each holds the weights)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--journal-dir", type=click.Path(path_type=Path), default=None,
              help="keep a journal per request_id here, so that resume=true continues after a crash")
@click.option("--memory-budget", type=float, default=None, help="GiB one request's caches may use (default: free memory)")
def serve(engine_dir, host, http_port, grpc_port, metrics_port, instances, device, journal_dir, memory_budget) -> None:
    """Serve an engine from a real tritonserver (HTTP, gRPC, metrics) until Ctrl-C or SIGTERM."""
    import signal
    import time

    from tokenswift_trt.serving.server import ServerConfig, ServerError, TritonServer

    config = ServerConfig(engine=engine_dir, host=host, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, instances=instances, device=device, journal_dir=journal_dir,
                          memory_budget_gib=memory_budget)
    server = TritonServer(config)
    click.echo(f"starting tritonserver (log: {server.log_path})", err=True)
    try:
        server.start()
    except ServerError as error:
        raise _fail(error) from None
    click.echo(f"ready: http://{server.http_url}  grpc {server.grpc_url}  metrics {server.metrics_url}")
    click.echo(f"try: curl -X POST http://{server.http_url}/v2/models/tokenswift/generate "
               "-d '{\"text_input\": \"Once upon a time\", \"max_tokens\": 64}'")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping and server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        click.echo("stopping tritonserver", err=True)
        server.stop()


@main.command()
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="HOST:PORT of the gRPC or HTTP endpoint")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--prompt", default=None)
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None)
@click.option("--max-tokens", type=int, required=True)
@click.option("--stream", is_flag=True, help="print text as it arrives")
@click.option("--temperature", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--min-p", type=float, default=None)
@click.option("--penalty", type=float, default=None, help="sent as repetition_penalty (θ)")
@click.option("--penalty-window", type=int, default=None)
@click.option("--ngram-topk", type=int, default=None)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None)
@click.option("--method", type=click.Choice(["tokenswift", "ar"]), default=None)
@click.option("--ignore-eos", is_flag=True)
def client(url, protocol, prompt, prompt_file, max_tokens, stream, temperature, top_k, top_p, min_p, penalty,
           penalty_window, ngram_topk, seed, method, ignore_eos) -> None:
    """Call a running server with Triton's clients; print text (as it arrives with --stream) and stats."""
    from tokenswift_trt.serving.client import ClientError, generate_endpoint, grpc_generate

    text = _read_prompt(prompt, prompt_file)
    params = {"text_input": text, "max_tokens": max_tokens, "stream": stream}
    optional = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                "repetition_penalty": penalty, "penalty_window": penalty_window, "ngram_topk": ngram_topk,
                "seed": seed, "method": method, "ignore_eos": ignore_eos or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    on_text = (lambda piece: click.echo(piece, nl=False)) if stream else None
    try:
        if protocol == "grpc":
            result = grpc_generate(url, params, on_text)
        else:
            result = generate_endpoint(url, params, stream, on_text)
    except ClientError as error:
        raise CliError(f"server error: {error}") from None
    except OSError as error:
        raise CliError(f"cannot reach {url} over {protocol}: {error}") from None
    click.echo("" if stream else result.text)
    click.echo(" ".join(f"{k}={v:g}" for k, v in result.stats.items()), err=True)


@main.command("random-model")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="directory to write")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="overwrite an existing directory")
def random_model(out: Path, seed: int, force: bool) -> None:
    """Write a tiny random-weight Llama directory (with a byte-level tokenizer) for demos and tests."""
    from tokenswift_trt.builder.random_model import write_random_model

    if (out / "config.json").exists() and not force:
        raise CliError(f"{out} already holds a model: pass --force to overwrite")
    write_random_model(out, seed=seed)
    click.echo(f"wrote a random-weight tiny Llama to {out}")


@main.command()
@source_options
@click.option("--prompt", default=None, help="prompt text (default: the model dir's prompt.txt, else a fixed line)")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None)
@click.option("--max-new-tokens", type=int, default=2048, show_default=True)
@sampling_options
def demo(model_dir, engine_dir, heads, prompt, prompt_file, max_new_tokens, **opts) -> None:
    """Generate with AR and with TokenSwift on the same engine, taking turns; print speedup, α, β, Distinct-n and agreement."""
    from tqdm import tqdm

    from tokenswift_trt.bench.metrics import distinct_n
    from tokenswift_trt.bench.run import take_turns
    from tokenswift_trt.runtime.decoding import decode_steps

    source = model_dir or engine_dir
    if prompt is None and prompt_file is None and source is not None:
        default_file = source / "prompt.txt"
        if default_file.is_file():
            prompt_file = default_file
        else:
            prompt = "It is a truth universally acknowledged, that"

    if opts["seed"] is None:
        opts["seed"] = 0
    engine, codec, defaults = _load(model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=False)
    if source is not None and (source / "README.md").is_file() and "Random weights" in (source / "README.md").read_text():
        click.echo("note: this model has RANDOM weights; its text is noise, only speed and exactness mean anything", err=True)
    prompt_text = _read_prompt(prompt, prompt_file)
    prompt_ids = codec.encode(prompt_text)
    # the two methods take turns (256 new tokens each), each timed on its own clock: a machine
    # whose speed drifts while the demo runs slows both alike (docs/benchmarks.md)
    bars = {method: tqdm(total=max_new_tokens, unit="tok", desc=method, file=sys.stderr, position=index)
            for index, method in enumerate(("ar", "tokenswift"))}
    steps = {method: decode_steps(engine, prompt_ids, _generation_config(max_new_tokens, method, opts, defaults),
                                  on_tokens=lambda ids, bar=bar: bar.update(len(ids)))
             for method, bar in bars.items()}
    try:
        results = take_turns(steps, DEMO_TURN_TOKENS)
    finally:
        for bar in bars.values():
            bar.close()
    for tokens, stats, clock in results.values():
        stats.elapsed_s = clock
    (ar_ids, ar, _), (ts_ids, ts, _) = results["ar"], results["tokenswift"]
    click.echo(f"prompt ({len(prompt_ids)} tokens, last 200 chars): {prompt_text[-200:]!r}")
    click.echo(f"TokenSwift text (first 400 chars): {codec.decode(ts_ids)[:400]!r}")
    click.echo(f"AR          {ar.new_tokens:6d} tokens  {ar.elapsed_s:7.2f}s  {ar.tokens_per_s:8.1f} tok/s")
    click.echo(f"TokenSwift  {ts.new_tokens:6d} tokens  {ts.elapsed_s:7.2f}s  {ts.tokens_per_s:8.1f} tok/s")
    click.echo(
        f"speedup {ar.elapsed_s / ts.elapsed_s:.2f}x   α {ts.acceptance_rate:.3f}   β {ts.ngram_acceptance_rate:.3f}   "
        f"tokens/iteration {ts.mean_accept_length:.2f}   tokens/forward {ts.tokens_per_forward:.2f}   "
        f"same tokens as AR: {ar_ids == ts_ids}"
    )
    click.echo("Distinct-1..4: " + "  ".join(f"{distinct_n(ts_ids, n):.3f}" for n in range(1, 5)))


if __name__ == "__main__":
    main()
