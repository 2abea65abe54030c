"""The batched roofline model: at batch 1 it gives back the measured step times it was fitted to, it
never credits more tokens per iteration than the trie commits, and caches that do not fit are marked."""

from __future__ import annotations

from tools.model_batch import Gpu, Shape, model

CURVE = [(4096, 6.0, 9.0), (98304, 9.0, 18.0)]  # (context, AR ms, iteration ms) at batch 1


def test_batch_1_reproduces_the_measured_steps_and_long_contexts_keep_the_gain():
    rows = model(Shape(), Gpu(), CURVE, {"cap": 4.0}, slots=52, batches=[1, 4, 32], compute_efficiency=0.6)
    first = {row["context"]: row for row in rows if row["batch"] == 1}
    assert first[4096]["ar_step_ms"] == 6.0 and first[4096]["tokenswift_iteration_ms"] == 9.0
    assert first[98304]["speedup_cap"] == round(4.0 * 9.0 / 18.0, 3)
    by = {(row["context"], row["batch"]): row for row in rows}
    # short context: the tree tokens' arithmetic catches up with the bytes as the batch grows
    assert by[(4096, 32)]["speedup_cap"] < by[(4096, 1)]["speedup_cap"]
    # long context: the caches dominate the bytes, read once for every tree token
    assert by[(98304, 4)]["speedup_cap"] > by[(98304, 1)]["speedup_cap"]
    assert not by[(98304, 32)]["fits"] and by[(4096, 32)]["fits"]
    assert all(row["speedup_cap"] <= 4.0 for row in rows)
