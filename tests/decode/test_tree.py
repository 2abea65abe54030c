from __future__ import annotations

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.journal import journal_header
from tokenswift_trt.decode.request import config_from, settings_of
from tokenswift_trt.decode.tree import (
    TreeSpec,
    TreeSpecError,
    Trie,
    build_static_tree,
    build_trie,
    parse_tree,
)


def test_parse_tree_accepts_strings_and_lists():
    assert parse_tree("1,3,3,3") == (1, 3, 3, 3)
    assert parse_tree("[2, 2]") == (2, 2)
    assert parse_tree([1, 2]) == (1, 2)


@pytest.mark.parametrize("bad", ["", "1,,3", "a,b", "0,3", "-1", "1,3,x"])
def test_malformed_tree_strings_are_refused(bad):
    with pytest.raises(TreeSpecError):
        parse_tree(bad)


def test_a_tree_plan_is_parsed_once_into_a_typed_value_with_the_same_text_form():
    assert TreeSpec.parse("auto") == TreeSpec(auto=True) and str(TreeSpec(auto=True)) == "auto"
    assert TreeSpec.parse("1,3,3,3") == TreeSpec(auto=False, branching=(1, 3, 3, 3))
    assert str(TreeSpec.parse("[2, 2]")) == "2,2" and TreeSpec.parse((1, 2)).branching == (1, 2)
    with pytest.raises(TreeSpecError):
        TreeSpec.parse("AUTO")
    # a config takes the text (or a TreeSpec) and holds it parsed; flat settings and journals keep the text
    config = GenerationConfig(max_new_tokens=4, tree="1,3,3")
    assert (
        config.tree == TreeSpec(auto=False, branching=(1, 3, 3)) == GenerationConfig(4, tree=config.tree).tree
    )
    assert settings_of(config)["tree"] == "1,3,3" and config_from({}, settings_of(config)) == config
    assert journal_header([1], GenerationConfig(max_new_tokens=4, seed=0))["settings"]["tree"] == "auto"
    assert GenerationConfig(max_new_tokens=4).tree.auto
    with pytest.raises(GenerationError, match="e.g. 1,3,3,3, or auto"):
        config_from({}, {"max_new_tokens": 4, "tree": "0,3"})


def test_literal_static_tree_1_2():
    tree = build_static_tree("1,2")
    # nodes: 0 root, 1 = head0 rank0, 2/3 = head1 ranks 0/1 under node 1
    assert tree.paths == ((), (0,), (0, 0), (0, 1))
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 2, 2]
    assert tree.ranks.tolist() == [-1, 0, 0, 1]
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected)


def test_default_tree_has_40_nodes_below_the_root():
    tree = build_static_tree("1,3,3,3")
    assert tree.num_nodes == 1 + 1 + 3 + 9 + 27
    assert tree.depth == 4
    # every node sees exactly its depth + 1 nodes (itself and its ancestors)
    assert torch.equal(tree.mask.sum(dim=1), tree.depths + 1)


def test_trie_merges_tree_and_ngram_branches_without_duplicates():
    tree = build_static_tree("1,2")
    candidates = [[10], [20, 21]]
    trie = build_trie(5, tree, candidates, ngram_paths=[(10, 20, 30, 31), (12, 13, 14, 15)])
    assert trie.tokens[0] == 5
    # tree: 10 -> {20, 21}; n-gram 10,20,30,31 extends the 20 branch; 12,... is new
    assert len(trie) == 1 + 3 + 2 + 4
    node_10 = trie.children[0][10]
    node_20 = trie.children[node_10][20]
    node_30 = trie.children[node_20][30]
    assert trie.from_tree[node_20] and not trie.from_tree[node_30]
    assert trie.depths[trie.children[node_30][31]] == 4
    mask = trie.mask()
    leaf = trie.children[node_30][31]
    assert mask[leaf].nonzero().flatten().tolist() == [0, node_10, node_20, node_30, leaf]


def test_ngrams_keyed_by_the_root_hang_their_continuation_under_it():
    tree = build_static_tree("2")
    trie = build_trie(
        5, tree, [[10, 11]], ngram_paths=[(5, 10, 40, 41), (5, 12, 13, 14)], ngrams_from_root=True
    )
    assert len(trie) == 1 + 2 + 2 + 3  # 10 and 11 from the tree; 40, 41 under 10; 12, 13, 14 new
    node_10 = trie.children[0][10]
    assert trie.depths[trie.children[trie.children[node_10][40]][41]] == 3
    assert 5 not in trie.children[0]
    node_12 = trie.children[0][12]
    assert trie.ngram_ranks[node_12] == 1 and trie.ngram_ranks[trie.children[node_10][40]] == 0


def test_tree_path_marks_ngram_node_as_tree_when_both_propose_it():
    trie = Trie(1)
    trie.add_path([2, 3], from_tree=False)
    trie.add_path([2], from_tree=True)
    assert trie.from_tree[trie.children[0][2]]
    assert not trie.from_tree[trie.children[trie.children[0][2]][3]]
