"""tools/bench_kernels.py: rows per (T, L) with consistent derived figures; clear refusals."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tools.bench_kernels import KernelBenchError, bench_tree_attention, check_kernel_request, main


def test_cpu_smoke_run_writes_a_row_per_case(tmp_path):
    out = tmp_path / "kernels"
    code = main(
        [
            "--device",
            "cpu",
            "--tree-sizes",
            "1,5",
            "--contexts",
            "64,200",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = list(csv.DictReader((out / "kernels.csv").open()))
    assert [(int(r["tree_tokens"]), int(r["context"])) for r in rows] == [
        (1, 64),
        (5, 64),
        (1, 200),
        (5, 200),
    ]
    for row in rows:
        assert float(row["kernel_ms"]) > 0 and float(row["sdpa_ms"]) > 0
        assert float(row["speedup_vs_sdpa"]) == pytest.approx(
            float(row["sdpa_ms"]) / float(row["kernel_ms"]), rel=1e-2
        )
    meta = json.loads((out / "kernels.json").read_text())["meta"]
    assert meta["copy_bandwidth_gb_s"] > 0 and "tools.bench_kernels" in meta["command"]
    assert meta["date"] and meta["cpu"]


def test_bandwidth_time_counts_the_kv_bytes():
    rows, bandwidth = bench_tree_attention(
        torch.device("cpu"),
        [2],
        [100, 400],
        heads=2,
        kv_heads=1,
        head_dim=64,
        dtype=torch.bfloat16,
        repeats=1,
    )
    moved = [(2 * 1 * (length + 2) + 2 * 2 * 2) * 64 * 2 for length in (100, 400)]
    for row, size in zip(rows, moved):
        assert row.bandwidth_ms == pytest.approx(size / bandwidth * 1e3)


def test_refusals_are_one_line(tmp_path, capsys):
    assert main(["--device", "cpu", "--tree-sizes", "300", "--out", str(tmp_path)]) == 2
    assert "at most 256 tree tokens" in capsys.readouterr().err
    assert main(["--device", "cpu", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "multiple of --kv-heads" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_requests_the_op_cannot_take_are_refused_before_anything_runs():
    from tokenswift_trt.kernels.ops import MAX_TREE_TOKENS

    check_kernel_request("cpu", [1, MAX_TREE_TOKENS], 4, 2, 64, 1)  # the largest tree the op takes
    for args, message in [
        (("cpu", [MAX_TREE_TOKENS + 1], 4, 2, 64, 1), f"at most {MAX_TREE_TOKENS} tree tokens"),
        (("cpu", [1], 6, 4, 64, 1), "multiple of --kv-heads"),
        (("cpu", [1], 4, 2, 64, 0), "--repeats at least 1"),
    ]:
        with pytest.raises(KernelBenchError, match=message):
            check_kernel_request(*args)
    if not torch.cuda.is_available():
        with pytest.raises(KernelBenchError, match="needs a CUDA GPU"):
            check_kernel_request("cuda", [1], 4, 2, 64, 1)
