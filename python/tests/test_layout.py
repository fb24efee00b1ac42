"""The sharded layout (``gradsync.torch.sharding.layout``) on its own, no
process group: every rank's pieces tile every parameter exactly once, each
rank's view of the others (``every_piece``) is what they lay out
themselves, and a buddy's pieces are its owner's, placed after the own
partition in the lent buffer."""

import pytest
import torch

from gradsync.torch.sharding.layout import Layout


def _params():
    """Parameters of awkward sizes and layouts: a complex one (two reals per
    value), a transposed one (not contiguous), a float64 one."""
    return [
        torch.zeros(7),
        torch.zeros(3, 5),
        torch.zeros(4, dtype=torch.complex64),
        torch.zeros(6, 2).t(),
        torch.zeros(11, dtype=torch.float64),
        torch.zeros(1),
    ]


def _reals(p):
    return p.numel() * (2 if p.is_complex() else 1)


# Two buckets in the runtime's order (reverse registration), members back to back.
PLAN = [(0, [5, 4, 3]), (0, [2, 1, 0])]


def _layout(rank, world, stride=0):
    params = _params()
    plan = [(sum(_reals(params[i]) for i in members), members) for _, members in PLAN]
    return Layout(plan, params, rank, world, _reals, stride)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_every_ranks_pieces_tile_every_parameter_once(world):
    covered = {i: [] for i in range(len(_params()))}
    for rank in range(world):
        for piece in _layout(rank, world).pieces:
            covered[piece.param].append((piece.offset, piece.length))
            assert piece.tensor.numel() == piece.length
            assert piece.owned == (piece.param == 3), "only the transposed parameter holds its values itself"
    for i, runs in covered.items():
        runs.sort()
        at = 0
        for offset, length in runs:
            assert offset == at, (i, runs)
            at += length
        assert at == _reals(_params()[i]), (i, runs)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_piece_is_what_each_rank_lays_out(world):
    layouts = [_layout(rank, world) for rank in range(world)]
    for i in range(len(_params())):
        seen = sorted(((rank, p.offset, p.length) for rank, lay in enumerate(layouts) for p in lay.of_param.get(i, ())),
                      key=lambda piece: piece[1])
        for lay in layouts:
            assert lay.every_piece(i) == seen


@pytest.mark.parametrize("world,stride", [(2, 1), (4, 1), (4, 2), (5, 3)])
def test_a_buddys_pieces_are_its_owners_placed_after_the_own_partition(world, stride):
    for rank in range(world):
        mine = _layout(rank, world, stride)
        owner = _layout((rank + stride) % world, world)
        assert [(p.param, p.bucket, p.start, p.length, p.offset) for p in mine.buddy_pieces] == \
            [(p.param, p.bucket, p.start, p.length, p.offset) for p in owner.pieces]
        for b, layout in enumerate(mine.buckets):
            own = layout.mine[1] - layout.mine[0]
            for piece in mine.held_of_bucket.get(b, ()):
                if piece in mine.buddy_pieces:
                    assert piece.held_at >= own
                else:
                    assert piece.held_at == piece.start - layout.mine[0]


def test_pieces_of_contiguous_parameters_are_views_of_them():
    lay = _layout(1, 3)
    for piece in lay.pieces:
        p = lay.params[piece.param]
        if piece.owned:
            continue
        piece.tensor.fill_(piece.param + 1)
        flat = torch.view_as_real(p) if p.is_complex() else p
        assert (flat.reshape(-1)[piece.offset : piece.offset + piece.length] == piece.param + 1).all()
