"""Draft trees: the static tree over draft-head candidates, and the per-iteration trie.

Terms: the *root* is the last sampled token (not yet in the KV cache); node 0 of every tree is the
root. A node at depth d proposes a token for position root + d. In the static tree a node at
depth d takes the candidate of rank `rank` from head d-1 (head 0 is the base model's own head).

The trie has two forms: `Trie` / `build_trie` on the host (nodes appended as paths are merged), and
`TrieSlots` / `TrieTensors` on the device (a fixed slot layout, duplicates masked out, no value read
back), holding the same paths (tests/decode/test_tree.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tokenswift_trt.decode.ngram import NGRAM_LENGTH

# Draft candidates, best first: per depth (every node of a depth has the same children; head d's
# list) or per node (keyed by the node's candidate-rank path, () for the root: drafts that follow
# their own branch's tokens, `draft_layers.PathInput`).
Candidates = list[list[int]] | dict[tuple[int, ...], list[int]]


AUTO_TREE = "auto"  # the tree plan tuned while generating


class TreeSpecError(ValueError):
    """A tree string such as `1,3,3,3` is malformed."""


def parse_tree(spec: str | Sequence[int]) -> tuple[int, ...]:
    """'1,3,3,3' -> (1, 3, 3, 3): candidates per node at each depth."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.strip().strip("[]").split(",")]
        try:
            branching = tuple(int(p) for p in parts)
        except ValueError:
            raise TreeSpecError(
                f"tree {spec!r} must be comma-separated positive integers, e.g. 1,3,3,3, or auto"
            ) from None
    else:
        branching = tuple(int(b) for b in spec)
    if not branching or any(b < 1 for b in branching):
        raise TreeSpecError(f"tree {spec!r} must be comma-separated positive integers, e.g. 1,3,3,3, or auto")
    if len(branching) > 8:
        raise TreeSpecError(f"tree {spec!r} is deeper than 8 levels: give at most 8 widths (e.g. 1,3,3,3)")
    return branching


@dataclass(frozen=True)
class TreeSpec:
    """A request's tree plan, parsed once where the request enters: `auto` (tuned while generating,
    decode/autotune.py) or a static tree of `branching` widths (candidates per node at each depth).
    Its text form (`str`: "auto" or "1,3,3,3") is what flags, requests, journals and manifests carry."""

    auto: bool
    branching: tuple[int, ...] = ()  # () with auto

    @classmethod
    def parse(cls, spec: TreeSpec | str | Sequence[int]) -> TreeSpec:
        """'auto', '1,3,3,3' ('[1, 3]' and a sequence of widths too), or a TreeSpec as it is; raises
        TreeSpecError naming a bad one."""
        if isinstance(spec, TreeSpec):
            return spec
        if spec == AUTO_TREE:
            return cls(auto=True)
        return cls(auto=False, branching=parse_tree(spec))

    def __str__(self) -> str:
        return AUTO_TREE if self.auto else ",".join(str(width) for width in self.branching)


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [N] (root's parent = -1) -> mask [N, N] bool, node i sees itself and its ancestors."""
    count = parents.numel()
    mask = torch.eye(count, dtype=torch.bool)
    rows = torch.arange(count)
    ancestor = parents.clamp(min=0)
    for _ in range(depth):
        mask[rows, ancestor] = True
        ancestor = parents.clamp(min=0)[ancestor]
    return mask


@dataclass(frozen=True)
class StaticTree:
    branching: tuple[int, ...]
    parents: torch.Tensor  # [N] int64, -1 for the root
    depths: torch.Tensor  # [N] int64
    ranks: torch.Tensor  # [N] int64, candidate rank in head depth-1; -1 for the root
    mask: torch.Tensor  # [N, N] bool
    paths: tuple[tuple[int, ...], ...]  # [N] candidate ranks from depth 1 to the node

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.branching)


def build_static_tree(spec: str | Sequence[int]) -> StaticTree:
    """Every node at depth d has branching[d] children (ranks 0..b-1), breadth first. Memoised by
    shape (every request builds its tree; the tensors are shared: read them, do not modify them)."""
    return _static_tree_of(parse_tree(spec))


@functools.lru_cache(maxsize=64)
def _static_tree_of(branching: tuple[int, ...]) -> StaticTree:
    paths: list[tuple[int, ...]] = [()]
    parents, frontier = [-1], [0]
    for width in branching:
        next_frontier = []
        for parent in frontier:
            for rank in range(width):
                paths.append(paths[parent] + (rank,))
                parents.append(parent)
                next_frontier.append(len(paths) - 1)
        frontier = next_frontier
    parent_tensor = torch.tensor(parents, dtype=torch.long)
    return StaticTree(
        branching=branching,
        parents=parent_tensor,
        depths=torch.tensor([len(p) for p in paths], dtype=torch.long),
        ranks=torch.tensor([p[-1] if p else -1 for p in paths], dtype=torch.long),
        mask=ancestor_mask(parent_tensor, len(branching)),
        paths=tuple(paths),
    )


