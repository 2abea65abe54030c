"""ONNX export for TensorRT with our plugins: one TokenSwiftTreeAttention node per layer, in the
form TensorRT's ONNX parser maps to the plugin (op type, plugin_version/plugin_namespace strings,
INT/FLOAT fields, int32 packed mask), and no attention left in ONNX ops."""

from __future__ import annotations

import onnx
import pytest

from tokenswift_trt.builder.onnx_export import export_onnx

from conftest import quiet_load

pytest.importorskip("onnxscript", reason="the ONNX exporter needs onnxscript")


@pytest.fixture(scope="module")
def exported(llama_dir, tmp_path_factory):
    directory, _ = llama_dir
    engine = quiet_load(directory)
    before = engine.model.attention_kernel  # "cpu_tree_attention" where the CPU kernel builds, else "sdpa"
    out = tmp_path_factory.mktemp("onnx-plugins")
    export_onnx(engine.model, engine.draft_layers, out, plugins=True)
    assert engine.model.attention_kernel == before  # the export switched the kernel only while exporting
    return engine, out


@pytest.mark.parametrize("graph", ["verify.onnx", "draft.onnx"])
def test_attention_is_one_plugin_node_per_layer(exported, graph):
    engine, out = exported
    model = onnx.load(str(out / graph))
    config = engine.config
    nodes = [n for n in model.graph.node if n.op_type == "TokenSwiftTreeAttention"]
    assert len(nodes) == config.num_layers
    assert ("tokenswift", 1) in {(o.domain, o.version) for o in model.opset_import}
    for node in nodes:
        assert node.domain == "tokenswift" and len(node.input) == 4 and len(node.output) == 1
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes == {
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "scale": pytest.approx(config.head_dim**-0.5),
            "plugin_version": b"1",
            "plugin_namespace": b"tokenswift",
        }
        kinds = {a.name: a.type for a in node.attribute}
        assert kinds["num_heads"] == onnx.AttributeProto.INT and kinds["scale"] == onnx.AttributeProto.FLOAT
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]  # attention is entirely in the plugin


def test_the_packed_mask_input_is_int32(exported):
    _, out = exported
    model = onnx.shape_inference.infer_shapes(onnx.load(str(out / "verify.onnx")))
    types = {
        v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)
    }
    masks = [n.input[3] for n in model.graph.node if n.op_type == "TokenSwiftTreeAttention"]
    assert {types[name] for name in masks} == {onnx.TensorProto.INT32}
