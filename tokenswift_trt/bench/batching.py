"""Many users at once: one server without batching, two instances, batched AR and batched TokenSwift,
side by side in one run (`tokenswift-trt bench-serve --batching`).

For each setup a tritonserver is started on free loopback ports; at each concurrency C, C clients
stream one request each at the same moment (distinct prompts, the engine's sampling, a seed per
prompt, EOS ignored so that every request writes the same number of tokens). Measured per request:
time to first token, tokens per second after it; per level: aggregate tokens per second (all
requests' tokens over the wall time from the first send to the last answer). Every request's text is
checked against its single run (`ts.generate` with the same settings, before any server starts).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# eight openings, each unlike the others: a novel's narration and dialogue, a letter, a recipe, a
# schedule, code, a report and a poem (written for this benchmark)
PROMPTS = (
    "The carriage stopped at the end of the lane, and Margaret stepped down into the mud before the"
    " driver could help her. The house was smaller than she remembered, and",
    '"You cannot mean to leave tonight," said her brother, standing between her and the door. "The'
    " roads are flooded past the mill, and",
    "Dear Mr. Hollis,\nThank you for your letter of the fourteenth. I have read your proposal with care"
    " and I must tell you plainly that",
    "To make the bread, first warm the milk until it is just above the heat of your hand. Stir in the"
    " yeast and a spoonful of honey, then",
    "Monday: 7:00 breakfast, 8:00 lecture in the east hall, 10:30 laboratory, 12:30 lunch.\nTuesday:",
    'def merge_sorted(left, right):\n    """Merge two sorted lists into one sorted list."""\n',
    "Quarterly report. Revenue rose by four percent over the previous quarter, driven mainly by the"
    " northern stores, while costs",
    "Over the hill the evening comes,\nslow as cattle to the gate;\nthe swallows",
)


@dataclass(frozen=True)
class Setup:
    name: str
    instances: int
    max_batch: int
    method: str  # "tokenswift" or "ar"


SETUPS = (
    Setup("one instance, one request at a time", 1, 0, "tokenswift"),
    Setup("two instances, one request at a time each", 2, 0, "tokenswift"),
    Setup("one instance, batched AR", 1, 8, "ar"),
    Setup("one instance, batched TokenSwift", 1, 8, "tokenswift"),
)


def _level(grpc_url: str, count: int, tokens: int, method: str, expected: list[str]) -> dict[str, Any]:
    """`count` concurrent streams; their timings and whether each text is its single run's."""
    from tokenswift_trt.serving.client import grpc_generate

    starts, firsts, ends, texts, failures = {}, {}, {}, {}, []
    barrier = threading.Barrier(count)

    def client(index: int) -> None:
        params = {
            "text_input": PROMPTS[index],
            "max_tokens": tokens,
            "seed": 1 + index,
            "ignore_eos": True,
            "stream": True,
            "method": method,
        }
        barrier.wait()
        starts[index] = time.perf_counter()
        try:
            result = grpc_generate(
                grpc_url,
                params,
                on_text=lambda _: firsts.setdefault(index, time.perf_counter()),
                timeout_s=3600,
            )
            ends[index], texts[index] = time.perf_counter(), result.text
        except Exception as error:  # noqa: BLE001 (counted and reported)
            failures.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=client, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = max(ends.values(), default=0.0) - min(starts.values(), default=0.0)
    done = sorted(ends)
    return {
        "concurrency": count,
        "requests_completed": len(done),
        "failures": failures,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens * len(done) / wall, 2) if wall > 0 else 0.0,
        "time_to_first_token_s": [round(firsts[i] - starts[i], 3) for i in done],
        "per_request_tokens_per_s": [
            round(tokens / (ends[i] - firsts[i]), 2) for i in done if ends[i] > firsts[i]
        ],
        "same_text_as_single_run": [texts[i] == expected[i] for i in done],
    }


def run_batching_bench(
    engine: Path, tokens: int, levels: list[int], kernels: dict[str, Any]
) -> dict[str, Any]:
    """Every setup at every concurrency level; returns the report (rows, meta)."""
    import os

    import tokenswift_trt as ts
    from tokenswift_trt.environment import machine_meta
    from tokenswift_trt.serving.server import TritonServer, local_config

    most = max(levels)
    if most > len(PROMPTS):
        raise ValueError(f"at most {len(PROMPTS)} concurrent requests (one per prompt), got {most}")
    load_before = os.getloadavg()
    model = ts.load(model_dir=engine, kernels=kernels)
    expected = [ts.generate(model, PROMPTS[i], tokens, seed=1 + i, ignore_eos=True).text for i in range(most)]
    del model
    rows = []
    for setup in SETUPS:
        config = local_config(engine, instances=setup.instances, max_batch=setup.max_batch, kernels=kernels)
        with TritonServer(config) as server:
            from tokenswift_trt.serving.client import grpc_generate

            grpc_generate(server.grpc_url, {"text_input": PROMPTS[0], "max_tokens": 8})  # warm-up
            for count in levels:
                level = _level(server.grpc_url, count, tokens, setup.method, expected)
                rows.append(
                    {
                        "setup": setup.name,
                        "instances": setup.instances,
                        "max_batch": setup.max_batch,
                        "method": setup.method,
                        **level,
                    }
                )
    base = {
        row["concurrency"]: row["aggregate_tokens_per_s"] for row in rows if row["setup"] == SETUPS[0].name
    }
    for row in rows:
        reference = base.get(row["concurrency"])
        row["aggregate_over_one_at_a_time"] = (
            round(row["aggregate_tokens_per_s"] / reference, 3) if reference else None
        )
        firsts = row["time_to_first_token_s"]
        row["time_to_first_token_p50_s"] = round(statistics.median(firsts), 3) if firsts else None
        row["time_to_first_token_max_s"] = max(firsts) if firsts else None
    return {
        "meta": {
            **machine_meta(),
            "engine": str(engine),
            "tokens_per_request": tokens,
            "levels": levels,
            "kernels": kernels,
            "load_average_before": load_before,
        },
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# Batching: {meta['engine']}, {meta['tokens_per_request']} tokens per request",
        "",
        f"{meta['cpu']} ({meta['cpus']} CPUs), torch {meta['torch']}, {meta['date']}; load average before "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_before'])}.",
        "",
        "| setup | concurrency | aggregate tok/s | vs one at a time | TTFT p50 / max (s) "
        "| per-request tok/s (median) | same text as single run |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        rate = statistics.median(row["per_request_tokens_per_s"]) if row["per_request_tokens_per_s"] else 0.0
        same = all(row["same_text_as_single_run"]) and not row["failures"]
        lines.append(
            f"| {row['setup']} | {row['concurrency']} | {row['aggregate_tokens_per_s']:.1f} | "
            f"{row['aggregate_over_one_at_a_time']:.2f}x | {row['time_to_first_token_p50_s']} / "
            f"{row['time_to_first_token_max_s']} | {rate:.1f} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