class Trie:
    """De-duplicated merge of candidate paths after the root; one verification forward covers it.

    from_tree[i] is True when node i belongs to the static tree (else it came from an n-gram);
    tree_paths[i] is its candidate-rank path in the static tree (None if not in it) and
    ngram_ranks[i] the best rank of an n-gram branch through it (None if none), which lets the
    tree tuner tell which nodes a smaller tree or k would also have had.
    """

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.from_tree: list[bool] = [True]
        self.tree_paths: list[tuple[int, ...] | None] = [()]
        self.ngram_ranks: list[int | None] = [None]

    def __len__(self) -> int:
        return len(self.tokens)

    def add_path(
        self,
        tokens: Iterable[int],
        from_tree: bool,
        tree_path: tuple[int, ...] = (),
        ngram_rank: int | None = None,
    ) -> int:
        """Insert the path root -> tokens...; returns its last node."""
        node = 0
        for depth, token in enumerate(tokens, start=1):
            child = self.children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
                self.children.append({})
                self.from_tree.append(False)
                self.tree_paths.append(None)
                self.ngram_ranks.append(None)
                self.children[node][token] = child
            if from_tree:
                self.from_tree[child] = True
                self.tree_paths[child] = tree_path[:depth] if tree_path else None
            if ngram_rank is not None:
                best = self.ngram_ranks[child]
                self.ngram_ranks[child] = ngram_rank if best is None else min(best, ngram_rank)
            node = child
        return node

    def mask(self) -> torch.Tensor:
        """[N, N] bool ancestor mask (shared between tries of one shape: read it, do not modify it)."""
        return _ancestor_mask_of(tuple(self.parents), max(self.depths))


@functools.lru_cache(maxsize=256)
def _ancestor_mask_of(parents: tuple[int, ...], depth: int) -> torch.Tensor:
    """`ancestor_mask` memoised by the parents list (`depth` follows from it): a static tree
    without n-gram branches has the same shape every iteration, so the mask is built once."""
    return ancestor_mask(torch.tensor(parents, dtype=torch.long), depth)


def build_trie(
    root_token: int,
    tree: StaticTree,
    head_candidates: Candidates,
    ngram_paths: Sequence[Sequence[int]] = (),
    ngrams_from_root: bool = False,
) -> Trie:
    """Static tree filled from the draft candidates (per depth or per node, `Candidates`), plus
    n-gram branches, merged into one trie.

    N-gram paths start with a depth-1 token, or with the root itself when `ngrams_from_root`
    (drafting from the verify pass, where the root is head 0's token): that first token is then
    dropped.
    """
    trie = Trie(root_token)
    for path in tree.paths:
        if len(path) == tree.depth:  # leaves; their ancestors come with them
            if isinstance(head_candidates, dict):
                tokens = [head_candidates[path[:depth]][rank] for depth, rank in enumerate(path)]
            else:
                tokens = [head_candidates[depth][rank] for depth, rank in enumerate(path)]
            trie.add_path(tokens, from_tree=True, tree_path=path)
    ranks: dict[int, int] = {}
    for path in ngram_paths:  # rank = position among the grams of the same first token
        rank = ranks.get(path[0], 0)
        ranks[path[0]] = rank + 1
        trie.add_path(path[1:] if ngrams_from_root else path, from_tree=False, ngram_rank=rank)
    return trie


@dataclass
class TrieTensors:
    """`Trie` on the device: one iteration's trie in fixed slots (S of them); dead slots are duplicates
    of an earlier slot's path, empty n-gram branches and padding."""

    tokens: torch.Tensor  # [S] int64
    depths: torch.Tensor  # [S] int64
    parents: torch.Tensor  # [S] int64: canonical parent slot (0 for the root and dead slots)
    live: torch.Tensor  # [S] bool
    mask: torch.Tensor  # [S, S] bool: a live slot sees itself and its live ancestors
    paths: torch.Tensor  # [S, Dmax] each slot's tokens after the root, -1 past its depth
    # [S]: a live slot's best n-gram rank among the branches through its path (`Trie.ngram_ranks`),
    # -1 where none passes through it, -2 for dead slots
    ngram_ranks: torch.Tensor


