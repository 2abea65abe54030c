"""tools.model_training: the 8B recipe's modeled hours follow from the measured H200 costs it reads."""

from __future__ import annotations

import json

import pytest

from tools import model_training


def test_modeled_hours_are_the_recipes_tokens_at_the_measured_costs(tmp_path):
    assert model_training.main(["--out", str(tmp_path), "--gpus", "4"]) == 0
    document = json.loads((tmp_path / "model.json").read_text())
    assert document["label"] == "modeled" and document["gpu"] and document["date"]
    costs, hours, recipe = document["measured"], document["modeled"], document["recipe"]
    tokens = recipe["sequences"] * recipe["new_tokens"]
    assert hours["data_hours"] == pytest.approx(tokens * costs["ar_s_per_token"] / 4 / 3600)
    parts = hours["data_hours"] + hours["train_hours"] + hours["eval_hours"]
    assert hours["total_hours"] == pytest.approx(parts)
    eight = model_training.model(recipe, costs, 8)
    assert eight["train_hours"] == pytest.approx(hours["train_hours"] / 2)  # twice the GPUs, half the time
    assert "Modeled, not run" in (tmp_path / "README.md").read_text()
