"""A preset's draft layers go into its model directory, so `--model-dir` drafts as `--model` does."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest

from tokenswift_trt.builder.presets import (
    HEADS_RECORD,
    MODEL_DIR_DEFAULTS,
    MODEL_DIR_HEADS,
    PRESETS,
    REPOSITORY,
    PresetError,
    draft_layers_hint,
    install_draft_layers,
    read_model_defaults,
)
from tokenswift_trt.builder.smollm2 import SMOLLM2_SHA256, prepare_smollm2

SMOLLM2 = PRESETS["smollm2-135m"]
COMMITTED = REPOSITORY / SMOLLM2.heads


def test_layers_are_added_once_a_stale_copy_is_refreshed_and_a_users_own_file_is_kept(tmp_path):
    first = install_draft_layers(SMOLLM2, tmp_path)
    assert first.action == "added" and first.path == tmp_path / MODEL_DIR_HEADS
    assert first.path.read_bytes() == COMMITTED.read_bytes()
    assert install_draft_layers(SMOLLM2, tmp_path).action == "present"

    # our own earlier copy of another file (the committed layers changed since): replaced
    record = json.loads((tmp_path / HEADS_RECORD).read_text())
    first.path.write_bytes(b"older layers")

    older = hashlib.sha256(b"older layers").hexdigest()
    (tmp_path / HEADS_RECORD).write_text(json.dumps({**record, "sha256": older}))
    assert install_draft_layers(SMOLLM2, tmp_path).action == "updated"
    assert first.path.read_bytes() == COMMITTED.read_bytes()

    # a file the user put there (not our copy): left alone
    first.path.write_bytes(b"layers trained by hand")
    assert install_draft_layers(SMOLLM2, tmp_path).action == "kept-other"
    assert first.path.read_bytes() == b"layers trained by hand"

    assert install_draft_layers(PRESETS["llama3.1-8b"], tmp_path) is None  # ships no layers
    missing = dataclasses.replace(SMOLLM2, heads="models/heads/not-there.safetensors")
    with pytest.raises(PresetError, match="restore them from the repository"):
        install_draft_layers(missing, tmp_path / "other")


def test_an_earlier_import_without_layers_gets_them_without_being_imported_again(tmp_path):
    """`make models` on a directory imported before the layers and settings were written adds them (the
    import record is complete, so the GGUF is not read: the files only need their recorded sizes)."""
    record = {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": SMOLLM2_SHA256,
        "bytes": 1,
        "architecture": "llama",
        "tensor_types": {},
        "files": {"config.json": 5, "model.safetensors": 4096},
        "import_format": 1,
    }
    for name, size in record["files"].items():
        with open(tmp_path / name, "wb") as handle:
            handle.truncate(size)
    (tmp_path / "gguf_source.json").write_text(json.dumps(record))
    before = {name: os.stat(tmp_path / name).st_mtime_ns for name in record["files"]}

    assert prepare_smollm2(tmp_path) == tmp_path
    assert (tmp_path / MODEL_DIR_HEADS).read_bytes() == COMMITTED.read_bytes()
    settings = {"preset": "smollm2-135m", "defaults": SMOLLM2.defaults}
    assert json.loads((tmp_path / MODEL_DIR_DEFAULTS).read_text()) == settings
    assert read_model_defaults(tmp_path) == SMOLLM2.defaults
    assert {name: os.stat(tmp_path / name).st_mtime_ns for name in record["files"]} == before


def test_the_hint_names_make_models_for_the_presets_directory_and_training_elsewhere(tmp_path):
    assert "run `make models`" in draft_layers_hint(REPOSITORY / SMOLLM2.bundled)
    assert "--model smollm2-135m" in draft_layers_hint(REPOSITORY / SMOLLM2.bundled)
    other = draft_layers_hint(tmp_path)
    assert f"tokenswift-trt train-heads --model-dir {tmp_path}" in other and "make models" not in other
    assert "tokenswift-trt build --heads" in draft_layers_hint(None)  # an engine directory
