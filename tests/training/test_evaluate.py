"""`eval-heads`: the acceptance predicted teacher-forced on the model's own text is what `generate`
then measures with the layers' chain (swift-tiny, greedy and sampled), and the CLI writes both with
the modeled and the measured speedup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tokenswift_trt as ts
from tokenswift_trt.cli import main
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.training.evaluate import measure_chain, modeled_speedup, predict_chain

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPTS = ("Once upon a time there was a little fox", "The river ran past the mill", "In the morning")


@pytest.fixture(scope="module")
def tiny():
    return ts.load(model_dir=MODEL)


@pytest.mark.parametrize("temperature,min_p", [(0.0, 0.0), (1.0, 0.1)])
def test_predicted_layer_acceptance_is_what_generate_measures(tiny, temperature, min_p):
    settings = {"temperature": temperature, "min_p": min_p, "seed": 0}
    prompts = [tiny.codec.encode(p) for p in PROMPTS]
    # the held-out text: what the model writes after those prompts (AR steps, the same seeds)
    written = [
        ts.generate(tiny, p, 300, method="ar", ignore_eos=True, **{**settings, "seed": i}).token_ids
        for i, p in enumerate(prompts)
    ]
    sequences = [torch.tensor(p + w) for p, w in zip(prompts, written)]
    sampling = SamplingConfig(temperature=temperature, min_p=min_p)
    predicted = predict_chain(tiny.engine, tiny.engine.draft_layers, sequences, sampling)
    measured = measure_chain(tiny, prompts, 300, len(tiny.engine.draft_layers), settings)

    assert measured.tree == "1,1,1" and len(measured.acceptance_by_depth) == 3
    layer_1 = predicted.sampled_acceptance[0] if temperature else predicted.greedy_acceptance[0]
    assert 0.1 < layer_1 < 0.9
    assert layer_1 == pytest.approx(measured.acceptance_by_depth[0], abs=0.05)
    if temperature:  # greedy agreement is no bound on sampled acceptance, but both are reported
        assert len(predicted.sampled_by_depth) == 3
    else:
        assert predicted.sampled_acceptance == [] and predicted.sampled_drafts_per_iteration == 0
    joint = predicted.sampled_by_depth if temperature else predicted.greedy_by_depth
    drafts = predicted.sampled_drafts_per_iteration if temperature else predicted.greedy_drafts_per_iteration
    assert drafts == pytest.approx(joint[0] + joint[0] * joint[1] + joint[0] * joint[1] * joint[2])

    # the tuner's trees: the chain 1,1,1 commits the chain's drafts (sampled: within the Gumbel draws'
    # error), a wider tree at least as many, and every tree's figure is 1 + drafts at most its depth
    trees = {figures["tree"]: figures for figures in predicted.trees}
    key = "sampled_tokens_per_iteration" if temperature else "greedy_tokens_per_iteration"
    assert trees["1,1,1"][key] == pytest.approx(1 + drafts, abs=0.03 if temperature else 1e-6)
    assert trees["3,2,1"][key] >= trees["1,1,1"][key] and trees["3,2,1"]["nodes"] == 3 + 6 + 6
    assert trees["3,3"][key] >= trees["3"][key] > trees["1"][key] > 1
    assert all(1 <= t[key] <= 1 + len(t["tree"].split(",")) for t in predicted.trees)
    assert (predicted.trees[0]["sampled_tokens_per_iteration"] is None) == (not temperature)

    modeled = modeled_speedup(predicted, measured, sampled=bool(temperature))
    cost = measured.seconds_per_iteration / measured.seconds_per_ar_step
    assert modeled["tokens_per_iteration"] == pytest.approx(1 + drafts)
    assert modeled["speedup"] == pytest.approx(modeled["tokens_per_iteration"] / cost)
    # the measured chain commits about what the prediction says
    assert measured.tokens_per_iteration == pytest.approx(modeled["tokens_per_iteration"], abs=0.15)


def test_eval_heads_writes_predicted_measured_and_modeled_figures(tiny, tmp_path):
    written = [ts.generate(tiny, p, 120, seed=i, ignore_eos=True).token_ids for i, p in enumerate(PROMPTS)]
    data = tmp_path / "held-out.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "token_ids": w}) + "\n" for i, w in enumerate(written)))
    out = tmp_path / "eval.json"
    args = ["eval-heads", "--model-dir", str(MODEL), "--data", str(data), "--seq-len", "100"]
    args += ["--measure-prompts", "1", "--measure-tokens", "40", "--prompt-tokens", "8", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["predicted"]["positions"] == 3 * (100 - 1 - 3)
    assert report["measured"]["new_tokens"] == 40 and len(report["measured"]["runs"]) == 1
    assert report["modeled"]["speedup"] > 0 and "measured speedup" in result.output
    # the tuner's trees, modeled from verify forwards timed here: the chain's own iteration as measured
    trees = {row["tree"]: row for row in report["modeled"]["trees"]}
    measured = report["measured"]
    chain_cost = measured["seconds_per_iteration"] / measured["seconds_per_ar_step"]
    assert trees["1,1,1"]["iteration_cost_in_ar_steps"] == pytest.approx(chain_cost, abs=1e-4)
    assert all(row["speedup"] > 0 for row in trees.values()) and "tuner's trees" in result.output
    speeds = [row["speedup"] for row in report["modeled"]["trees"]]
    assert speeds == sorted(speeds, reverse=True)
    # the prediction on the tokens the measured run wrote (40 after an 8-token prompt)
    assert report["predicted_on_measured_text"]["positions"] == 8 + 40 - 1 - 3 - (8 - 1)

    # two trees measured: what generate commits is what the ranks predict on its own text, and the trees'
    # modeled costs pass through both measured iterations
    tree_args = [*args[:-2], "--measure-tree", "1,1,1", "--measure-tree", "3,3", "--measure-tokens", "80"]
    result = CliRunner().invoke(main, [*tree_args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    runs = {run["tree"]: run for run in report["measured_trees"]}
    assert set(runs) == {"1,1,1", "3,3"} and report["measured"]["tree"] == "1,1,1"
    for run in runs.values():
        assert run["predicted_on_its_text"] == pytest.approx(run["tokens_per_iteration"], abs=0.15)
        modeled = {row["tree"]: row for row in report["modeled"]["trees"]}[run["tree"]]
        ar_step = sum(r["seconds_per_ar_step"] for r in runs.values()) / 2
        cost = run["seconds_per_iteration"] / ar_step
        assert modeled["iteration_cost_in_ar_steps"] == pytest.approx(cost, abs=1e-3)
    wide = CliRunner().invoke(main, [*args[:-2], "--measure-tree", "5,5"])
    assert wide.exit_code == 2 and "at most 4 wide" in wide.stderr

    args = ["eval-heads", "--model-dir", str(MODEL), "--data", str(tmp_path / "x")]
    missing = CliRunner().invoke(main, args)
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
