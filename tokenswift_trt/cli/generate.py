"""`generate` (with journals and --resume) and `demo` (AR and TokenSwift side by side)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import (
    CliError,
    PositiveGiB,
    early_defaults,
    fail,
    generation_config,
    given_command,
    kernel_option,
    load_source,
    read_prompt,
    request_settings,
    sampling_options,
    source_options,
    unequal_tokens_note,
)
from .tp_launch import tp_options

DEMO_TURN_TOKENS = 256  # `demo`: new tokens each method decodes per turn


def given_on_command_line(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """Those of the settings `names` given on the command line, as a user wrote them."""
    from click.core import ParameterSource

    return [
        f"--{name.replace('_', '-')}"
        for name in names
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]


@click.command()
@source_options
@click.option("--prompt", default=None, help="prompt text")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="file holding the prompt")
@click.option(
    "--max-new-tokens", type=int, default=None, help="tokens to generate (required unless --resume)"
)
@click.option("--method", type=click.Choice(["tokenswift", "ar"]), default="tokenswift", show_default=True)
@click.option("--stream", is_flag=True, help="print text as it is accepted")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='print one JSON object at the end; with --stream, JSON Lines: {"text": ...} per increment, '
    "then that object as the last line",
)
@click.option(
    "--journal",
    type=click.Path(path_type=Path),
    default=None,
    help="append committed tokens to this journal (crash-safe); an unfinished journal is never "
    "replaced (continue it with --resume), a finished one is",
)
@click.option(
    "--journal-every", type=click.IntRange(1), default=64, show_default=True, help="tokens per journal record"
)
@click.option(
    "--resume",
    type=click.Path(path_type=Path),
    default=None,
    help="continue the generation recorded in this journal",
)
@click.option(
    "--memory-budget",
    type=PositiveGiB(),
    default=None,
    help="GiB the caches may use (default: the memory free now)",
)
@kernel_option
@tp_options
@sampling_options
def generate(
    model,
    model_dir,
    engine_dir,
    heads,
    prompt,
    prompt_file,
    max_new_tokens,
    method,
    stream,
    as_json,
    journal,
    journal_every,
    resume,
    memory_budget,
    kernels,
    tp,
    tp_timeout,
    **opts,
) -> None:
    """Generate a continuation of a prompt with TokenSwift (or the AR baseline); journal and resume long
    runs."""
    from tokenswift_trt.api import ApiError, journal_origin, resume_run, start_run, with_memory_budget
    from tokenswift_trt.decode.autotune import describe_plans
    from tokenswift_trt.decode.request import (
        ADAPTATION_SETTINGS,
        OUTPUT_DECIDING,
        SPEED_ONLY,
        TOKENSWIFT_ONLY,
    )
    from tokenswift_trt.decode.text import StreamDecoder

    from ..progress import progress_bar

    if resume is not None:
        if journal is not None or prompt is not None or prompt_file is not None:
            raise CliError("--resume continues a journal: it takes no --prompt, --prompt-file or --journal")
        deciding = [
            f"--{name.replace('_', '-')}" for name in OUTPUT_DECIDING if opts.get(name) not in (None, False)
        ]
        if max_new_tokens is not None:
            deciding.insert(0, "--max-new-tokens")
        if deciding:
            raise CliError(f"--resume continues with the journal's own settings: drop {', '.join(deciding)}")
        try:
            origin, recorded_dtype, recorded_kernels = journal_origin(resume)
        except ApiError as error:
            raise fail(error) from None
        if model is None and model_dir is None and engine_dir is None:
            model_dir, engine_dir, heads = origin.model_dir, origin.engine_dir, origin.heads
        if opts["dtype"] is None and engine_dir is None:  # the dtype that wrote the journal's tokens
            opts["dtype"] = recorded_dtype
        kernels = {**recorded_kernels, **kernels}  # the kernels that wrote it
    else:
        if max_new_tokens is None:
            raise CliError("--max-new-tokens is required (unless --resume)")
        text = read_prompt(prompt, prompt_file)
        if method == "ar" and not as_json:
            ignored = given_on_command_line(click.get_current_context(), TOKENSWIFT_ONLY)
            if ignored:
                click.echo(
                    f"note: --method ar ignores {', '.join(ignored)} (TokenSwift's settings)", err=True
                )
        defaults = early_defaults(model, model_dir, engine_dir, heads)
        config = generation_config(max_new_tokens, method, opts, defaults)  # bad values: refused now
        ignored = given_on_command_line(click.get_current_context(), ADAPTATION_SETTINGS)
        if config.method == "tokenswift" and not config.adapt_drafts and ignored and not as_json:
            click.echo(f"note: {', '.join(ignored)} apply with --adapt-drafts: add it or drop them", err=True)
        if journal is not None:  # a journal that cannot be kept is refused before the model loads
            from tokenswift_trt.decode.journal import JournalError, check_journal_room, check_new_journal

            try:
                check_new_journal(
                    journal, f"--resume {journal}", "delete it (or choose another --journal path)"
                )
                check_journal_room(journal, max_new_tokens)
            except JournalError as error:
                raise CliError(str(error).strip().splitlines()[0]) from None
    source = load_source(
        model,
        model_dir,
        engine_dir,
        heads,
        opts["dtype"],
        opts["device"],
        quiet=as_json,
        kernels=kernels,
        tp=tp,
        tp_timeout=tp_timeout,
    )
    leader = source.ranks is None or source.ranks.leader  # tensor parallel: rank 0 writes the journal
    try:
        if resume is not None:
            speed = {name: value for name, value in request_settings(opts).items() if name in SPEED_ONLY}
            run = resume_run(resume, source.model, speed, journal_every, writes=leader)
        else:
            assert source.defaults == defaults, "the config was built from the defaults the source loads with"
            run = start_run(source.model, text, config, journal, journal_every, writes=leader)
    except ApiError as error:
        raise fail(error) from None
    if not as_json:
        for note in run.notes:
            click.echo(f"note: {note}", err=True)
    run.with_remaining(lambda remaining: with_memory_budget(remaining, memory_budget))
    if source.ranks is not None:  # tensor parallel: rank 0's seed and plan, the least memory any rank has
        run.with_remaining(lambda remaining: source.ranks.with_memory(source.ranks.agree(remaining)))
    config, done_ids = run.config, run.done_ids
    if (
        config.method == "tokenswift"
        and config.device_loop
        and source.engine.device.type == "cpu"
        and not as_json
    ):
        click.echo(
            "note: the device loop is CUDA's path: on a CPU the host loop (its default there) is faster; "
            "drop --device-loop",
            err=True,
        )

    codec = source.codec
    stream_decoder = StreamDecoder(codec)

    def show(piece: str) -> None:
        """A streamed text increment: as it is, or one JSON line with --json (JSON Lines)."""
        if as_json:
            if piece:
                click.echo(json.dumps({"text": piece}))
        else:
            click.echo(piece, nl=False)

    if stream and done_ids:
        show(stream_decoder.push(done_ids))
    progress = progress_bar(
        total=config.max_new_tokens,
        initial=len(done_ids),
        unit="tok",
        disable=True if (as_json or stream) else None,
    )

    def on_tokens(ids: list[int]) -> None:
        if source.ranks is not None:
            source.ranks.check_tokens(ids)  # every rank committed the same tokens
        progress.update(len(ids))
        if stream:
            show(stream_decoder.push(ids))

    kept = journal or resume
    try:
        result = run.execute(on_tokens)
    except ApiError as error:
        raise fail(error) from None
    except (RuntimeError, ValueError) as error:  # tensor parallel: a rank stopped, timed out or diverged
        if source.ranks is None:
            raise
        raise CliError(
            f"the tensor-parallel run stopped: {fail(error).message}"
            + (f"; {kept} keeps the committed tokens (continue with --resume)" if run.writer else "")
        ) from None
    finally:
        progress.close()
    done_ids, stats = result.token_ids, result.stats
    output = codec.decode(done_ids)
    if stream:
        show(stream_decoder.flush())
        if not as_json:
            click.echo()
    if stats is not None and stats.stop_reason == "max_length" and not as_json:
        click.echo(f"note: stopped at the engine's maximum length after {len(done_ids)} new tokens", err=True)
    if as_json:
        click.echo(
            json.dumps(
                {
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
                    "plans": describe_plans(stats.plans) if stats else [],
                    "draft_updates": stats.draft_updates if stats else 0,  # --adapt-drafts' steps
                    "thread_switches": stats.thread_switches if stats else 0,  # --threads auto's changes
                    # per window of output positions (from where this run began): α by depth, tokens
                    # per iteration and their counts (docs/benchmarks.md)
                    "window_tokens": stats.window_tokens if stats else 0,
                    "windows": stats.window_figures if stats else [],
                }
            )
        )
        return
    if not stream:
        click.echo(output)
    if stats is not None:
        adapted = f", {stats.draft_updates} adaptation steps" if config.adapts_drafts else ""
        click.echo(
            f"[{stats.method}] {stats.new_tokens} tokens in {stats.elapsed_s:.2f}s "
            f"({stats.tokens_per_s:.1f} tok/s), "
            f"α {stats.acceptance_rate:.3f}, β {stats.ngram_acceptance_rate:.3f}{adapted}, "
            f"seed {stats.seed}, stop: {stats.stop_reason}",
            err=True,
        )
        if config.adapts_drafts and stats.draft_updates == 0:
            click.echo(
                f"note: --adapt-drafts took no step: drafting iterations committed fewer than --adapt-block "
                f"({config.adapt_block}) positions in a row (AR steps, which --tree auto may choose, adapt "
                "nothing)",
                err=True,
            )


@click.command()
@source_options
@click.option(
    "--prompt", default=None, help="prompt text (default: the model dir's prompt.txt, else a fixed line)"
)
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None)
@click.option("--max-new-tokens", type=int, default=2048, show_default=True)
@click.option(
    "--users",
    type=click.IntRange(0, 64),
    default=4,
    show_default=True,
    help="then this many requests (the prompt, a seed each) one at a time and batched; 0 = skip",
)
@click.option(
    "--user-tokens", type=click.IntRange(1), default=256, show_default=True, help="tokens per user request"
)
@click.option(
    "--edit/--no-edit",
    default=True,
    show_default=True,
    help="then an editing request (revise a short Python file; greedy, stops at EOS), whose answer copies "
    "much of its input, with AR and TokenSwift taking turns (not with --tp)",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="also write the printed rows to OUT/run.json, with the machine, date and command",
)
@tp_options
@kernel_option
@sampling_options
def demo(
    model,
    model_dir,
    engine_dir,
    heads,
    prompt,
    prompt_file,
    max_new_tokens,
    users,
    user_tokens,
    edit,
    out,
    tp,
    tp_timeout,
    kernels,
    **opts,
) -> None:
    """Generate with AR and with TokenSwift on the same engine, taking turns; print speedup, α, β,
    Distinct-n and agreement; then an editing request whose answer copies much of its input, the same
    way; then a few users' requests one at a time and decoded together. With --tp N the first part runs
    split over N tensor-parallel ranks (and the others are skipped); rank 0 prints. --out DIR writes
    the rows to DIR/run.json."""
    from tokenswift_trt.bench.metrics import distinct_n
    from tokenswift_trt.bench.report import write_run_json
    from tokenswift_trt.bench.run import take_turns
    from tokenswift_trt.decode.autotune import describe_plans
    from tokenswift_trt.decode.config import GenerationError
    from tokenswift_trt.decode.loop import decode_steps

    from ..progress import progress_bar

    if opts["seed"] is None:
        opts["seed"] = 0
    loaded = load_source(
        model,
        model_dir,
        engine_dir,
        heads,
        opts["dtype"],
        opts["device"],
        quiet=False,
        kernels=kernels,
        tp=tp,
        tp_timeout=tp_timeout,
    )
    ranks = loaded.ranks  # tensor parallel: rank 0's seed and plan; ranks check each iteration's tokens
    directory = loaded.model_dir or loaded.engine_dir
    assert directory is not None
    if prompt is None and prompt_file is None:
        if (directory / "prompt.txt").is_file():
            prompt_file = directory / "prompt.txt"
        else:
            prompt = "It is a truth universally acknowledged, that"
    readme = directory / "README.md"
    if readme.is_file() and "Random weights" in readme.read_text():
        click.echo(
            "note: this model has RANDOM weights; its text is noise, only speed and exactness mean anything",
            err=True,
        )
    prompt_text = read_prompt(prompt, prompt_file)
    prompt_ids = loaded.codec.encode(prompt_text)
    # the two methods take turns (256 new tokens each), each timed on its own clock: a machine whose
    # speed drifts while the demo runs slows both alike (docs/benchmarks.md); one bar for both
    bar = progress_bar(total=2 * max_new_tokens, unit="tok", desc="AR + TokenSwift")

    def on_tokens(ids: list[int]) -> None:
        if ranks is not None:
            ranks.check_tokens(ids)
        bar.update(len(ids))

    configs = {
        method: generation_config(max_new_tokens, method, opts, loaded.defaults)
        for method in ("ar", "tokenswift")
    }
    if ranks is not None:
        configs = {method: ranks.with_memory(ranks.agree(config)) for method, config in configs.items()}
    steps = {
        method: decode_steps(loaded.engine, prompt_ids, config, on_tokens=on_tokens)
        for method, config in configs.items()
    }
    try:
        results = take_turns(steps, DEMO_TURN_TOKENS)
    except GenerationError as error:
        raise fail(error) from None
    except RuntimeError as error:  # tensor parallel: a rank stopped or timed out in a collective
        if ranks is None:
            raise
        raise CliError(f"the tensor-parallel run stopped: {fail(error).message}") from None
    finally:
        bar.close()
    for _, stats, clock in results.values():
        stats.elapsed_s = clock
    (ar_ids, ar, _), (ts_ids, ts, _) = results["ar"], results["tokenswift"]
    codec = loaded.codec
    click.echo(f"prompt ({len(prompt_ids)} tokens, last 200 chars): {prompt_text[-200:]!r}")
    click.echo(f"TokenSwift text (first 400 chars): {codec.decode(ts_ids)[:400]!r}")
    click.echo(f"AR          {ar.new_tokens:6d} tokens  {ar.elapsed_s:7.2f}s  {ar.tokens_per_s:8.1f} tok/s")
    click.echo(f"TokenSwift  {ts.new_tokens:6d} tokens  {ts.elapsed_s:7.2f}s  {ts.tokens_per_s:8.1f} tok/s")
    click.echo(
        f"speedup {round(ar.elapsed_s / ts.elapsed_s, 3):.2f}x   α {ts.acceptance_rate:.3f}   β "
        f"{ts.ngram_acceptance_rate:.3f}   "
        f"tokens/iteration {ts.mean_accept_length:.2f}   tokens/forward {ts.tokens_per_forward:.2f}   "
        f"same tokens as AR: {ar_ids == ts_ids}"
    )
    if ar_ids != ts_ids:
        click.echo(unequal_tokens_note(str(loaded.engine.device), str(loaded.engine.dtype)), err=True)
    by_depth = "  ".join(
        f"{depth}: {alpha:.3f} ({reached})"
        for depth, (alpha, reached) in enumerate(zip(ts.acceptance_by_depth, ts.reached_by_depth), 1)
    )
    click.echo(
        f"α by depth: {by_depth}   (accepted / reached, iterations reaching the depth in brackets)"
        if by_depth
        else "α by depth: no drafting iteration (AR steps only)"
    )
    click.echo("Distinct-1..4: " + "  ".join(f"{distinct_n(ts_ids, n):.3f}" for n in range(1, 5)))
    if ts.plans:
        click.echo("plans (--tree auto): " + " | ".join(describe_plans(ts.plans)))
    rows = [
        {
            "job": "prose",
            "prompt_tokens": len(prompt_ids),
            **_row(ar_ids, ar.elapsed_s, ts_ids, ts.elapsed_s, ts.mean_accept_length),
            "alpha": round(ts.acceptance_rate, 4),
            "beta": round(ts.ngram_acceptance_rate, 4),
            "tokens_per_forward": round(ts.tokens_per_forward, 3),
            "plans": describe_plans(ts.plans),
        }
    ]
    if edit and ranks is None:
        rows.append(_editing(loaded, directory, opts))
    if loaded.engine.device.type == "cpu":
        click.echo(WHY_PROSE)
    if users and ranks is None:
        rows.append(_users(loaded.engine, prompt_ids, configs["tokenswift"], users, user_tokens))
    if out is not None and (ranks is None or ranks.leader):
        click.echo(f"wrote {write_run_json(out, given_command('tokenswift-trt demo'), rows)}", err=True)


def _row(ar_ids: list[int], ar_s: float, ts_ids: list[int], ts_s: float, accept_length: float) -> dict:
    """A demo job's figures as run.json records them: each method's tokens, seconds and tokens/s, the
    speedup, TokenSwift's tokens per iteration and whether its tokens are AR's."""
    return {
        "ar_tokens": len(ar_ids),
        "ar_s": round(ar_s, 3),
        "ar_tokens_per_s": round(len(ar_ids) / ar_s, 2),
        "tokenswift_tokens": len(ts_ids),
        "tokenswift_s": round(ts_s, 3),
        "tokenswift_tokens_per_s": round(len(ts_ids) / ts_s, 2),
        "speedup": round(ar_s / ts_s, 3),
        "tokens_per_iteration": round(accept_length, 3),
        "same_tokens_as_ar": ar_ids == ts_ids,
    }


# why the prose row gains little on a CPU and what a GPU changes (docs/benchmarks.md: the 2-core CPU
# tables, the H200 8B iteration table and the Modeled section)
WHY_PROSE = (
    "why prose gains little here: on a few CPU cores a step is bound by arithmetic, so a verify costs "
    "about as many AR steps as it checks tokens, and a small model's draft layers commit 1.1-1.8 tokens "
    "an iteration (SmolLM2-135M), while copied text commits many per verify; on an H200 an 8B model's "
    "iteration with a 52-token verify costs 1.5-2 AR steps (measured), modeled at 1.24x for 1.83 tokens "
    "an iteration and 2.71x at the trie's cap of 4 (4K prompt; docs/benchmarks.md, Modeled)"
)


def _editing(loaded, directory: Path, opts: dict) -> dict:
    """The editing request (demo_edit.py), greedy without penalty and stopping at EOS, decoded by AR
    and TokenSwift taking turns; prints its own figures and whether the tokens are the same, and
    returns its row."""
    from tokenswift_trt.bench.run import take_turns
    from tokenswift_trt.decode.loop import GenerationError, decode_steps
    from tokenswift_trt.serving.openai_api import ApiError, FrontendError

    from .demo_edit import EDIT_TOKENS, edit_prompt

    try:
        prompt_text, chat = edit_prompt(directory)
    except (FrontendError, ApiError) as error:
        raise CliError(f"the editing request: {error}") from None
    prompt_ids = loaded.codec.encode(prompt_text)
    settings = {**opts, "temperature": 0.0, "penalty": 1.0, "ignore_eos": False}
    configs = {
        method: generation_config(EDIT_TOKENS, method, settings, loaded.defaults)
        for method in ("ar", "tokenswift")
    }
    click.echo(
        f"editing request ({len(prompt_ids)} prompt tokens, "
        f"{'chat template' if chat else 'no chat template: plain text'}, greedy, stops at EOS): "
        "add a docstring to a short Python file and reply with the whole file"
    )
    steps = {method: decode_steps(loaded.engine, prompt_ids, config) for method, config in configs.items()}
    try:
        results = take_turns(steps, DEMO_TURN_TOKENS)
    except GenerationError as error:
        raise fail(error) from None
    (ar_ids, ar, ar_s), (ts_ids, ts, ts_s) = results["ar"], results["tokenswift"]
    click.echo(f"answer (first 200 chars): {loaded.codec.decode(ts_ids)[:200]!r}")
    click.echo(f"AR          {ar.new_tokens:6d} tokens  {ar_s:7.2f}s  {ar.new_tokens / ar_s:8.1f} tok/s")
    click.echo(f"TokenSwift  {ts.new_tokens:6d} tokens  {ts_s:7.2f}s  {ts.new_tokens / ts_s:8.1f} tok/s")
    click.echo(
        f"editing: speedup {round(ar_s / ts_s, 3):.2f}x   tokens/iteration {ts.mean_accept_length:.2f}   "
        f"same tokens as AR: {ar_ids == ts_ids}"
    )
    if ar_ids != ts_ids:
        click.echo(unequal_tokens_note(str(loaded.engine.device), str(loaded.engine.dtype)), err=True)
    row = _row(ar_ids, ar_s, ts_ids, ts_s, ts.mean_accept_length)
    return {"job": "editing", "prompt_tokens": len(prompt_ids), "chat_template": chat, **row}


def _users(engine, prompt_ids: list[int], config, users: int, tokens: int) -> dict:
    """`users` requests of the prompt (a seed each), one after another and then decoded together;
    prints each way's aggregate speed and whether every request wrote the same tokens both ways, and
    returns its row."""
    import dataclasses
    import time

    from tokenswift_trt.decode.loop import generate as run_generate
    from tokenswift_trt.decode.scheduler import FINISHED, Scheduler

    configs = [dataclasses.replace(config, max_new_tokens=tokens, seed=1 + user) for user in range(users)]
    tick = time.perf_counter()
    alone = [run_generate(engine, prompt_ids, each)[0] for each in configs]
    one_at_a_time = time.perf_counter() - tick
    scheduler = Scheduler(engine, max_batch=users)
    requests = [scheduler.submit(prompt_ids, each) for each in configs]
    tick = time.perf_counter()
    scheduler.run()
    together = time.perf_counter() - tick
    same = all(r.status == FINISHED and r.tokens == ids for r, ids in zip(requests, alone, strict=True))
    total = sum(len(ids) for ids in alone)
    click.echo(
        f"{users} users x {tokens} tokens: one at a time {total / one_at_a_time:.1f} tok/s, batched "
        f"{total / together:.1f} tok/s ({one_at_a_time / together:.2f}x), same tokens: {same}"
    )
    return {
        "job": "users",
        "users": users,
        "tokens_per_user": tokens,
        "one_at_a_time_tokens_per_s": round(total / one_at_a_time, 2),
        "batched_tokens_per_s": round(total / together, 2),
        "speedup": round(one_at_a_time / together, 3),
        "same_tokens_as_alone": same,
    }