class TrieSlots:
    """The fixed slot layout of `build_trie(root, tree, candidates, grams, ngrams_from_root=True)`:
    slot 0 the root, then the static tree's nodes (breadth first), then k n-gram branches of 3 slots
    each (root -> g1 -> g2 -> g3), then a long match's branch of `long_depth` slots (root -> l1 ->
    ... ; n-gram rank 0, as the host loop adds it), then padding to `size`."""

    def __init__(
        self, tree: StaticTree, ngram_topk: int, size: int, device: torch.device, long_depth: int = 0
    ) -> None:
        tree_nodes = tree.num_nodes
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        ranks = [-1] * tree_nodes  # each slot's n-gram branch rank (-1: a tree slot)
        for rank in range(ngram_topk):
            for step in range(NGRAM_LENGTH - 1):
                parents.append(0 if step == 0 else len(parents) - 1)
                depths.append(step + 1)
                ranks.append(rank)
        for step in range(long_depth):
            parents.append(0 if step == 0 else len(parents) - 1)
            depths.append(step + 1)
            ranks.append(0)
        used = len(parents)
        if size < used:
            raise ValueError(f"{used} trie slots do not fit in {size}")
        parents += [-1] * (size - used)
        depths += [0] * (size - used)
        ranks += [-1] * (size - used)
        self.tree, self.ngram_topk, self.long_depth = tree, ngram_topk, long_depth
        self.size, self.tree_nodes, self.used = size, tree_nodes, used
        self.max_depth = max(depths)
        self.width = max(tree.branching)
        # static tree node i takes candidate `ranks[i]` of depth `depths[i]`: a flat index into [D, width]
        self.candidate_index = torch.tensor(
            [(d - 1) * self.width + r for d, r in zip(tree.depths.tolist()[1:], tree.ranks.tolist()[1:])],
            dtype=torch.long,
            device=device,
        )
        # ancestors[i, d - 1]: the slot at depth d on slot i's path (-1 past its depth)
        ancestors = [[-1] * self.max_depth for _ in range(size)]
        for slot in range(1, used):
            node = slot
            while node > 0:
                ancestors[slot][depths[node] - 1] = node
                node = parents[node]
        self.ancestors = torch.tensor(ancestors, dtype=torch.long, device=device)  # [S, Dmax]
        self.depths = torch.tensor(depths, dtype=torch.long, device=device)  # [S]
        self.parents = torch.tensor(parents, dtype=torch.long, device=device).clamp(min=0)  # [S]
        self.no_rank = no_rank = ngram_topk  # above every rank
        self.branch_ranks = torch.tensor(
            [no_rank if r < 0 else r for r in ranks], dtype=torch.long, device=device
        )  # [S]
        self.arange = torch.arange(size, device=device)

    def assemble(
        self,
        root: torch.Tensor,
        ranked: torch.Tensor,
        grams: torch.Tensor,
        gram_valid: torch.Tensor,
        long_tokens: torch.Tensor | None = None,
        long_valid: torch.Tensor | None = None,
    ) -> TrieTensors:
        """root 0-d, ranked [D, width] candidate ids, grams [k, 3], gram_valid [k], and with a long
        match's slots long_tokens / long_valid [>= long_depth] (valid: a prefix) -> the trie."""
        size, device = self.size, root.device
        long = self.long_depth
        if long:
            assert long_tokens is not None and long_valid is not None, "this layout has long-match slots"
            long_tokens, long_valid = long_tokens[:long], long_valid[:long]
        else:
            long_tokens, long_valid = root.new_zeros(0), torch.zeros(0, dtype=torch.bool, device=device)
        tokens = torch.cat(
            (
                root[None],
                ranked.reshape(-1)[self.candidate_index],
                grams.reshape(-1),
                long_tokens,
                root.new_zeros(size - self.used),
            )
        )  # [S]
        valid = torch.cat(
            (
                torch.ones(self.tree_nodes, dtype=torch.bool, device=device),
                gram_valid.repeat_interleave(NGRAM_LENGTH - 1),
                long_valid,
                torch.zeros(size - self.used, dtype=torch.bool, device=device),
            )
        )  # [S]
        known = self.ancestors >= 0
        paths = torch.where(known, tokens[self.ancestors.clamp(min=0)], -1)  # [S, Dmax]
        same = (paths[:, None, :] == paths[None, :, :]).all(-1) & valid[None, :]  # [S, S]
        first = same.long().argmax(dim=1)  # the first valid slot with the same path
        canonical = torch.where(valid, first, self.arange)
        live = valid & (canonical == self.arange)
        chain = torch.where(known, canonical[self.ancestors.clamp(min=0)], 0)  # [S, Dmax]
        mask = torch.zeros(size, size, dtype=torch.bool, device=device)
        mask.scatter_(1, chain, known)  # slot 0 (root) may receive a False from an unknown entry
        mask[:, 0].fill_(True)  # a fill: `= True` copies a host value, refused in a graph capture
        mask |= torch.eye(size, dtype=torch.bool, device=device)
        best = torch.where(same, self.branch_ranks[None, :], self.no_rank).amin(dim=1)  # [S]
        ngram_ranks = torch.where(live, torch.where(best < self.no_rank, best, -1), -2)
        return TrieTensors(tokens, self.depths, canonical[self.parents], live, mask, paths, ngram_ranks)

    def features(self, ngram_ranks: list[int]) -> Trie:
        """A host `Trie` holding what the tuner reads of a device trie (`autotune.ProbeRecorder.record`):
        per slot its static-tree rank path and best n-gram rank (dead slots neither), from
        `TrieTensors.ngram_ranks` read back."""
        trie = Trie(0)
        trie.tree_paths = [
            self.tree.paths[slot] if slot < self.tree_nodes and rank > -2 else None
            for slot, rank in enumerate(ngram_ranks)
        ]
        trie.ngram_ranks = [rank if rank >= 0 else None for rank in ngram_ranks]
        return trie
